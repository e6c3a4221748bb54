"""Multi-process training on localhost CPU (JAX distributed runtime, gloo collectives).

2 processes x 2 CPU devices run the quick config and give the same metrics and params
as 1 process x 4 devices (same mesh), and orbax checkpoints written by either restore
in the other and training continues identically. Processes are started with
`experiments.launch_local`; this file is also their driver (`__main__` below).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

TIMING = ('wall_s', 'sample_s', 'logprob_s', 'credit_s', 'update_s', 'step_s',
          'sampled_tokens_per_s', 'train_tokens_per_s', 'credit_frac')
METHOD = 'tempo:iid'
DEVICES = 4
# Same mesh (data=4) either way; only the all-reduces differ (in-process vs gloo).
# Observed: bit-identical; the tolerances allow a different reduction order.
LOSS_ATOL, PARAM_ATOL = 1e-6, 1e-5


def quick_cfg(steps: int):
  from configs import tempo as tempo_config
  cfg = tempo_config.shrink(tempo_config.get_config())
  cfg.quick, cfg.progress = False, False
  # From random init: a one-symbol key task that such a policy sometimes solves (rewards
  # 0 and 1 in some groups), and an entropy bonus, so every step changes the params.
  cfg.task.name, cfg.task.kwargs = 'token_tree', dict(num_symbols=2, depth=1, num_decisive=1)
  cfg.loss.entropy_coef = 0.01
  cfg.sampler.group_size = 8
  # A checkpoint and an eval every step: a 2-step run stopped at step 1 crosses a checkpoint.
  cfg.rl.update(steps=steps, ckpt_every=1, prompts_per_step=16)
  # pass@k's sampling of the same shape as the greedy one (1 sample of each of the 16
  # prompts; the temperature is traced): both run one compiled sampler.
  cfg.eval.update(every=1, num_prompts=16, pass_prompts=16, pass_k=1)
  return cfg


def drive(runs: str):
  """Runs `workdir:steps[,workdir:steps...]` in order; process 0 saves <workdir>/params.npz.

  With STALL=<process>:<step> that process, once its checkpoint of <step> is saved,
  writes <workdir>/stalled and sleeps (alive, heartbeating) until the test kills it.
  """
  from experiments.training import train_step as ts
  ts.maybe_initialize_distributed()
  import jax
  from experiments.training import loop, run_context
  if os.environ.get('STALL'):
    victim, at = map(int, os.environ['STALL'].split(':'))
    save = run_context.save_checkpoint  # where the loop's save looks it up

    def save_then_stall(mngr, step, *args, **kwargs):
      save(mngr, step, *args, **kwargs)
      if step == at and jax.process_index() == victim:
        open(os.path.join(os.path.dirname(str(mngr.directory)), 'stalled'), 'w').close()
        while True:
          time.sleep(1)

    run_context.save_checkpoint = save_then_stall
  from experiments.models import decoder
  assert jax.process_count() == int(os.environ['JAX_NUM_PROCESSES']), jax.process_count()
  assert jax.device_count() == DEVICES, jax.devices()
  for run in runs.split(','):
    workdir, steps = run.rsplit(':', 1)
    cfg = quick_cfg(int(steps))
    pcfg = loop.policy_config(cfg, loop.build_task(cfg))
    params0 = decoder.init_params(jax.random.PRNGKey(0), pcfg)  # compiled once per config
    summary = loop.train(cfg, workdir, params0, method=METHOD)
    flat = {jax.tree_util.keystr(p): ts.host_value(x)
            for p, x in jax.tree_util.tree_leaves_with_path(summary['params'])}
    if jax.process_index() == 0:
      np.savez(os.path.join(workdir, 'params.npz'), **flat)
    print(f'process {jax.process_index()}/{jax.process_count()}: {run} done', flush=True)


def base_env(cache: str) -> dict:
  # Compile time dominates: cheap XLA CPU codegen (the same in every run), and a
  # persistent cache so that each topology (1 x 4 or 2 x 2 devices) compiles once.
  flags = '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
  env = dict(os.environ, XLA_FLAGS=f'{flags} {os.environ.get("XLA_FLAGS", "")}',
             JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  for k in ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'STALL',
            'TREECREDIT_DISTRIBUTED'):
    env.pop(k, None)
  return env


def launch(num_processes: int, runs: list, cache: str, timeout: int = 300):
  env = base_env(cache)
  cmd = [sys.executable, '-m', 'experiments.launch_local', '--num_processes', str(num_processes),
         '--devices_per_process', str(DEVICES // num_processes), '--timeout', str(timeout - 10),
         '--', os.path.abspath(__file__), ','.join(runs)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
  assert proc.stdout.count(' done') == num_processes * len(runs), proc.stdout[-3000:]


def results(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl')) if l.strip()]
  rows = [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
  return rows, dict(np.load(os.path.join(workdir, 'params.npz')))


def assert_same(a, b):
  (rows_a, params_a), (rows_b, params_b) = a, b
  assert [r['step'] for r in rows_a] == [r['step'] for r in rows_b]
  for ra, rb in zip(rows_a, rows_b):
    assert ra.keys() == rb.keys()
    for k in ra:
      if isinstance(ra[k], float):
        np.testing.assert_allclose(ra[k], rb[k], atol=LOSS_ATOL, err_msg=f'step {ra["step"]} {k}')
      else:
        assert ra[k] == rb[k], (ra['step'], k)
  assert params_a.keys() == params_b.keys()
  for k in params_a:
    np.testing.assert_allclose(params_a[k], params_b[k], atol=PARAM_ATOL, err_msg=k)


def test_two_processes_match_one_and_checkpoints_cross(tmp_path):
  d = lambda name: str(tmp_path / name)
  # 1 process x 4 devices: the reference run, and a run stopped at step 1.
  launch(1, [d('one:2'), d('one_half:1')], d('jit_cache'))
  # 2 processes x 2 devices: the same run, and one resuming the 1-process checkpoint.
  launch(2, [d('two:2'), d('one_half:2')], d('jit_cache'))
  ref = results(d('one'))
  assert [r['step'] for r in ref[0]] == [0, 1, 2]
  assert all(np.isfinite(r['loss']) and r['loss'] != 0 for r in ref[0][1:])
  assert any(r.get('frac_groups_with_signal', 0) > 0 for r in ref[0])  # credit had signal
  assert_same(results(d('two')), ref)        # 2 processes == 1 process
  assert_same(results(d('one_half')), ref)   # 1-process checkpoint -> 2 processes


@pytest.mark.slow  # ~40 s: a third launch; the other direction of the test above
def test_checkpoint_of_two_processes_resumes_in_one(tmp_path):
  d = lambda name: str(tmp_path / name)
  launch(1, [d('one:2')], d('jit_cache'))
  # 2 processes stop at step 1 (the checkpoint written by both); 1 process resumes it.
  launch(2, [d('two_half:1')], d('jit_cache'))
  launch(1, [d('two_half:2')], d('jit_cache'))
  assert_same(results(d('two_half')), results(d('one')))
  assert sorted(os.listdir(d('two_half') + '/checkpoints')) == ['1', '2']


def start_by_hand(runs: list, cache: str, logs: str, **extra_env):
  """2 x 2-device processes started as on a pod (no launcher watching them); stdout and
  stderr of process i go to <logs>.<i>.out / .err."""
  from experiments import launch_local
  port = launch_local.free_port()
  env = dict(base_env(cache), **extra_env)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = []
  for i in range(2):
    with open(f'{logs}.{i}.out', 'w') as out, open(f'{logs}.{i}.err', 'w') as err:
      procs.append(subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), ','.join(runs)], cwd=root,
          env=launch_local.process_env(env, port, 2, i, DEVICES // 2), stdout=out, stderr=err))
  return procs


def wait_for(path: str, procs, timeout: float):
  deadline = time.time() + timeout
  while not os.path.exists(path):
    assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
    assert time.time() < deadline, f'{path} did not appear in {timeout} s'
    time.sleep(0.05)


PEER_TIMEOUT = 3  # seconds, for the small watchdog tests below


def run_collectives(tmp_path, mode: str, kill=None):
  """Starts `collectives(mode)` by hand; optionally SIGKILLs process `kill` once both run.

  Returns (exit statuses, stderr of each process, seconds from the kill to the exit of
  the other process)."""
  os.makedirs(tmp_path / 'run' / 'checkpoints' / '3')  # what the message names
  os.makedirs(tmp_path / 'run' / 'checkpoints' / '5.orbax-checkpoint-tmp-7')  # not a step
  logs = str(tmp_path / 'log')
  procs = start_by_hand([f'collectives:{mode}:{tmp_path / "run"}'], str(tmp_path / 'cache'),
                        logs, TREECREDIT_PEER_TIMEOUT=str(PEER_TIMEOUT))
  latency = None
  try:
    if kill is not None:
      for i in range(2):
        wait_for(str(tmp_path / 'run' / f'running.{i}'), procs, timeout=120)
      procs[kill].send_signal(signal.SIGKILL)
      t_kill = time.time()
      procs[1 - kill].wait(timeout=60)
      latency = time.time() - t_kill
    codes = [p.wait(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  return codes, [open(f'{logs}.{i}.err').read() for i in range(2)], latency


def watchdog_lines(err: str) -> list:
  return [l for l in err.splitlines() if l.startswith('treecredit:')]


def test_watchdog_killed_peer_ends_the_other_with_one_line(tmp_path):
  from experiments.training import watchdog
  codes, errs, latency = run_collectives(tmp_path, 'loop', kill=1)
  print(f'survivor exited {latency:.1f} s after the kill (timeout {PEER_TIMEOUT} s)')
  assert codes[0] == watchdog.EXIT_PEER_LOST, errs[0][-3000:]
  assert PEER_TIMEOUT - 1 <= latency < PEER_TIMEOUT + 10, latency
  lines = watchdog_lines(errs[0])
  assert len(lines) == 1, errs[0][-3000:]
  ckpt = str(tmp_path / 'run' / 'checkpoints')
  assert 'process 1 of 2 died' in lines[0] and f'resume from step 3 of {ckpt}' in lines[0]
  assert 'Check failure stack trace' not in errs[0], errs[0][-3000:]


def test_watchdog_failed_peer_ends_the_other_and_keeps_its_error(tmp_path):
  from experiments.training import watchdog
  codes, errs, _ = run_collectives(tmp_path, 'raise')
  assert codes == [watchdog.EXIT_PEER_LOST, 1], errs
  assert 'RuntimeError: boom in process 1' in errs[1]  # the real error, with its traceback
  assert 'Traceback' in errs[1] and not watchdog_lines(errs[1]), errs[1][-3000:]
  lines = watchdog_lines(errs[0])
  assert len(lines) == 1 and 'process 1 of 2 failed (RuntimeError: boom in process 1' in lines[0]
  assert 'Check failure stack trace' not in errs[0] + errs[1]


def test_watchdog_finished_peer_is_not_a_dead_one(tmp_path):
  codes, errs, _ = run_collectives(tmp_path, 'finish')
  assert codes == [0, 0], errs
  assert not any('terminate called' in e for e in errs), errs
  assert not watchdog_lines(errs[0] + errs[1]), errs


class FakeClient:
  """The two key-value calls of a coordination client, over a dict."""

  def __init__(self):
    self.kv, self.lock = {}, __import__('threading').Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.lock:
      self.kv[key] = value

  def key_value_dir_get(self, prefix):
    with self.lock:
      return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_watchdog_normal_end_stops_its_thread_before_jax_shuts_down():
  # A daemon thread still calling into the C++ client at interpreter exit aborted a
  # finished process once in CI ("terminate called after throwing an instance of ''").
  from experiments.training import watchdog
  client, exits = FakeClient(), []
  wd = watchdog.Watchdog(client, 1, 2, timeout=5, interval=0.01, exit_fn=exits.append)
  wd.start()
  time.sleep(0.1)
  assert wd.is_alive() and int(client.kv[wd.key('alive', 1)]) > 1  # it beats
  wd.on_exit()
  assert not wd.is_alive() and client.kv[wd.key('exited', 1)] == '1' and exits == []
  beats = client.kv[wd.key('alive', 1)]
  time.sleep(0.05)
  assert client.kv[wd.key('alive', 1)] == beats  # no call after the end


def test_watchdog_collective_error_of_a_lost_peer_gives_the_one_line_alone():
  """A collective's Gloo error in the main thread (the peer was killed mid all-reduce) waits
  for the watchdog's verdict, and for the thread to end the process: its one line comes
  alone, without the traceback before it. Any other error prints its traceback at once.
  (CI once saw the hook return between the verdict and `exit_fn`.)"""
  import io
  from experiments.training import watchdog
  JaxRuntimeError = type('JaxRuntimeError', (RuntimeError,), {})
  class SlowStream(io.StringIO):  # the verdict's line takes a while: the hook waits it out

    def write(self, text):
      time.sleep(0.2)
      return super().write(text)

  client, exits, stream, printed = FakeClient(), [], SlowStream(), []
  wd = watchdog.Watchdog(client, 1, 2, timeout=0.3, interval=0.05, exit_fn=exits.append,
                         stream=stream)
  hook = wd.excepthook(lambda *a: printed.append(a[1]))
  hook(ValueError, ValueError('a bug of this process'), None)
  assert [str(e) for e in printed] == ['a bug of this process'] and exits == []
  wd.start()  # peer 0 never beats: lost after 0.3 s
  err = JaxRuntimeError('INTERNAL: Gloo all-reduce failed: Connection closed by peer')
  # The error comes a little after the peer stopped (as a collective's does), so the hook's
  # wait (timeout + 2 intervals from now) ends well after the verdict even on a loaded host.
  time.sleep(0.2)
  t0 = time.time()
  hook(JaxRuntimeError, err, None)
  assert len(printed) == 1 and exits == [watchdog.EXIT_PEER_LOST], (printed, exits)
  assert stream.getvalue().startswith('treecredit: process 0 of 2') and time.time() - t0 < 5
  wd.halt()


@pytest.mark.slow  # ~3 minutes on 2 CPU cores (3 training jobs; compile dominates)
def test_killed_process_stops_the_other_and_resume_is_exact(tmp_path):
  """SIGKILL process 1 of a job started by hand after its step-2 checkpoint: process 0
  exits within ~20 s (the watchdog's timeout) with one line naming process 1 and the
  checkpoint; rerunning both resumes and gives the uninterrupted run's metric rows."""
  from experiments.training import watchdog
  d = lambda name: str(tmp_path / name)
  cache, logs = d('jit_cache'), d('killed')
  launch(2, [d('ref:4')], cache)  # the uninterrupted run (and the jit cache)
  procs = start_by_hand([d('run:4')], cache, logs, STALL='1:2')
  try:
    wait_for(d('run/stalled'), procs, timeout=240)
    procs[1].send_signal(signal.SIGKILL)
    t_kill = time.time()
    rc = procs[0].wait(timeout=60)
    latency = time.time() - t_kill
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  err = open(f'{logs}.0.err').read()
  print(f'survivor exited {latency:.1f} s after the kill, status {rc}')
  assert rc == watchdog.EXIT_PEER_LOST, err[-3000:]
  assert latency < 30, latency
  lines = [l for l in err.splitlines() if l.startswith('treecredit:')]
  assert len(lines) == 1, err[-3000:]
  ckpt = os.path.abspath(d('run/checkpoints'))
  assert 'process 1 of 2 died' in lines[0] and f'step 2 of {ckpt}' in lines[0], lines[0]
  assert 'Check failure stack trace' not in err and 'Terminating process' not in err, err[-3000:]
  assert sorted(os.listdir(ckpt)) == ['1', '2']  # a checkpoint every step

  procs = start_by_hand([d('run:4')], cache, d('resumed'))  # rerun both: resumes at step 2
  codes = [p.wait(timeout=240) for p in procs]
  assert codes == [0, 0], open(d('resumed') + '.0.err').read()[-3000:]
  assert_same(results(d('run')), results(d('ref')))


def collectives(mode: str, workdir: str):
  """Tiny 2-process job for the watchdog tests: an all-reduce every 10 ms.

  mode 'loop': forever (the test kills a process); 'raise': process 1 raises after 20
  all-reduces; 'finish': process 1 returns after 20, process 0 idles 3 timeouts, then
  returns (a finished peer is not a dead one).
  """
  from experiments.training import train_step as ts
  from experiments.training import watchdog
  ts.maybe_initialize_distributed()
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  watchdog.register_checkpoints(os.path.join(workdir, 'checkpoints'))
  mesh = ts.make_mesh()
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(('data', 'fsdp'))),
                                             np.ones((DEVICES // 2,), np.float32))
  i = 0
  while True:
    assert float(total(x)) == DEVICES
    i += 1
    if i == 20:
      open(os.path.join(workdir, f'running.{jax.process_index()}'), 'w').close()
    if i == 20 and mode == 'raise' and jax.process_index() == 1:
      raise RuntimeError('boom in process 1')
    if i == 20 and mode == 'finish':
      if jax.process_index() == 0:
        time.sleep(3 * watchdog.timeout_from_env())
      return
    time.sleep(0.01)


if __name__ == '__main__':
  if sys.argv[1].startswith('collectives:'):
    collectives(*sys.argv[1].split(':')[1:])
  else:
    drive(sys.argv[1])
