"""Value-based credit beside tree values (issue 24): Monte Carlo values at forks.

`mc_values` reads the values V̂(s) a sampled group gives every prefix it visits (the mean
reward of the responses through s: at a tree sampler's fork points, an average over the
K continuations sampled there) and credits each token, or each reasoning step, with
V̂(s_{t+1}) − V̂(s_t), VinePPO's advantage with its Monte Carlo values taken from the
existing samplers' forks instead of extra rollouts. The learned critic that fills
`Rollouts.values` for `gae` / `ppo` is `experiments/training/critic.py`.
"""

import jax
import jax.numpy as jnp

import trees
from credit.groups import group_stats
from credit.registry import register
from credit.rollouts import Rollouts, tree_of

GRANULARITIES = ("token", "step")


def _step_sums(x, mask, ends):
  """Sum of x over each step (tokens up to and including a step end; the last step ends at
  the response's last token), given back on every token of the step. [..., L]."""
  l = x.shape[-1]
  idx = jnp.arange(l)
  last = mask & ~jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], -1)
  closes = (ends & mask) | last
  # end(t): the first closing index >= t; prev(t): the last closing index < t (-1: none).
  end = jax.lax.cummin(jnp.where(closes, idx, l), axis=x.ndim - 1, reverse=True)
  prev = jax.lax.cummax(jnp.where(closes, idx, -1), axis=x.ndim - 1)
  prev = jnp.concatenate([jnp.full_like(prev[..., :1], -1), prev[..., :-1]], -1)
  c = jnp.cumsum(jnp.where(mask, x, 0.0), -1)
  at = lambda i: jnp.where(i >= 0, jnp.take_along_axis(c, jnp.clip(i, 0, l - 1), -1), 0.0)
  return jnp.where(mask, at(jnp.minimum(end, l - 1)) - at(prev), 0.0)


@register("mc_values")
def mc_values(rollouts: Rollouts, granularity: str = "token", scale_by_std: bool = False,
              step_ends=None, eps: float = 1e-6):
  """Monte Carlo values at forks (VinePPO's A = V̂(s_{t+1}) − V̂(s_t), issue 24 item 3).

  V̂(s) is the mean reward of the group's responses through prefix s
  (`trees.prefix_values`, the sampled tree when the rollouts have one): at a fork, the
  mean over the continuations sampled from it. 'token': A_{i,t} = V̂(s_{t+1}) − V̂(s_t);
  'step': each reasoning step's tokens get V̂(step end) − V̂(step start) (`step_ends`,
  default `rollouts.step_ends`; the last step ends at the response's last token). Along a
  response the credit telescopes to V̂(its full prefix) − μ, which is R_i − μ (Dr. GRPO's
  advantage) unless longer responses extend it; it sits on the tokens where the tree
  branches (with no branching past the root, on the first token). This is TEMPO's temporal-difference term without its
  outcome term. `scale_by_std` divides by the group's σ + ε (GRPO's scale). Returns
  float32 [..., G, L], 0 on masked tokens.
  """
  if granularity not in GRANULARITIES:
    raise ValueError(f"mc_values granularity={granularity!r}; valid: {', '.join(GRANULARITIES)}.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  tree = tree_of(rollouts)
  v_before, v_after = trees.prefix_values(tree, rewards)
  adv = jnp.where(tree.mask, v_after - v_before, 0.0)
  if granularity == "step":
    ends = rollouts.step_ends if step_ends is None else step_ends
    if ends is None:
      raise ValueError("mc_values(granularity='step') needs step_ends [..., G, L] (the last "
                       "token of each reasoning step), as an argument or rollouts.step_ends.")
    ends = jnp.asarray(ends, bool)
    if ends.shape != tree.mask.shape:
      raise ValueError(f"step_ends must have the tokens' shape {tree.mask.shape}; got "
                       f"{ends.shape}.")
    adv = _step_sums(adv, tree.mask, ends)
  if scale_by_std:
    adv = adv / (group_stats(rewards)[1] + eps)[..., None]
  return jnp.where(tree.mask, adv, 0.0)
