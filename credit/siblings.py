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
  v = trees.tree_values(tree, rewards, value)
  stats = trees.child_stats(tree, v, rewards)
  end = trees.end_nodes(tree)
  last = jnp.maximum(tree.lengths - 1, 0)[..., None]
  start = jnp.take_along_axis(trees.segment_start(tree), last, axis=-1)
  split = jnp.take_along_axis(tree.parent, start, axis=-1)[..., 0]  # s_b of the last segment
  ends_shared = jnp.take_along_axis(stats.count, end, axis=-1) > 1
  parent = jnp.where(ends_shared | (tree.lengths == 0), end, split)
  gather = lambda x: jnp.take_along_axis(x, parent, axis=-1)
  c, r_parent = gather(stats.count).astype(jnp.float32), gather(v)
  others = jnp.where(c > 1, (gather(stats.sum) - rewards) / jnp.maximum(c - 1.0, 1.0), r_parent)
  gap = rewards - ((1.0 - lam) * r_parent + lam * others)
  gap = jnp.where(jnp.abs(gap) > rounding_tolerance(rewards)[..., 0], gap, 0.0)
  shaped = rewards + gamma * gap
  return grpo(rollouts.replace(rewards=shaped, mask=tree.mask), eps=eps)
