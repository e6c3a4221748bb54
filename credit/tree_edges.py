"""Edge credit on trees: each segment gets V(child) minus a baseline, optionally
scaled by the spread of the child's siblings. Shared by SPO-tree and
TreeRPO / Sibling-GRPO.

With token-level nodes, the edge out of a branch point s_b is the segment that
starts at token b; V(child) is constant along it (nothing branches inside), so
the segment's advantage is read at its first token and copied to the rest.
A node's siblings are its parent's children, terminal children (responses
ending at the parent) included (`trees.child_stats`).

Computed per level (`trees.level_stats`, [G, G] tables): a segment's child is
g's node at the level where its run last shrank, its parent the node one level
before, so the advantage is a [G, G] table expanded to tokens by one gather.
"""

import jax.numpy as jnp

import trees
from credit.groups import all_equal, rounding_tolerance


def edge_advantages(tree: trees.PrefixTree, rewards, *, value: str = "children",
                    baseline: str = "parent", normalise: bool = False, ddof: int = 1,
                    eps: float = 1e-8):
  """Per-token segment advantages [..., G, L] (0 on masked tokens).

  Args:
    tree: the rollouts' `PrefixTree` [..., G, L].
    rewards: float32 [..., G].
    value: node values, 'children' (V(u) = mean of its children's values, leaf =
      reward) or 'leaves' (mean reward of the responses below).
    baseline: 'parent' (V(child) − V(parent)) or 'siblings' (V(child) − mean of
      the parent's children's values; the same as 'parent' for value='children').
    normalise: divide by the std (`ddof`) of the parent's children's values + eps.

  Differences below `rounding_tolerance(rewards)` are float rounding of equal
  means and are set to exactly 0, so equal siblings never get an advantage.
  """
  if baseline not in ("parent", "siblings"):
    raise ValueError(f"unknown baseline {baseline!r}; choose 'parent' or 'siblings'.")
  rewards = jnp.asarray(rewards, jnp.float32)
  stats = trees.level_stats(tree, rewards, value, ddof=ddof)  # [..., G, G] per level
  at = lambda table, level: jnp.take_along_axis(table, jnp.maximum(level, 0), axis=-1)
  base = at(stats.value if baseline == "parent" else stats.mean, stats.parent)
  tol = rounding_tolerance(rewards)
  diff = at(stats.value, stats.start) - base  # V(child) − baseline, constant along the segment
  diff = jnp.where((stats.parent >= 0) & (jnp.abs(diff) > tol), diff, 0.0)
  if normalise:
    std = at(stats.std, stats.parent)
    diff = diff / (jnp.where(std > tol, std, 0.0) + eps)
  if rewards.shape[-1] > 1:
    diff = jnp.where(all_equal(rewards)[..., None], 0.0, diff)
  return trees.level_to_tokens(tree, diff)
