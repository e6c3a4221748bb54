"""Nothing lost, nothing counted twice: resuming after kill -9, torn metric lines, corrupt
checkpoints and a full disk gives exactly the metric rows of an uninterrupted run; repeated
methods / seeds are refused; --config.quick keeps what the user set.

The kill -9 test runs the loop in subprocesses (this file is their driver, `__main__` below)
in this process's environment: they read the programs the in-process reference run
(`reference`, the uninterrupted run they are compared with) left in the run's persistent
compilation cache, so none of them compiles the loop's programs again.
"""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

TIMING = ('wall_s', 'sample_s', 'logprob_s', 'credit_s', 'update_s', 'step_s',
          'sampled_tokens_per_s', 'train_tokens_per_s', 'credit_frac')
METHOD = 'grpo:iid'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_cfg(steps: int = 6):
  """The quick config on a one-symbol key task (random init solves it sometimes: groups
  with signal), a checkpoint every step, an eval every 3."""
  from configs import tempo as tempo_config
  cfg = tempo_config.shrink(tempo_config.get_config())
  cfg.quick, cfg.progress = False, False
  cfg.task.name, cfg.task.kwargs = 'token_tree', dict(num_symbols=2, depth=1, num_decisive=1)
  cfg.loss.entropy_coef = 0.01  # every step changes the params
  cfg.train.packing = 'none'  # fewer programs to compile
  cfg.sampler.group_size = 8
  cfg.rl.update(steps=steps, ckpt_every=1, prompts_per_step=16)
  # pass@k's batch = one RL batch (16 prompts x 8): it reuses the sampler's programs (as
  # the quick config's does).
  cfg.eval.update(every=3, num_prompts=16, pass_prompts=16, pass_k=8)
  return cfg


def init_params(cfg):
  """The initial params of cfg's policy (`decoder.init_params` compiles once per config)."""
  import jax
  from experiments.models import decoder
  from experiments.training import loop
  return decoder.init_params(jax.random.PRNGKey(0), loop.policy_config(cfg, loop.build_task(cfg)))


def strip(rows):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def rows_of(workdir):
  from experiments.training import loop
  return loop.read_metrics(os.path.join(str(workdir), 'metrics.jsonl'))


def assert_same_rows(got, want):
  """Every row equal to the uninterrupted run's (timings aside): none lost, none twice."""
  assert [r['step'] for r in got] == [r['step'] for r in want]
  assert strip(got) == strip(want)


# ----------------------------------------------------------------------------
# kill -9 at random points, several times in a row.


def env(cache=None) -> dict:
  """The subprocesses' environment: this process's (its XLA flags, and with cache None its
  persistent compilation cache, whose programs they then read), single-process; they cache
  every program they compile (the small ones too), for the next start."""
  out = dict(os.environ, PYTHONPATH=ROOT, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  if cache is not None:
    out['JAX_COMPILATION_CACHE_DIR'] = cache
  for k in ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID',
            'TREECREDIT_DISTRIBUTED'):
    out.pop(k, None)
  return out


def start(workdir, steps, cache=None):
  return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(workdir), str(steps)],
                          cwd=ROOT, env=env(cache), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=240):
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-6000:]
  return out


def num_lines(path) -> int:
  try:
    with open(path, 'rb') as f:
      return f.read().count(b'\n')
  except FileNotFoundError:
    return 0


def kill_at_random_points(workdir, steps, cache, kills: int, rng, deadline: float) -> list:
  """Starts the run `kills` times and kills it with SIGKILL after a random delay counted
  from its first new metric row (so every start makes progress); returns what happened."""
  path = os.path.join(str(workdir), 'metrics.jsonl')
  log = []
  for _ in range(kills):
    before = num_lines(path)
    proc = start(workdir, steps, cache)
    while proc.poll() is None and num_lines(path) <= before and time.time() < deadline:
      time.sleep(0.02)
    delay = rng.uniform(0.0, 0.8)  # a step (checkpoint save included) takes ~0.2 s
    time.sleep(delay)
    if proc.poll() is not None:  # finished (or failed) before the kill
      out = proc.stdout.read()
      assert proc.returncode == 0, out[-6000:]
      log.append(('finished', round(delay, 2)))
      break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    log.append(('killed', round(delay, 2), num_lines(path)))
  return log


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_gives_every_row_once(tmp_path):
  """Eight kill -9's at random points (sampling, update, metric write, checkpoint save)."""
  cache = str(tmp_path / 'jit_cache')
  finish(start(tmp_path / 'straight', 24, cache))  # the reference; fills the cache
  params = dict(np.load(tmp_path / 'straight' / 'params.npz'))
  _kill_test(tmp_path, (rows_of(tmp_path / 'straight'), list(params.values())), steps=24,
             kills=8, seed=int(os.environ.get('KILL_SEED', '0')), cache=cache)


