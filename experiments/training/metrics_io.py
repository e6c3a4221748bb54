"""The metrics file (one JSON line per step, crash-safe) and its summary."""

import json
import os
import warnings
from typing import Optional

import jax
import numpy as np

from experiments.training import train_step as ts


def state_metrics(credit_state) -> dict:
  """{'credit_state/<path>': float} of the scalar leaves of a stateful estimator's state
  (logged in the metric rows; larger leaves are not)."""
  name = lambda k: str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))))
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(credit_state):
    if np.size(x) == 1:
      key = '.'.join(name(k) for k in path) or 'value'
      out[f'credit_state/{key}'] = float(ts.host_value(x).reshape(()))
  return out


class MetricsWriter:
  """The JSONL metrics sink (always on, `tracking.open_sinks`). Appends JSON lines, each with
  one write + flush + fsync (a crash can cut at most the last line, which `read_metrics` then
  drops); on resume keeps the rows up to the restored step, rewritten atomically (a temporary
  file, fsynced, then os.replace).

  `rows`: the kept rows (read on every process; process 0 alone writes the file).
  """

  def __init__(self, path, resume_step: Optional[int]):
    self.path = str(path)
    self.enabled = jax.process_index() == 0  # one writer on multi-host jobs
    self.rows = []
    if resume_step is not None and os.path.exists(self.path):
      self.rows = [r for r in read_metrics(self.path, warn=self.enabled)
                   if r['step'] <= resume_step]
      missing = sorted(set(range(resume_step + 1)) - {r['step'] for r in self.rows})
      if missing and self.enabled and resume_step > 0:  # cannot be recomputed: say so
        warnings.warn(f'{self.path}: no rows for steps {missing[:20]} (lost before the '
                      f'checkpoint of step {resume_step} was written); resuming without them',
                      RuntimeWarning, stacklevel=2)
    if not self.enabled:
      return
    os.makedirs(os.path.dirname(self.path) or '.', exist_ok=True)
    write_atomic(self.path, ''.join(json.dumps(r) + '\n' for r in self.rows).encode())

  def write(self, row: dict):
    if not self.enabled:
      return
    line = (json.dumps(row) + '\n').encode()
    with open(self.path, 'ab', buffering=0) as f:  # O_APPEND: each write lands at the end
      view = memoryview(line)
      while view:  # one write for a regular file; looped in case it is ever short
        view = view[f.write(view):]
      os.fsync(f.fileno())

  def close(self):
    """Nothing to do: every row is on disk once `write` returns (the `tracking.Sink` interface)."""


def write_atomic(path: str, data: bytes):
  """Replaces `path` by `data` so a crash leaves the old file or the new one, never a mix."""
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  try:  # the rename itself durable
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  except OSError:  # some filesystems cannot fsync a directory
    pass


def read_metrics(path, warn: bool = True) -> list[dict]:
  """The rows of a metrics.jsonl (one JSON object with 'step' per line; blank lines skipped).

  A torn final line (a write cut short by a crash or power loss) is dropped, with a warning
  naming the file (`warn`); an unreadable line anywhere else is a ValueError naming the file
  and the line number.
  """
  with open(path, 'rb') as f:
    lines = f.read().split(b'\n')
  numbered = [(i + 1, l) for i, l in enumerate(lines) if l.strip()]
  rows = []
  for k, (lineno, raw) in enumerate(numbered):
    try:
      row = json.loads(raw.decode('utf-8'))
      if not isinstance(row, dict) or 'step' not in row:
        raise ValueError("not a JSON object with a 'step'")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
      if k == len(numbered) - 1:
        if warn:
          warnings.warn(f'{path}: dropped torn final line {lineno} ({len(raw)} bytes, '
                        f'{raw[:60]!r}...): a write cut short (e.g. by a crash)',
                        RuntimeWarning, stacklevel=2)
        break
      raise ValueError(f'{path}: line {lineno} is not a metrics row ({e}): '
                       f'{raw[:80]!r}; only a torn final line is dropped') from None
    rows.append(row)
  return rows


def summarize(rows, pass_k, params=None) -> dict:
  """Final / peak eval metrics and mean timings of one run's metric rows."""
  ev = [r for r in rows if 'greedy_acc' in r]
  tr = [r for r in rows if 'reward' in r]
  mean = lambda k, rs: float(np.mean([r[k] for r in rs])) if rs else float('nan')
  steady = tr[1:] if len(tr) > 1 else tr  # skip the compiling step for timings
  out = dict(
      steps=rows[-1]['step'] if rows else 0,
      final_acc=ev[-1]['greedy_acc'] if ev else float('nan'),
      peak_acc=max(r['greedy_acc'] for r in ev) if ev else float('nan'),
      init_acc=ev[0]['greedy_acc'] if ev else float('nan'),
      final_pass=ev[-1].get(f'pass@{pass_k}', float('nan')) if ev else float('nan'),
      final_reward=mean('reward', tr[-5:]),
      wall_s=rows[-1]['wall_s'] if rows else 0.0,
      sampled_tokens_per_s=mean('sampled_tokens_per_s', steady),
      train_tokens_per_s=mean('train_tokens_per_s', steady),
      credit_frac=(sum(r['credit_s'] for r in steady) / max(sum(r['step_s'] for r in steady), 1e-9)
                   if steady else float('nan')),
      sample_s=mean('sample_s', steady), update_s=mean('update_s', steady),
      credit_s=mean('credit_s', steady))
  if params is not None:
    out['params'] = params
  return out
