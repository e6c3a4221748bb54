"""Multi-process training on localhost CPU (JAX distributed runtime, gloo collectives).

2 processes x 2 CPU devices run the quick config and give the same metrics and params
as 1 process x 4 devices (same mesh), and orbax checkpoints written by either restore
in the other and training continues identically. Processes are started with
`experiments.launch_local`; this file is also their driver (`__main__` below).
"""

import json
import os
import subprocess
import sys

import numpy as np

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
  cfg.rl.update(steps=steps, ckpt_every=2, prompts_per_step=16)
  cfg.eval.update(every=2, num_prompts=16)
  return cfg


def drive(runs: str):
  """Runs `workdir:steps[,workdir:steps...]` in order; process 0 saves <workdir>/params.npz."""
  from experiments.training import train_step as ts
  ts.maybe_initialize_distributed()
  import jax
  from experiments.training import loop
  from experiments.models import decoder
  assert jax.process_count() == int(os.environ['JAX_NUM_PROCESSES']), jax.process_count()
  assert jax.device_count() == DEVICES, jax.devices()
  for run in runs.split(','):
    workdir, steps = run.rsplit(':', 1)
    cfg = quick_cfg(int(steps))
    pcfg = loop.policy_config(cfg, loop.build_task(cfg))
    params0 = decoder.init_params(jax.random.PRNGKey(0), pcfg)
    summary = loop.train(cfg, workdir, params0, method=METHOD)
    flat = {jax.tree_util.keystr(p): ts.host_value(x)
            for p, x in jax.tree_util.tree_leaves_with_path(summary['params'])}
    if jax.process_index() == 0:
      np.savez(os.path.join(workdir, 'params.npz'), **flat)
    print(f'process {jax.process_index()}/{jax.process_count()}: {run} done', flush=True)


def launch(num_processes: int, runs: list, cache: str, timeout: int = 300):
  # Compile time dominates: cheap XLA CPU codegen (the same in every run), and a
  # persistent cache so that each topology (1 x 4 or 2 x 2 devices) compiles once.
  flags = '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
  env = dict(os.environ, XLA_FLAGS=f'{flags} {os.environ.get("XLA_FLAGS", "")}',
             JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  env.pop('JAX_COORDINATOR_ADDRESS', None)
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
  # 1 process x 4 devices: the reference run, and a run stopped at step 2.
  launch(1, [d('one:4'), d('one_half:2')], d('jit_cache'))
  # 2 processes x 2 devices: the same run; one resuming the 1-process checkpoint at
  # step 2; one stopped at step 2 (its checkpoint written by both processes).
  launch(2, [d('two:4'), d('one_half:4'), d('two_half:2')], d('jit_cache'))
  # 1 process resumes the 2-process checkpoint.
  launch(1, [d('two_half:4')], d('jit_cache'))

  ref = results(d('one'))
  assert [r['step'] for r in ref[0]] == [0, 1, 2, 3, 4]
  assert all(np.isfinite(r['loss']) and r['loss'] != 0 for r in ref[0][1:])
  assert any(r.get('frac_groups_with_signal', 0) > 0 for r in ref[0])  # credit had signal
  assert_same(results(d('two')), ref)        # 2 processes == 1 process
  assert_same(results(d('one_half')), ref)   # 1-process checkpoint -> 2 processes
  assert_same(results(d('two_half')), ref)   # 2-process checkpoint -> 1 process
  assert sorted(os.listdir(d('two_half') + '/checkpoints')) == ['2', '4']


if __name__ == '__main__':
  drive(sys.argv[1])
