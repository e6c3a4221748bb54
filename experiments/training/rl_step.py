"""One RL step as stages, each a call: sample, score, old log-probs and the passes' inputs,
credit, update and commit, the metric row. No feature is named here: the passes' hooks
(experiments/training/passes) do the optional parts."""

import contextlib
import time

import jax
import jax.numpy as jnp

from experiments.rollouts import knapsack as knapsack_lib
from experiments.training import samplers
from experiments.training import train_step as ts
from experiments.training.forward import pack_groups, rows_logprobs
from experiments.training.passes import Step


def rl_step(run, carry, i: int) -> dict:
  """Step i (all randomness from fold_in(key(run_seed), i)): updates `carry` in place
  (committed in one statement) and returns the step's metric row (no eval yet)."""
  k = jax.random.fold_in(jax.random.PRNGKey(run.run_seed), i)
  t0 = time.perf_counter()
  s = Step(i=i, draw=run.problem.draw(jax.random.fold_in(k, 0), i, run.b))
  s.prompts, s.plen = s.draw.prompts, s.draw.prompt_len
  # Every process drew the whole batch; each feeds its devices' rows. (One device: as drawn,
  # as the evaluation samples them, so that the two share compiled samplers.)
  if run.b % run.n_dev == 0 and run.mesh.size > 1:
    s.prompts, s.plen = ts.host_batch_to_global((s.prompts, s.plen), run.mesh)
  s.sampling_params = carry.state.params
  run.hook('before_sample', carry, s)
  s.samples = sample(run, carry, s, jax.random.fold_in(k, 1))
  score(run, carry, s)
  t1 = time.perf_counter()
  logprobs(run, carry, s)
  t2 = time.perf_counter()
  run.hook('credit_inputs', carry, s)
  s.credit_out = run.est(s.samples.tokens, s.samples.mask, s.train_rewards, s.samples.parent,
                         s.samples.fork, s.old_lp, s.ref_lp, *s.process,
                         policy_mask=s.policy_mask, turns=s.turns, **s.extra)
  s.credit_out[0].block_until_ready()
  t3 = time.perf_counter()
  m = update(run, carry, s)
  t4 = time.perf_counter()
  return metric_row(run, carry, s, m, (t0, t1, t2, t3, t4))


def sample(run, carry, s, key):
  """Samples [B, G, L]: the problem's own sampler (multi-turn episodes), or the registry's
  (on a mesh of > 1 device, rows of the KV cache split over it)."""
  if 'own_sampler' in run.problem.capabilities:
    return run.problem.sample(carry.state.params, run.cfg.sampler, key, s.draw, **s.problem_kw)
  with jax.set_mesh(run.mesh) if run.mesh.size > 1 else contextlib.nullcontext():
    return samplers.sample(s.sampling_params, run.pcfg, run.problem, run.cfg.sampler, key,
                           s.prompts, prompt_ids=s.draw.prompt_ids, prompt_len=s.plen,
                           info=s.draw.handle, progress=s.i / run.cfg.rl.steps, **s.sample_kw)


def score(run, carry, s) -> None:
  """Rewards [B, G] (0 on padded rows), then the passes' after-rewards hooks (replay)."""
  s.rewards, s.reward_metrics = run.problem.rewards(s.draw, s.samples)
  s.row_mask = getattr(s.samples, 'row_mask', None)  # groups of varying size
  if s.row_mask is not None:
    s.rewards = jnp.where(s.row_mask, s.rewards, 0.0)
  s.fresh_rewards = s.rewards
  run.hook('after_rewards', carry, s)
  s.rewards.block_until_ready()


def logprobs(run, carry, s) -> None:
  """Packing, the old log-probs (teacher-forced with rl.recompute_logprobs: ratio exactly 1
  at the first update; else the sampler's untempered ones), then the passes' inputs."""
  if run.use_packing:
    s.packed = pack_groups(run.cfg.train, s.prompts, s.samples, s.plen, carry.pack_len)
    carry.pack_len = s.packed.pack_len
  s.policy_mask = getattr(s.samples, 'policy_mask', None)
  run.hook('before_logprobs', carry, s)
  if run.cfg.rl.recompute_logprobs:
    out = rows_logprobs(s.sampling_params, s.prompts, s.samples.tokens, s.samples.mask, s.plen,
                        s.packed, cfg=run.pcfg, chunks=run.lp_chunks, with_entropy=s.with_entropy)
    s.old_lp, s.tf_entropy = out if s.with_entropy else (out, None)
  else:
    s.old_lp = s.samples.logprobs
  s.extra, s.train_rewards = dict(entropy=None, row_mask=s.row_mask), s.rewards
  run.hook('inputs', carry, s)
  s.old_lp.block_until_ready()


