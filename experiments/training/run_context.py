"""A run's immutable context (config, problem, mesh, passes, fingerprint) and its carry:
built, restored or started, checkpointed and summarized here; `loop.train` drives it."""

import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

import credit
from experiments.training import passes as passes_lib
from experiments.training import samplers
from experiments.training import tracking
from experiments.training import train_step as ts
from experiments.training.checkpoints import restore_checkpoint, save_checkpoint
from experiments.training.config_checks import (check_config, fingerprint, loss_config,
                                                run_config)
from experiments.training.forward import credit_fn, packing_applies
from experiments.training.methods import with_method
from experiments.training.metrics_io import read_metrics, summarize
from experiments.training.problems import build_problem


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
  """What stays fixed over a run. `passes`: its `passes.Pass` instances, pipeline order."""
  cfg: Any
  method: str
  seed: int
  run_seed: int
  problem: Any
  pcfg: Any
  loss_cfg: Any
  mesh: Any
  passes: tuple
  needs: tuple
  est: Any
  fp: str
  flat: dict
  init_params: Any
  ref_params: Any
  b: int          # prompts per step
  n_dev: int      # devices that hold different rows ('model' repeats them)
  lp_chunks: int  # old / reference log-probs run in the update step's parts
  use_packing: bool

  def hook(self, name: str, *args) -> None:
    for p in self.passes:
      getattr(p, name)(self, *args)

  def sample(self, params, key, draw):
    """The run's sampler on `draw` (InT's phase)."""
    return samplers.sample(params, self.pcfg, self.problem, self.cfg.sampler, key, draw.prompts,
                           prompt_ids=draw.prompt_ids)

  def evaluate(self, carry) -> dict:
    kw = {}
    for p in self.passes:
      kw.update(p.eval_kwargs(carry))
    return self.problem.evaluate(carry.state.params, self.cfg.eval, **kw)


def build(cfg, init_params, method=None, seed: int = 0) -> Run:
  """Checks cfg (before any work), builds the problem and mesh, selects the passes."""
  if method is not None:
    cfg = with_method(cfg, method)
  check_config(cfg)
  credit.check_hparams(cfg.credit.name, dict(cfg.credit.hparams))
  problem = build_problem(cfg)
  run_seed = cfg.rl.seed + seed
  fp, flat = fingerprint(run_config(cfg, run_seed))
  flat['init_params_sum'] = float(sum(float(jnp.sum(x)) for x in jax.tree.leaves(init_params)))
  fp = hashlib.sha1((fp + repr(flat['init_params_sum'])).encode()).hexdigest()
  mesh = ts.make_mesh(cfg.mesh.fsdp, model=cfg.mesh.get('model', 1))
  ts.check_model_axis(problem.pcfg, ts.mesh_axis(mesh, 'model'))  # a clear error, before work
  hparams_json = json.dumps(cfg.credit.hparams.to_dict() if hasattr(cfg.credit.hparams, 'to_dict')
                            else dict(cfg.credit.hparams), sort_keys=True)
  loss_cfg, b = loss_config(cfg), cfg.rl.prompts_per_step
  return Run(
      cfg=cfg, method=method or f'{cfg.credit.name}:{cfg.sampler.name}', seed=seed,
      run_seed=run_seed, problem=problem, pcfg=problem.pcfg, loss_cfg=loss_cfg, mesh=mesh,
      passes=passes_lib.select(cfg, json.loads(hparams_json)),
      needs=credit.needs(cfg.credit.name),
      est=credit_fn(cfg.credit.name, hparams_json, samplers.get(cfg.sampler.name).tree,
                    credit.stateful(cfg.credit.name)),
      fp=fp, flat=flat, init_params=init_params,
      ref_params=jax.device_put(init_params, ts.param_sharding(init_params, mesh)),  # as policy
      b=b, n_dev=ts.row_shards(mesh),
      lp_chunks=loss_cfg.num_minibatches * loss_cfg.num_microbatches,
      use_packing=packing_applies(cfg, b, ts.row_shards(mesh)))


def start(run: Run, mngr, metrics_path: str):
  """(carry, the starting row's extra fields, the metrics sinks of cfg.log, JSONL first,
  for the caller to close: `tracking.open_sinks`): the newest intact
  checkpoint's state and loop state, or a fresh one (the passes' start hooks run: InT's
  phase). The carry's totals continue from the metric rows kept (a torn final line dropped)."""
  o = run.cfg.optimizer
  tx = ts.make_optimizer(o.lr, o.warmup_steps, o.weight_decay, o.grad_clip, o.b1, o.b2,
                         lora_only=run.pcfg.lora_rank > 0)
  state = ts.shard_state(ts.init_state(jax.tree.map(jnp.copy, run.init_params), tx,
                                       seed=run.run_seed), run.mesh)  # restores onto the mesh
  run.hook('prepare')
  aux = dict.fromkeys(passes_lib.STATE_KEYS)
  for p in run.passes:
    if p.state_key:
      aux[p.state_key] = p.init_state(run, state)
  restored, meta, aux = restore_checkpoint(mngr, state, run.fp, run.flat, aux)
  for p in run.passes:
    if p.state_key:
      aux[p.state_key] = p.restored(run, aux[p.state_key])
  step, wall0, phase = 0, 0.0, {}
  if restored is not None:
    state, step, wall0 = restored, meta['rl_step'], meta['wall_s']
  else:
    for p in run.passes:
      state, info = p.start(run, state)
      phase.update(info)
  carry = passes_lib.Carry(state=ts.shard_state(state, run.mesh), aux=aux, step=step,
                           t_start=time.time() - wall0)
  writer = tracking.open_sinks(run.cfg, metrics_path, step if restored is not None else None,
                               name=f'{run.method}/seed{run.seed}', group=run.method,
                               config=dict(run.flat, method=run.method, seed=run.seed))
  rows = writer.rows  # the rows up to the restored step
  carry.totals = dict(
      generated=max([r.get('generated_tokens_total', 0.0) for r in rows] + [0.0])
      + sum(phase.get(p.start_tokens, 0.0) for p in run.passes if p.start_tokens),
      env_steps=max([r.get('env_steps_total', 0.0) for r in rows] + [0.0]))
  return carry, phase, writer


def save(run: Run, mngr, carry) -> None:
  """Checkpoints the train state and every pass's loop state after carry.step, together."""
  meta = dict(fingerprint=run.fp, config=run.flat, rl_step=carry.step,
              wall_s=time.time() - carry.t_start, method=run.method)
  save_checkpoint(mngr, carry.step, carry.state, meta, carry.aux)


def summary(run: Run, carry, workdir: str) -> dict:
  out = summarize(read_metrics(os.path.join(workdir, 'metrics.jsonl')), run.cfg.eval.pass_k,
                  params=carry.state.params)
  for p in run.passes:
    out.update(p.result(carry))
  return out
