"""Ends a multi-process job cleanly when one of its processes dies.

Without a launcher that watches the processes (`experiments.launch_local` does), a
process whose peer died blocks in a collective, or in JAX's shutdown barrier after its
collective failed, until JAX's own heartbeat (100 s) aborts it with a C++ stack dump.
`install()` (called by `train_step.maybe_initialize_distributed`) starts a daemon
thread in every process that, every `interval` seconds, bumps this process's counter
in the coordination service's key-value store and reads the others'. A process then
exits (status `EXIT_PEER_LOST`) with one line on stderr, naming the peer and the
checkpoint to resume from (`register_checkpoints`), when

  * a peer's counter has not moved for `timeout` seconds (it was killed, its host went
    down, or it hangs with the GIL held), or
  * a peer failed with a Python exception (it published its error before exiting), or
  * the coordination service (process 0) has been unreachable for `timeout` seconds.

A process that ends normally says so first (`atexit`), so its peers do not take its
silence for a death, and stops the thread before JAX shuts down. A process that fails
with an uncaught exception prints its traceback as usual, publishes the error, and
exits once its peers have seen it (at most `timeout` seconds), instead of waiting in
JAX's shutdown barrier.

Liveness needs the GIL now and then: a peer that holds it for longer than `timeout`
(no known JAX / XLA call does; compilation and collectives release it) would be taken
for dead. TREECREDIT_PEER_TIMEOUT sets `timeout` (seconds, default 20); 0 turns the
watchdog off.
"""

import atexit
import os
import re
import sys
import threading
import time
import traceback
from typing import Callable, Optional

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: rerun (all processes) to resume
DEFAULT_TIMEOUT = 20.0
PREFIX = 'treecredit/watchdog'

# Runtime errors of a collective whose peer is gone (Gloo's on CPU, a closed connection).
_PEER_ERROR = re.compile(r'^(JaxRuntimeError|XlaRuntimeError): .*(gloo|Gloo|[Cc]onnection|'
                         r'[Ss]ocket|UNAVAILABLE|[Pp]eer)', re.S)
_checkpoints: dict = {'dir': None}
_watchdog: Optional['Watchdog'] = None


def register_checkpoints(directory: str):
  """Names `directory` (orbax steps as subdirectories) in the message of a lost peer."""
  _checkpoints['dir'] = os.path.abspath(directory)


def latest_step(directory: Optional[str]) -> Optional[int]:
  """The newest finished orbax step in `directory` (temporary dirs are not steps)."""
  if not directory or not os.path.isdir(directory):
    return None
  steps = [int(n) for n in os.listdir(directory)
           if re.fullmatch(r'\d+', n) and os.path.isdir(os.path.join(directory, n))]
  return max(steps) if steps else None


def resume_hint(directory: Optional[str] = None) -> str:
  directory = directory or _checkpoints['dir']
  if directory is None:
    return 'no checkpoint directory was registered'
  step = latest_step(directory)
  if step is None:
    return f'no checkpoint in {directory} yet; rerun all processes to start over'
  return (f'rerun all processes with the same arguments to resume from step {step} '
          f'of {directory}')


def timeout_from_env(env=None) -> float:
  env = os.environ if env is None else env
  raw = env.get('TREECREDIT_PEER_TIMEOUT', '')
  try:
    value = float(raw) if raw else DEFAULT_TIMEOUT
  except ValueError:
    raise ValueError(f'TREECREDIT_PEER_TIMEOUT={raw!r}: expected seconds (0 = off)') from None
  if value < 0:
    raise ValueError(f'TREECREDIT_PEER_TIMEOUT={raw!r}: expected seconds >= 0 (0 = off)')
  return value


def _one_line(text: str, limit: int = 300) -> str:
  text = ' '.join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + '...'


