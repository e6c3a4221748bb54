"""PURE (Cheng et al. 2025): min-form credit assignment for process rewards."""

import jax
import jax.numpy as jnp

from credit.groups import loo_centred, loo_mean
from credit.registry import register
from credit.returns import reverse_linear_scan
from credit.rollouts import Rollouts


@register("pure", needs=("token_rewards", "step_ends"))
def pure(rollouts: Rollouts, temperature: float = 0.1, form: str = "min",
         outcome_coef: float = 1.0, step_ends=None):
  """PURE (Cheng et al. 2025): process rewards r_j at the steps of a response,
  re-weighted by softmin weights w_j = softmax_j(−r_j/T) (`form='min'`; 'sum' keeps
  w_j = 1), plus `outcome_coef`·R on the last token; returns G_t are reverse
  cumulative sums, and the baseline is the leave-one-out mean of the other
  responses' returns G_0: A_{i,t} = G_{i,t} − mean_{j≠i} G_{j,0}.

  In min form G_0 → min_j r_j as T → 0 (plus the outcome term). Steps are the
  tokens marked by `step_ends` (bool [..., G, L]; default: `rollouts.step_ends`,
  else every unmasked token), each carrying `token_rewards` there. Without `token_rewards` the
  returns are just R and this is RLOO. Returns float32 [..., G, L].
  """
  if form not in ("min", "sum"):
    raise ValueError(f"unknown PURE form {form!r}; choose 'min' or 'sum'.")
  mask = rollouts.mask
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  if rollouts.token_rewards is None:  # the returns are R on every token: exactly RLOO
    return jnp.where(mask, loo_centred(rewards)[..., None], 0.0)
  last = mask & ~jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], axis=-1)
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