def test_kill_9_twice_then_resume_gives_every_row_once(tmp_path, reference):
  """The fast variant: two kill -9's on the in-process tests' 6-step run, compared with
  their uninterrupted run (`reference`; the subprocesses read its compiled programs)."""
  _kill_test(tmp_path, reference, steps=STEPS, kills=2,
             seed=int(os.environ.get('KILL_SEED', '1')))


def _kill_test(tmp_path, reference, steps, kills, seed, cache=None):
  """`reference`: (rows, params leaves) of the uninterrupted `steps`-step run."""
  want, want_params = reference
  assert [r['step'] for r in want] == list(range(steps + 1))
  assert any(r.get('frac_groups_with_signal', 0) > 0 for r in want)
  log = kill_at_random_points(tmp_path / 'killed', steps, cache, kills, random.Random(seed),
                              deadline=time.time() + 200)
  finish(start(tmp_path / 'killed', steps, cache))  # resumes to the end
  print('kills (what, delay s, metric lines at the kill):', log)
  assert sum(1 for e in log if e[0] == 'killed') >= 1, log
  assert_same_rows(rows_of(tmp_path / 'killed'), want)
  got = dict(np.load(tmp_path / 'killed' / 'params.npz'))  # saved in leaf order
  assert len(got) == len(want_params), list(got)
  for (k, x), y in zip(got.items(), want_params):
    np.testing.assert_array_equal(x, y, err_msg=k)


# ----------------------------------------------------------------------------
# In-process: crashes at chosen points, torn lines, corrupt checkpoints, a full disk.
# One config (tiny_cfg, 6 steps) for all: its programs compile once.

STEPS = 6


# orbax's failed reads of a corrupt checkpoint leave coroutines behind (harmless noise)
ORBAX_NOISE = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')


class Crash(BaseException):
  """Stands for kill -9: not an Exception nor a KeyboardInterrupt, so nothing handles it."""


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The uninterrupted run: (rows, params leaves). Every program it compiles goes to the
  persistent cache, the small ones too: the kill test's subprocesses then compile none."""
  import jax
  from experiments.training import loop
  cfg = tiny_cfg(STEPS)
  d = tmp_path_factory.mktemp('straight')
  min_time = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  try:
    out = loop.train(cfg, str(d), init_params(cfg), method=METHOD)
  finally:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', min_time)
  return rows_of(d), [np.asarray(x) for x in jax_leaves(out['params'])]


def jax_leaves(tree):
  import jax
  return jax.tree.leaves(tree)


def run(workdir, steps=STEPS):
  from experiments.training import loop
  cfg = tiny_cfg(steps)
  return loop.train(cfg, str(workdir), init_params(cfg), method=METHOD)


def assert_like_reference(workdir, out, reference):
  rows, params = reference
  assert_same_rows(rows_of(workdir), rows)
  for x, y in zip(jax_leaves(out['params']), params):
    np.testing.assert_array_equal(np.asarray(x), y)


def checkpoint_names(workdir):
  return sorted(os.listdir(os.path.join(str(workdir), 'checkpoints')))


def join_save_threads(timeout=120):
  """Waits for the writes of a save cut short in this process. A killed process's writes end
  with it; here orbax's threads writing the step's other items run on after the error, and
  would race the rerun's removal of their temporary directory."""
  for t in threading.enumerate():
    if type(t).__module__.startswith('orbax.'):
      t.join(timeout)


