"""PURE (Cheng et al. 2025): min-form credit assignment for process rewards."""

import jax
import jax.numpy as jnp

from credit.groups import last_tokens, loo_centred, loo_mean
from credit.registry import register
from credit.returns import reverse_linear_scan
from credit.rollouts import Rollouts


@register("pure", needs=("token_rewards", "step_ends"))
def pure(rollouts: Rollouts, temperature: float = 0.1, form: str = "min",
         outcome_coef: float = 1.0, step_ends=None, variant: str = "paper"):
  """PURE (Cheng et al. 2025): process rewards r_j at the steps of a response,
  re-weighted by softmin weights w_j = softmax_j(−r_j/T) (`form='min'`; 'sum' keeps
  w_j = 1), plus `outcome_coef`·R on the last token; returns G_t are reverse
  cumulative sums, and the baseline is the leave-one-out mean of the other
  responses' returns G_0: A_{i,t} = G_{i,t} − mean_{j≠i} G_{j,0}.

  In min form G_0 → min_j r_j as T → 0 (plus the outcome term). Steps are the
  tokens marked by `step_ends` (bool [..., G, L]; default: `rollouts.step_ends`,
  else every unmasked token), each carrying `token_rewards` there. Without `token_rewards` the
  returns are just R and this is RLOO. Returns float32 [..., G, L].

  `variant='code'` is what the authors' released code runs (CJReinforce/PURE @41f9363,
  `openrlhf/trainer/ppo_utils/experience_maker.py`, `NaiveExperienceMaker.process_experiences`
  and `make_experience_list`, as `examples/scripts/train_pure.sh` sets it: `--reward_baseline
  token`; docs/conventions.md). The last token always ends a step; step j of response i gets
  w_j·r_j − ρ_i·n_j (n_j: the step's tokens before its end token; ρ_i: the other responses'
  Σ w·r over their Σ length), the last token adds `outcome_coef`·(R_i − mean_{k≠i} R_k), and
  the reverse sums are set to 0 on every step-end token. 'sum' is `--disable_weighted_reward`
  (w_j = 1/#steps). Its KL penalty and batch whitening are not part of this estimator.
  """
  if variant not in ("paper", "code"):
    raise ValueError(f"unknown PURE variant {variant!r}; choose 'paper' or 'code'.")
  if form not in ("min", "sum"):
    raise ValueError(f"unknown PURE form {form!r}; choose 'min' or 'sum'.")
  if variant == "code":
    return _pure_code(rollouts, temperature, form, outcome_coef, step_ends)
  mask = rollouts.mask
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  if rollouts.token_rewards is None:  # the returns are R on every token: exactly RLOO
    return jnp.where(mask, loo_centred(rewards)[..., None], 0.0)
  last = last_tokens(mask)
  per_token = jnp.where(last, outcome_coef * rewards[..., None], 0.0)
  if step_ends is None:
    step_ends = rollouts.step_ends
  steps = mask if step_ends is None else mask & step_ends
  r = jnp.where(steps, jnp.asarray(rollouts.token_rewards, jnp.float32), 0.0)
  if form == "min":
    logits = jnp.where(steps, -r / temperature, -jnp.inf)
    has_steps = jnp.any(steps, axis=-1, keepdims=True)
    w = jax.nn.softmax(jnp.where(has_steps, logits, 0.0), axis=-1)
    r = jnp.where(steps, w * r, 0.0)
  m = mask.astype(jnp.float32)
  returns = reverse_linear_scan((per_token + r) * m, m)
  return jnp.where(mask, returns - loo_mean(returns[..., 0])[..., None], 0.0)


def _pure_code(rollouts, temperature, form, outcome_coef, step_ends):
  """`pure(variant='code')`: the authors' released computation (see `pure`)."""
  mask = jnp.asarray(rollouts.mask, bool)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  last = last_tokens(mask)
  if step_ends is None:
    step_ends = rollouts.step_ends
  steps = mask if step_ends is None else (mask & jnp.asarray(step_ends, bool)) | last
  if rollouts.token_rewards is None:  # no process rewards: the verifier term alone
    r = jnp.zeros(mask.shape, jnp.float32)
  else:
    r = jnp.where(steps, jnp.asarray(rollouts.token_rewards, jnp.float32), 0.0)
  has_steps = jnp.any(steps, axis=-1, keepdims=True)
  logits = jnp.where(steps, -r / temperature if form == "min" else 0.0, -jnp.inf)
  w = jax.nn.softmax(jnp.where(has_steps, logits, 0.0), axis=-1)
  r = jnp.where(steps, w * r, 0.0)
  # Leave-one-out reward per token of the other responses, times each step's length
  # (the tokens after the previous step end, the step's own end token excluded).
  total = jnp.sum(r, axis=-1)
  length = jnp.sum(mask, axis=-1).astype(jnp.float32)
  g = total.shape[-1]
  others = jnp.sum(length, -1, keepdims=True) - length
  rate = jnp.where((g > 1) & (others > 0),
                   (jnp.sum(total, -1, keepdims=True) - total) / jnp.maximum(others, 1.0), 0.0)
  pos = jnp.arange(mask.shape[-1])
  prev = jax.lax.cummax(jnp.where(steps, pos, -1), axis=steps.ndim - 1)
  prev = jnp.concatenate([jnp.full_like(prev[..., :1], -1), prev[..., :-1]], axis=-1)
  n_step = (pos - prev - 1).astype(jnp.float32)
  per_token = jnp.where(steps, r - rate[..., None] * n_step, 0.0)
  per_token += jnp.where(last, outcome_coef * loo_centred(rewards)[..., None], 0.0)
  returns = jnp.flip(jnp.cumsum(jnp.flip(per_token, -1), axis=-1), -1)
  return jnp.where(mask & ~steps, returns, 0.0)
