"""Sibling-relative tree credit: TreeRPO / Sibling-GRPO and MARS² reward shaping."""

import jax.numpy as jnp

import trees
from credit.groups import rounding_tolerance
from credit.outcome import grpo
from credit.registry import register
from credit.rollouts import Rollouts, tree_of
from credit.tree_edges import edge_advantages


@register("sibling_grpo")
def sibling_grpo(rollouts: Rollouts, value: str = "children", eps: float = 1e-6):
  """TreeRPO (Yang et al. 2025) / Sibling-GRPO (V-STAR): each child's value,
  normalised against its siblings, (V(child) − mean)/(std + ε) with the mean
  and Bessel std of the parent's children's values, on the child's segment.

  V(leaf) = R and a parent's value is the mean of its children (`value=
  'children'`; 'leaves' = mean reward below). The root's children on a tree
  with no shared prefixes are the responses, so there this is GRPO.
  Returns float32 [..., G, L].
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  return edge_advantages(tree_of(rollouts), rewards, value=value, baseline="siblings",
                         normalise=True, ddof=1, eps=eps)


@register("mars2_shaping")
def mars2_shaping(rollouts: Rollouts, gamma: float = 0.5, lam: float = 0.5,
                  value: str = "children", eps: float = 1e-6):
  """MARS² tree reward shaping: r'_n = r_n + γ(r_n − b_n) with
  b_n = (1 − λ)·r_parent + λ·(mean of n's other siblings), then GRPO over r'.

  Our reading (the shaping is defined per node; the normalisation per group):
  n is each response's leaf, r_n its reward, its parent the deepest branch
  point on its path (the node where it last split from other responses) with
  value r_parent (`value` as in `sibling_grpo`), and its siblings that node's
  other children. An only child uses b_n = r_parent. With no shared prefixes
  the parent is the root (r_parent = μ) and the siblings are the other responses.
  Returns float32 [..., G, L].
  """
  tree = tree_of(rollouts)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  stats = trees.level_stats(tree, rewards, value)  # [..., G, G] per level
  lengths = tree.lengths
  end = jnp.take_along_axis(tree.level, jnp.maximum(lengths - 1, 0), axis=-1)  # leaf's level
  at = lambda table, level: jnp.take_along_axis(table, level[..., None], axis=-1)[..., 0]
  # The end node is the parent if other responses pass through it, else s_b of the last segment.
  ends_shared = at(tree.run_last - tree.run_first, end) > 0
  parent = jnp.where(lengths == 0, 0,
                     jnp.where(ends_shared, end, jnp.maximum(at(stats.parent, end), 0)))
  c, r_parent = at(stats.count, parent).astype(jnp.float32), at(stats.value, parent)
  others = jnp.where(c > 1, (at(stats.sum, parent) - rewards) / jnp.maximum(c - 1.0, 1.0),
                     r_parent)
  gap = rewards - ((1.0 - lam) * r_parent + lam * others)
  gap = jnp.where(jnp.abs(gap) > rounding_tolerance(rewards)[..., 0], gap, 0.0)
  shaped = rewards + gamma * gap
  return grpo(rollouts.replace(rewards=shaped, mask=tree.mask), eps=eps)