def test_crash_mid_metric_write_leaves_a_torn_line_dropped_on_resume(tmp_path, reference,
                                                                      monkeypatch):
  from experiments.training import loop
  real = loop.MetricsWriter.write

  def torn_write(self, row):
    if row['step'] == 4:  # half the line reaches the disk, then the process dies
      line = (json.dumps(row) + '\n').encode()
      with open(self.path, 'ab') as f:
        f.write(line[:len(line) // 2])
      raise Crash
    real(self, row)

  monkeypatch.setattr(loop.MetricsWriter, 'write', torn_write)
  with pytest.raises(Crash):
    run(tmp_path)
  monkeypatch.setattr(loop.MetricsWriter, 'write', real)
  path = os.path.join(str(tmp_path), 'metrics.jsonl')
  assert open(path, 'rb').read().count(b'\n') == 4  # steps 0-3, then half of step 4's row
  with pytest.warns(RuntimeWarning, match=f'{path}: dropped torn final line 5'):
    out = run(tmp_path)
  assert_like_reference(tmp_path, out, reference)


def test_crash_mid_checkpoint_save_resumes_from_the_previous_one(tmp_path, reference,
                                                                monkeypatch):
  """The state is written, the meta item is not: orbax's temporary directory is left
  behind, never listed, and removed on the rerun, which resumes from step 3."""
  from orbax.checkpoint import handlers
  real = handlers.JsonCheckpointHandler._save_fn

  async def dying_save(self, x, directory):
    if x.get('rl_step') == 4:
      raise Crash
    return await real(self, x, directory)

  monkeypatch.setattr(handlers.JsonCheckpointHandler, '_save_fn', dying_save)
  with pytest.raises(Crash):
    run(tmp_path)
  monkeypatch.setattr(handlers.JsonCheckpointHandler, '_save_fn', real)
  names = checkpoint_names(tmp_path)
  assert names[:2] == ['2', '3'] and any(n.startswith('4.orbax-checkpoint-tmp') for n in names)
  join_save_threads()
  out = run(tmp_path)
  assert_like_reference(tmp_path, out, reference)
  assert checkpoint_names(tmp_path) == ['5', '6']  # the partial save was cleaned up


def test_full_disk_while_a_checkpoint_is_written(tmp_path, reference, monkeypatch):
  """ENOSPC in the middle of the save of step 4: a clear error naming the checkpoint and
  the step a rerun resumes from; the rerun removes the partial write and resumes exactly."""
  from orbax.checkpoint import handlers
  real = handlers.JsonCheckpointHandler._save_fn

  async def full_disk(self, x, directory):
    if x.get('rl_step') == 4:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await real(self, x, directory)

  monkeypatch.setattr(handlers.JsonCheckpointHandler, '_save_fn', full_disk)
  ckpts = os.path.join(str(tmp_path), 'checkpoints')
  with pytest.raises(OSError, match=f'could not write checkpoint {ckpts}/4: .*No space left.*'
                     r'the disk is full.*resume from step 3') as e:
    run(tmp_path)
  assert e.value.errno == errno.ENOSPC
  monkeypatch.setattr(handlers.JsonCheckpointHandler, '_save_fn', real)
  assert checkpoint_names(tmp_path)[:2] == ['2', '3']  # + the partial 4.orbax-checkpoint-tmp*
  join_save_threads()
  out = run(tmp_path)
  assert_like_reference(tmp_path, out, reference)
  assert checkpoint_names(tmp_path) == ['5', '6']  # the partial write removed on the rerun


def interrupt_at(fn, source_line: str, step: int):
  """A trace function raising KeyboardInterrupt (Ctrl-C) just before `fn` runs the line
  holding `source_line`, the `step`-th time it gets there (counting from 0)."""
  import inspect
  import sys
  lines, first = inspect.getsourcelines(fn)
  target = first + next(i for i, text in enumerate(lines) if source_line in text)
  code, seen = fn.__code__, [0]

  def on_line(frame, event, arg):
    if event == 'line' and frame.f_lineno == target:
      seen[0] += 1
      if seen[0] == step + 1:
        sys.settrace(None)
        raise KeyboardInterrupt
    return on_line

  return lambda frame, event, arg: on_line if frame.f_code is code else None


def test_interrupt_between_the_update_and_its_commit_resumes_exactly(tmp_path, reference):
  """Ctrl-C after the donating update has replaced the params of step 3, before the step
  counter and the loop state are committed. The handler must not checkpoint those params
  under step 3 (a resume would apply step 3's update twice): it keeps the last checkpoint
  (step 2, checkpoints every 2 steps here), and the rerun gives the uninterrupted rows."""
  import sys
  from experiments.training import loop, rl_step
  cfg = tiny_cfg(STEPS)
  cfg.rl.ckpt_every = 2
  sys.settrace(interrupt_at(rl_step.update, 'carry.aux, carry.step, carry.dirty = ', step=3))
  try:
    with pytest.raises(KeyboardInterrupt):
      loop.train(cfg, str(tmp_path), init_params(cfg), method=METHOD)
  finally:
    sys.settrace(None)
  assert checkpoint_names(tmp_path) == ['2']
  out = loop.train(cfg, str(tmp_path), init_params(cfg), method=METHOD)
  assert_like_reference(tmp_path, out, reference)


def garble(step_dir):
  """Overwrites every array data file of a checkpoint (a disk or copy gone wrong)."""
  n = 0
  for root, _, files in os.walk(os.path.join(step_dir, 'state')):
    if os.path.basename(root) == 'd':
      for f in files:
        with open(os.path.join(root, f), 'r+b') as fh:
          fh.write(b'\0garbage' * 4)
        n += 1
  assert n > 0


@ORBAX_NOISE
def test_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, reference):
  half = tmp_path / 'half'
  run(half, steps=3)  # checkpoints 2 and 3 (max_to_keep 2), rows 0-3
  ckpts = os.path.join(str(half), 'checkpoints')
  garble(os.path.join(ckpts, '3'))
  with pytest.warns(RuntimeWarning, match=f'corrupt checkpoint {ckpts}/3 .*set aside as '
                    f'{ckpts}/3.corrupt, resuming from step 2'):
    out = run(half)
  assert_like_reference(half, out, reference)  # rows after step 2 recomputed, none twice
  assert '3.corrupt' in checkpoint_names(half)
  # Every checkpoint corrupt: both set aside, the run starts over (still the same rows).
  both = tmp_path / 'both'
  run(both, steps=2)
  ckpts = os.path.join(str(both), 'checkpoints')
  shutil.rmtree(os.path.join(ckpts, '2', 'state'))  # a missing item
  with open(os.path.join(ckpts, '1', 'meta', 'metadata'), 'w') as f:
    f.write('{"fingerpr')  # a torn meta item
  with pytest.warns(RuntimeWarning, match='starting over') as record:
    out = run(both)
  named = ' '.join(str(w.message) for w in record)
  assert f'{ckpts}/2 ' in named and f'{ckpts}/1 ' in named
  assert_like_reference(both, out, reference)
  assert {'1.corrupt', '2.corrupt'} <= set(checkpoint_names(both))


@ORBAX_NOISE
def test_finished_run_with_a_truncated_newest_checkpoint_says_so_on_rerun(tmp_path, reference):
  """A file orbax reads without an error (the sharding metadata) cut short on disk: the rerun
  of the finished run names the checkpoint and the file, sets it aside and recomputes the
  last step from the one before (same rows, same params)."""
  out = run(tmp_path)
  ckpts = os.path.join(str(tmp_path), 'checkpoints')
  path = os.path.join(ckpts, str(STEPS), 'state', '_sharding')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.warns(RuntimeWarning, match=f'corrupt checkpoint {ckpts}/{STEPS} .*state/_sharding '
                    f'is .* bytes.*set aside.*resuming from step {STEPS - 1}'):
    out = run(tmp_path)
  assert_like_reference(tmp_path, out, reference)


@ORBAX_NOISE
def test_corrupt_sft_cache_is_set_aside_and_recomputed(tmp_path):
  from experiments.training import loop
  cfg = tiny_cfg(STEPS)
  cfg.sft.steps = 3
  params, info = loop.sft(cfg, str(tmp_path))
  ckpts = os.path.join(str(tmp_path), 'checkpoints')
  garble(os.path.join(ckpts, '3'))
  with pytest.warns(RuntimeWarning, match=f'corrupt checkpoint {ckpts}/3 .*starting over'):
    again, info2 = loop.sft(cfg, str(tmp_path))
  for x, y in zip(jax_leaves(params), jax_leaves(again)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert info2['greedy_acc'] == info['greedy_acc']
  cached, _ = loop.sft(cfg, str(tmp_path))  # the recomputed cache is read back, no warning
  for x, y in zip(jax_leaves(params), jax_leaves(cached)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------
# The metrics file itself.


def write_lines(path, data: bytes):
  with open(path, 'wb') as f:
    f.write(data)


def test_read_metrics_drops_only_a_torn_final_line(tmp_path):
  from experiments.training import loop
  path = str(tmp_path / 'metrics.jsonl')
  good = b'{"step": 0, "a": 1.5}\n{"step": 1, "a": 2.5}\n'
  write_lines(path, good)
  assert loop.read_metrics(path) == [dict(step=0, a=1.5), dict(step=1, a=2.5)]
  write_lines(path, good + b'{"step": 2}')  # cut just before its newline: complete, kept
  assert [r['step'] for r in loop.read_metrics(path)] == [0, 1, 2]
  write_lines(path, good + b'\n\n')  # blank lines are skipped
  assert len(loop.read_metrics(path)) == 2
  for torn in (b'{"step": 2, "a": 3.', b'\x00\x00\x00\x00', b'{"st\xff\xfe'):
    write_lines(path, good + torn)
    with pytest.warns(RuntimeWarning, match=f'{path}: dropped torn final line 3'):
      assert [r['step'] for r in loop.read_metrics(path)] == [0, 1]
  # Anywhere else a bad line is an error naming the file and the line.
  write_lines(path, b'{"step": 0}\n{"step": 1, "a": 2.\n{"step": 2}\n')
  with pytest.raises(ValueError, match=f'{path}: line 2 is not a metrics row'):
    loop.read_metrics(path)
  write_lines(path, b'{"step": 0}\n[1, 2]\n{"step": 2}\n')
  with pytest.raises(ValueError, match="line 2 is not a metrics row.*'step'"):
    loop.read_metrics(path)
  # The error reaches a resumed run too (MetricsWriter reads the file).
  write_lines(path, b'{"step": 0}\n{"step": 1, "a"\n{"step": 2}\n')
  with pytest.raises(ValueError, match=f'{path}: line 2'):
    loop.MetricsWriter(path, resume_step=2)


def test_metrics_writer_resume_rewrites_atomically_and_appends_whole_lines(tmp_path,
                                                                          monkeypatch):
  from experiments.training import loop
  path = str(tmp_path / 'metrics.jsonl')
  write_lines(path, b''.join(json.dumps(dict(step=i)).encode() + b'\n' for i in range(5)) +
              b'{"step": 5, "x')
  with pytest.warns(RuntimeWarning, match='torn final line 6'):
    w = loop.MetricsWriter(path, resume_step=3)
  assert [r['step'] for r in w.rows] == [0, 1, 2, 3]
  assert open(path, 'rb').read() == b''.join(
      json.dumps(dict(step=i)).encode() + b'\n' for i in range(4))
  assert os.listdir(tmp_path) == ['metrics.jsonl']  # no temporary file left
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, 'fsync', lambda fd: (synced.append(fd), real_fsync(fd)))
  w.write(dict(step=4, loss=0.25))
  assert synced and loop.read_metrics(path)[-1] == dict(step=4, loss=0.25)
  # A crash during the rewrite (before os.replace) leaves the old file whole.
  monkeypatch.setattr(os, 'replace', lambda *a: (_ for _ in ()).throw(Crash()))
  before = open(path, 'rb').read()
  with pytest.raises(Crash):
    loop.MetricsWriter(path, resume_step=2)
  assert open(path, 'rb').read() == before
  # Rows missing below the restored step cannot be recomputed: said, not silent.
  monkeypatch.undo()
  write_lines(path, b'{"step": 0}\n{"step": 3}\n')
  with pytest.warns(RuntimeWarning, match=r'no rows for steps \[1, 2\]'):
    loop.MetricsWriter(path, resume_step=3)
  # A fresh run (nothing restored) starts an empty file.
  loop.MetricsWriter(path, resume_step=None)
  assert open(path, 'rb').read() == b''


# ----------------------------------------------------------------------------
# Runs counted twice; quick keeps what the user set.


@pytest.mark.parametrize('field,value,match', [
    ('methods', 'grpo:iid,grpo:iid', r"config.methods 'grpo:iid,grpo:iid' repeats grpo:iid"),
    ('methods', 'grpo,tempo:iid,grpo:iid', 'repeats grpo:iid'),  # 'grpo' is 'grpo:iid'
    ('seeds', (0, 0), r'config.seeds \(0, 0\) repeats 0'),
    ('seeds', (2, 1, 2), 'repeats 2'),
    ('seeds', (), 'config.seeds is empty'),
    ('seeds', (0, 1.5), 'give a tuple of ints'),
    ('lr_grid', (1e-4, 0.0001), 'lr_grid .* repeated'),
])
def test_repeated_methods_and_seeds_are_refused_before_any_work(tmp_path, monkeypatch, field,
                                                               value, match):
  from experiments.training import compare, loop
  monkeypatch.setattr(loop, 'sft', lambda *a, **k: pytest.fail('ran before refusing'))
  cfg = tiny_cfg()
  cfg[field] = value
  with pytest.raises(ValueError, match=match):
    compare.run_experiment(cfg, str(tmp_path))
  cfg = tiny_cfg()
  cfg.methods, cfg.seeds = 'grpo:iid,grpo:tree_entropy,tempo', (0, 3, 1)
  compare.check_comparison(cfg)  # distinct: accepted


def test_quick_keeps_what_the_user_set_and_says_so(capsys):
  import importlib
  from configs import agents, lm, tempo
  for module in (tempo, lm, agents):
    assert module.shrink(module.get_config()).to_dict() == module.shrink(
        module.get_config(), defaults=module.get_config()).to_dict()
  cfg = tempo.get_config()
  cfg.seeds, cfg.rl.steps, cfg.sampler.group_size = (3, 4), 10, 8  # 8: the default, named
  out = tempo.shrink(cfg, explicit=('sampler.group_size',))
  assert out.seeds == (3, 4) and out.rl.steps == 10 and out.sampler.group_size == 8
  assert out.model.d_model == 32 and out.rl.prompts_per_step == 8  # the rest shrunk
  printed = capsys.readouterr().out
  assert 'quick=True kept' in printed
  for part in ('rl.steps=10 (quick: 4)', 'seeds=(3, 4) (quick: (0,))', 'sampler.group_size=8'):
    assert part in printed
  plain = tempo.shrink(tempo.get_config())
  assert plain.seeds == (0,) and plain.rl.steps == 4 and capsys.readouterr().out == ''
  # A paper config against its own defaults shrinks fully (its methods kept, as before).
  spo = importlib.import_module('configs.spo')
  c = spo.get_config()
  c.rl.steps = 7
  out = tempo.shrink(c, defaults=spo.get_config())
  assert out.rl.steps == 7 and out.seeds == (0,) and out.methods == spo.get_config().methods
  assert out.sampler.branching == (2, 2)
  c = agents.get_config()
  c.task.kwargs['max_turns'] = 10
  c.seeds = (0, 1)
  out = agents.shrink(c)
  assert out.task.kwargs['max_turns'] == 10 and out.seeds == (0, 1) and out.rl.steps == 2
  c = lm.get_config()
  c.rl.steps = 3
  out = lm.shrink(c, explicit=('seeds',))
  assert out.rl.steps == 3 and out.seeds == (0, 1) and out.lm.max_new_tokens == 24


def test_quick_on_the_command_line_keeps_the_overrides_given_with_it(tmp_path):
  """The script passes its --config.* overrides to quick: the seeds stay (0, 0), so the
  repeated seed is refused (before any work), and the kept steps are printed."""
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.tempo', '--config.quick=True', '--config.rl.steps=3',
       '--config.seeds=(0,0)', f'--workdir={tmp_path}'], cwd=ROOT, env=env(str(tmp_path)),
      capture_output=True, text=True, timeout=120)
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0
  assert 'kept what you set: rl.steps=3 (quick: 4), seeds=(0, 0) (quick: (0,))' in out, out[-3000:]
  assert 'config.seeds (0, 0) repeats 0' in out, out[-3000:]
  assert not os.path.exists(tmp_path / 'sft')


def drive(workdir: str, steps: int):
  import jax
  from experiments.training import loop
  cfg = tiny_cfg(steps)
  summary = loop.train(cfg, workdir, init_params(cfg), method=METHOD)
  np.savez(os.path.join(workdir, 'params.npz'),
           **{jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(summary['params'])})


if __name__ == '__main__':
  drive(sys.argv[1], int(sys.argv[2]))