def update(run, carry, s) -> dict:
  """The passes' updates, the policy update (unless a pass gates it) and their after-update
  hooks, committed together; returns the step's metrics (floats)."""
  adv, loss_mask = s.credit_out[:2]
  batch = ts.batch_from_samples(s.prompts, s.samples.tokens, loss_mask, adv, s.old_lp, s.ref_lp,
                                s.plen, s.packed)
  if (run.b if s.packed is not None else batch.tokens.shape[0]) % run.n_dev == 0:
    batch = ts.shard_batch(batch, run.mesh)
  nxt, pass_m = {}, {}
  for p in run.passes:
    value, pm = p.update(run, carry, s)
    if p.state_key:
      nxt[p.state_key] = value
    pass_m.update(pm)
  # From the donating update to the commit, the carry is not one step's: an interrupt
  # there keeps the last checkpoint (loop.train's KeyboardInterrupt handler).
  carry.dirty = True
  gate = next((g for g in (p.gates_update(run, s.i) for p in run.passes) if g is not None), None)
  if gate is not None:
    m = dict(gate)
  else:
    carry.state, m = ts.train_step_jit(carry.state, batch, cfg=run.pcfg, loss_cfg=run.loss_cfg)
  for p in run.passes:
    carry.state, pm = p.after_update(run, carry, s, carry.state, nxt)
    m.update(pm)
  carry.aux, carry.step, carry.dirty = {**carry.aux, **nxt}, s.i + 1, False  # the commit
  m.update(pass_m)
  carry.pending = dict(step=carry.step, wall_s=time.time() - carry.t_start, method=run.method,
                       seed=run.seed, interrupted=True)
  return {k: float(v) for k, v in m.items()}


def metric_row(run, carry, s, m: dict, t: tuple) -> dict:
  """The step's row: generated tokens (forks' copied prefixes and replayed rows are not
  generated at this step; multi-turn: copied turns are not), rewards, metrics, timings."""
  t0, t1, t2, t3, t4 = t
  samples = s.samples
  ntok = float(jnp.sum(getattr(samples, 'policy_mask', samples.mask)))  # trained tokens
  m.update(samplers.get(run.cfg.sampler.name).row_fields(samples))
  if 'own_sampler' in run.problem.capabilities:
    gen, steps_now = float(samples.generated_tokens), float(samples.env_steps)
    carry.totals['env_steps'] += steps_now
    counts = dict(env_steps=steps_now, env_steps_total=carry.totals['env_steps'],
                  env_steps_per_s=steps_now / (t1 - t0))
  else:  # i.i.d.: fork 0
    gen = ntok - float(jnp.sum(jnp.where(samples.parent >= 0, jnp.minimum(
        samples.fork, samples.lengths), 0)))
    counts = {}
    for p in run.passes:
      fewer, c = p.counts(run, s)
      gen = gen if fewer is None else gen - fewer
      counts.update(c)
  carry.totals['generated'] += gen
  r = ts.host_value(s.rewards)  # all rows, on every process (trained: replayed included)
  rows = None if s.row_mask is None else ts.host_value(s.row_mask)
  fresh = ts.host_value(s.fresh_rewards)
  group_signal, row_signal = knapsack_lib.signal(r, rows)
  extra = {}
  for p in run.passes:
    extra.update(p.row_fields(run, carry, s))
  return dict(step=carry.step, wall_s=time.time() - carry.t_start, method=run.method,
              seed=run.seed, generated_tokens=gen, generated_tokens_total=carry.totals['generated'],
              **counts, reward=float(fresh.mean() if rows is None else fresh[rows].mean()),
              frac_groups_with_signal=group_signal, frac_rows_with_signal=row_signal,
              response_len=ntok / (r.size if rows is None else rows.sum()), **m,
              sample_s=t1 - t0, logprob_s=t2 - t1, credit_s=t3 - t2, update_s=t4 - t3,
              step_s=t4 - t0, sampled_tokens_per_s=ntok / (t1 - t0),
              train_tokens_per_s=ntok * run.loss_cfg.num_epochs / (t4 - t3),
              credit_frac=(t3 - t2) / (t4 - t0), **s.reward_metrics, **extra)

