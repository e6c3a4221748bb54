"""The starting point of RL: the SFT warm start (cached) or a pretrained policy."""

import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
from tqdm.auto import tqdm

from experiments.models import decoder
from experiments.training import train_step as ts
from experiments.training.checkpoints import _manager, restore_checkpoint, save_checkpoint
from experiments.training.config_checks import _drop_default_sft_fields, check_config, fingerprint, is_agent
from experiments.training.problems import build_problem


def sft(cfg, workdir: str, progress: Optional[bool] = None):
  """Supervised warm start on demonstrations; cached as a checkpoint in `workdir`.

  Returns (params, info dict with greedy_acc, loss, wall_s). A second call with
  the same workdir and compatible config loads the result.
  """
  check_config(cfg)
  progress = cfg.progress if progress is None else progress
  problem = build_problem(cfg)
  pcfg = problem.pcfg
  ts.check_model_axis(pcfg, cfg.mesh.get('model', 1))  # refused before the warm start, not after
  sub = ml_collections.ConfigDict({'task': cfg.task.to_dict(), 'model': cfg.model.to_dict(),
                                   'sft': cfg.sft.to_dict(),
                                   **({'agent': cfg.agent.to_dict()} if is_agent(cfg) else {})})
  _drop_default_sft_fields(sub)
  fp, flat = fingerprint(sub)
  s = cfg.sft
  tx = ts.make_optimizer(s.lr, s.warmup_steps, s.weight_decay, cfg.optimizer.grad_clip)
  params = getattr(problem, 'init_params', None)  # a pretrained policy, else a fresh one
  if params is None:
    params = decoder.init_params(jax.random.PRNGKey(s.seed), pcfg)
  state = ts.init_state(jax.tree.map(jnp.copy, params), tx, seed=s.seed)
  mngr = _manager(os.path.join(workdir, 'checkpoints'))
  restored, meta = restore_checkpoint(mngr, state, fp, flat)
  if restored is not None and meta.get('done'):
    return restored.params, meta['info']
  t0 = time.time()
  key = jax.random.PRNGKey(s.seed + 1)
  hinted = float(s.get('hindsight_frac', 0.0))
  if hinted and 'reasoning_steps' not in problem.capabilities:
    raise ValueError(f'sft.hindsight_frac needs a JAX chain-of-thought task with '
                     f'`reasoning_steps` (scratch_add, countdown_steps); task '
                     f'{cfg.task.name!r} has none')
  bar = tqdm(range(s.steps), desc='SFT', disable=not progress, leave=False)
  loss = float('nan')
  for i in bar:
    if hinted:  # some prompts carry the gold answer: a teacher that has read one
      prompts, plen, responses, mask = problem.hinted_demonstrations(
          jax.random.fold_in(key, i), s.batch_size, hinted)
    else:
      (prompts, responses, mask), plen = problem.demonstrations(
          jax.random.fold_in(key, i), s.batch_size), None
    state, m = ts.sft_step_jit(state, prompts, responses, mask, plen, cfg=pcfg)
    if i % 20 == 0 or i == s.steps - 1:
      loss = float(m['loss'])
      bar.set_postfix(loss=f'{loss:.3f}')
  wall = time.time() - t0
  # Placed as the RL run places its params (`run_context.build`), so that its evaluations reuse
  # the sampler compiled here.
  mesh = ts.make_mesh(cfg.mesh.fsdp, model=cfg.mesh.get('model', 1))
  ev = problem.evaluate(jax.device_put(state.params, ts.param_sharding(state.params, mesh)),
                        cfg.eval)
  info = dict(loss=loss, wall_s=wall, **ev)
  save_checkpoint(mngr, s.steps, state, dict(fingerprint=fp, config=flat, done=True, info=info))
  mngr.close()
  return state.params, info


def pretrained_start(cfg):
  """Starting point of a text-task run: the pretrained params and their eval (no SFT)."""
  t0 = time.time()
  problem = build_problem(cfg)
  ev = problem.evaluate(problem.init_params, cfg.eval)
  return problem.init_params, dict(wall_s=time.time() - t0, source=cfg.lm.source, **ev)