class Watchdog(threading.Thread):
  """Heartbeats through `client` (a `DistributedRuntimeClient`) and watches the peers'.

  `exit_fn(status)` ends the process (`os._exit`; tests pass their own). Keys under
  PREFIX: alive/<i> (a counter), exited/<i> (ended normally), failed/<i> (its error),
  ack/<i>/<j> (j saw i fail), stopped/<i> (about to exit after a failure). Process 0
  hosts the coordination service, so it exits last: a peer that loses the service
  before it exits is aborted by JAX with a C++ stack dump.
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout: float = DEFAULT_TIMEOUT,
               interval: float = 1.0, exit_fn: Callable[[int], None] = os._exit,
               stream=None, clock: Callable[[], float] = time.monotonic):
    super().__init__(name='treecredit-watchdog', daemon=True)
    self.client, self.pid, self.n = client, process_id, num_processes
    self.timeout, self.interval = timeout, interval
    self.exit_fn, self.stream, self.clock = exit_fn, stream, clock
    self.failed = None  # this process's own error (set on an uncaught exception)
    self.status = 1  # its exit status then (130 for KeyboardInterrupt, as Python's)
    self.stop = threading.Event()
    self._count = 0
    now = clock()
    self._seen = {i: (None, now) for i in range(num_processes) if i != process_id}
    self._unreachable_since = None
    self._ended = False

  def key(self, *parts) -> str:
    return '/'.join((PREFIX,) + tuple(str(p) for p in parts))

  def _set(self, *parts, value: str = '1'):
    self.client.key_value_set(self.key(*parts), value, allow_overwrite=True)

  def beat(self):
    self._count += 1
    self._set('alive', self.pid, value=str(self._count))

  def snapshot(self) -> dict:
    """{'alive': {i: counter}, 'failed': {i: error}, 'exited' / 'stopped': {i}, 'ack': {(i, j)}}."""
    out = dict(alive={}, exited=set(), failed={}, stopped=set(), ack=set())
    for k, v in self.client.key_value_dir_get(PREFIX + '/'):
      parts = k[len(PREFIX):].strip('/').split('/') if k.startswith(PREFIX) else []
      if len(parts) == 2 and parts[0] in ('alive', 'failed'):
        out[parts[0]][int(parts[1])] = v
      elif len(parts) == 2 and parts[0] in ('exited', 'stopped'):
        out[parts[0]].add(int(parts[1]))
      elif len(parts) == 3 and parts[0] == 'ack':
        out['ack'].add((int(parts[1]), int(parts[2])))
    return out

  def _silent(self, snap: dict, now: float) -> dict:
    """{peer: seconds since its counter last moved}, for peers still expected to beat."""
    out = {}
    for i, (count, since) in self._seen.items():
      new = snap['alive'].get(i)
      if new != count:
        self._seen[i] = (new, now)
      elif i not in snap['exited'] and i not in snap['stopped'] and i not in snap['failed']:
        out[i] = now - since
    return out

  def check(self) -> Optional[str]:
    """One round: heartbeat, read the peers; the reason to stop, or None."""
    now = self.clock()
    try:
      self.beat()
      snap = self.snapshot()
      for i in snap['failed']:
        if i != self.pid and (i, self.pid) not in snap['ack']:
          self._set('ack', i, self.pid)
    except Exception as e:  # the coordination service (process 0) is gone or unreachable
      if self._unreachable_since is None:
        self._unreachable_since = now
      if now - self._unreachable_since >= self.timeout:
        return (f'process 0 of {self.n} (the coordinator, {_coordinator()}) has been '
                f'unreachable for {now - self._unreachable_since:.0f} s ({_one_line(e, 120)})')
      return None
    self._unreachable_since = None
    others = {i: e for i, e in snap['failed'].items() if i != self.pid}
    if others and self.failed is None:  # if ours failed too, the root cause may be a death
      i = min(others)
      return f'process {i} of {self.n} failed ({_one_line(others[i], 160)}; see its log)'
    for i, silent in sorted(self._silent(snap, now).items()):
      if silent >= self.timeout:
        return f'process {i} of {self.n} died or hangs (no heartbeat for {silent:.0f} s)'
    return None

  def _wait_for_peers(self, done):
    """Waits (at most timeout + 2 intervals) until `done(peer, snap)` holds for every
    peer that is not silent for `timeout` (dead) or gone."""
    deadline = self.clock() + self.timeout + 2 * self.interval
    while self.clock() < deadline:
      try:
        snap = self.snapshot()
      except Exception:  # the coordinator is gone: nobody left to wait for
        return
      now = self.clock()
      silent = self._silent(snap, now)
      waiting = [j for j in self._seen if silent.get(j, 0) < self.timeout
                 and j not in snap['exited'] and j not in snap['stopped'] and not done(j, snap)]
      if not waiting:
        return
      time.sleep(self.interval / 4)

  def _coordinator_last(self):
    if self.pid == 0:  # the others exit first, while the service is still there
      self._wait_for_peers(lambda j, snap: False)

  def stop_job(self, reason: str):
    if self._ended:
      return
    self._ended = True
    line = (f'treecredit: {reason}; stopping process {self.pid} of {self.n}: '
            f'{resume_hint()}.\n')
    _flush()
    try:
      self._set('stopped', self.pid)
    except Exception:
      pass
    stream = self.stream or sys.stderr
    try:
      stream.write(line)
      stream.flush()
    except Exception:
      os.write(2, line.encode())
    self._coordinator_last()
    self.exit_fn(EXIT_PEER_LOST)

  def run(self):
    while not self.stop.is_set() and not self._ended:
      reason = self.check()
      if reason is not None:
        self.stop_job(reason)
        return
      self.stop.wait(self.interval)

  def halt(self):
    """Stops the thread and waits for it, so that no call of it into the coordination
    client is in flight during JAX's shutdown and interpreter exit (a daemon thread
    still inside that C++ client then aborts the process: "terminate called after
    throwing an instance of ''", seen once in CI after a finished run)."""
    self.stop.set()
    if self.is_alive() and threading.current_thread() is not self:
      self.join(timeout=self.timeout + 2 * self.interval)

  # -- this process ending ------------------------------------------------------------

  def on_exception(self, exc_type, exc, tb):
    self.failed = _one_line(''.join(traceback.format_exception_only(exc_type, exc)), 200)
    self.status = 130 if issubclass(exc_type, KeyboardInterrupt) else 1

  def excepthook(self, previous: Callable) -> Callable:
    """sys.excepthook: records the error; a collective's runtime error that a lost peer may
    explain (`_PEER_ERROR`: Gloo's, a closed connection) waits up to `timeout` for this
    watchdog's verdict, so that its one line comes alone instead of after the traceback;
    any other error, or no lost peer, prints the traceback as usual."""
    def hook(exc_type, exc, tb):
      self.on_exception(exc_type, exc, tb)
      if _PEER_ERROR.search(f'{exc_type.__name__}: {exc}') and self.await_verdict():
        return  # the watchdog said it in one line and ends the process
      previous(exc_type, exc, tb)
    return hook

  def await_verdict(self) -> bool:
    """Waits up to timeout + 2 intervals for the thread to stop the job; True if it did.
    A verdict is then waited out too (its line written, `exit_fn` called), so that the
    caller does not go on into the interpreter's exit while the thread is still ending it."""
    deadline = self.clock() + self.timeout + 2 * self.interval
    while not self._ended and self.clock() < deadline and self.is_alive():
      time.sleep(min(self.interval, 0.05))
    if self._ended and self.is_alive() and threading.current_thread() is not self:
      self.join(timeout=self.timeout + 2 * self.interval)
    return self._ended

  def on_exit(self):
    """atexit, before JAX's shutdown: a normal end says so; after an uncaught exception
    the error is published, and the process exits once its peers have seen it (instead
    of waiting in JAX's shutdown barrier for peers blocked in a collective)."""
    try:
      self._set('exited' if self.failed is None else 'failed', self.pid,
                value=self.failed or '1')
    except Exception:  # coordinator gone: nobody to tell or wait for
      if self.failed is not None:
        _flush()
        self.exit_fn(self.status)
      return
    if self.failed is None:
      self.halt()
      return
    # The watchdog thread may end this process first (a dead peer caused the error).
    self._wait_for_peers(lambda j, snap: (self.pid, j) in snap['ack'])
    if self._ended:
      return
    self._ended = True
    try:
      self._set('stopped', self.pid)
    except Exception:
      pass
    self._coordinator_last()
    _flush()
    self.exit_fn(self.status)


def _flush():
  for s in (sys.stdout, sys.stderr):
    try:
      s.flush()
    except Exception:
      pass


def _coordinator() -> str:
  return os.environ.get('JAX_COORDINATOR_ADDRESS') or 'its address'


def install(timeout: Optional[float] = None, interval: float = 1.0) -> Optional[Watchdog]:
  """Starts the watchdog of this process (after `jax.distributed.initialize`); idempotent.

  No-op (None) for a single process or with timeout 0 (TREECREDIT_PEER_TIMEOUT=0).
  """
  global _watchdog
  import jax
  from jax._src import distributed
  timeout = timeout_from_env() if timeout is None else timeout
  client = distributed.global_state.client
  if _watchdog is not None or not timeout or client is None or jax.process_count() < 2:
    return _watchdog
  wd = Watchdog(client, jax.process_index(), jax.process_count(), timeout, interval)
  wd.beat()
  sys.excepthook = wd.excepthook(sys.excepthook)
  atexit.register(wd.on_exit)  # runs before JAX's shutdown (registered at import, earlier)
  wd.start()
  _watchdog = wd
  return wd
