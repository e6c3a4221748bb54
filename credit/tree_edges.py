"""Edge credit on trees: each segment gets V(child) minus a baseline, optionally
scaled by the spread of the child's siblings. Shared by SPO-tree, SPO-chain and
TreeRPO / Sibling-GRPO.

With token-level nodes, the edge out of a branch point s_b is the segment that
starts at token b; V(child) is constant along it (nothing branches inside), so
the segment's advantage is read at its first token and copied to the rest
(`trees.segment_fill`). A node's siblings are its parent's children, terminal
children (responses ending at the parent) included (`trees.child_stats`).
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
  v = trees.tree_values(tree, rewards, value)
  v_after = trees.to_tokens(tree, v)
  stats = None
  if baseline == "parent":
    base = trees.to_tokens(tree, v, before=True)
  elif baseline == "siblings":
    stats = trees.child_stats(tree, v, rewards, ddof=ddof)
    base = trees.to_tokens(tree, stats.mean, before=True)
  else:
    raise ValueError(f"unknown baseline {baseline!r}; choose 'parent' or 'siblings'.")
  tol = rounding_tolerance(rewards)
  diff = v_after - base
  diff = jnp.where(tree.branches & (jnp.abs(diff) > tol), diff, 0.0)
  if normalise:
    stats = stats if stats is not None else trees.child_stats(tree, v, rewards, ddof=ddof)
    std = trees.to_tokens(tree, stats.std, before=True)
    diff = diff / (jnp.where(std > tol, std, 0.0) + eps)
  if rewards.shape[-1] > 1:
    diff = jnp.where(all_equal(rewards)[..., None], 0.0, diff)
  return trees.segment_fill(tree, diff)
