"""TEMPO: GRPO plus branch-gated temporal differences of prefix-tree values."""

import jax.numpy as jnp

import trees
from credit.groups import all_equal, group_stats
from credit.outcome import grpo
from credit.registry import register
from credit.rollouts import Rollouts, tree_of


@register("tempo")
def tempo(rollouts: Rollouts, scale_by_std: bool = True, eps: float = 1e-6):
  """TEMPO (Prefix-to-Tree credit): A_{i,t} = [(R_i − μ) + V(s_{t+1}) − V(s_t)]/(σ + ε).

  V(s) is the mean reward of the responses through prefix s (`trees.prefix_values`).
  The TD term is 0 where nothing branches (`tree.branches` False), so TEMPO
  equals GRPO there; along a response the TD terms sum to V(s_len) − μ, which
  is R_i − μ when no other response extends it with a different reward.
  `scale_by_std=False` drops the division. A group of one gets μ = 0, σ = 1;
  all-equal rewards give exactly 0. Returns float32 [..., G, L], 0 on masked tokens.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  tree = tree_of(rollouts)
  v_before, v_after = trees.prefix_values(tree, rewards)
  td = v_after - v_before  # exactly 0 where nothing branches
  if scale_by_std:
    td = td / (group_stats(rewards)[1] + eps)[..., None]
  if rewards.shape[-1] > 1:
    td = jnp.where(all_equal(rewards)[..., None], 0.0, td)
  outcome = grpo(rollouts.replace(mask=tree.mask), scale_by_std=scale_by_std, eps=eps)
  return jnp.where(tree.mask, outcome + td, 0.0)
