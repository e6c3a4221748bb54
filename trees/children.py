"""Children of each node, and node values defined recursively over them.

A node's children are its child nodes *plus one terminal child per response
that ends at the node* (its value is that response's reward). This matches
`PrefixTree.branches`: a response ending at a state leaves it like another
next token, so a node has two or more children exactly where it branches.

Used by the explicit-tree estimators that define values bottom-up (SPO-tree,
TreeRPO / Sibling-GRPO, MARS²): V(leaf) = R, V(u) = mean of u's children's
values. Unrolled, V(u) = Σ_g P(u → g) R_g, where P(u → g) is the probability
that a walk down from u choosing a child uniformly at every node ends with
response g; this is a weighted mean over the responses below u, computed here
with segment sums instead of a bottom-up loop over depths.
"""

import flax
import jax
import jax.numpy as jnp

from trees.node_values import node_mean, per_group
from trees.prefix_tree import PrefixTree


@flax.struct.dataclass
class ChildStats:
  """Statistics over each node's children (terminal children included). Each [..., N].

  Attributes:
    count: number of children (0 for unused slots; >= 1 for the root).
    sum: sum of the children's values.
    mean: mean of the children's values (0 where there are none).
    std: std of the children's values with the requested ddof (0 where count <= ddof).
  """

  count: jax.Array
  sum: jax.Array
  mean: jax.Array
  std: jax.Array


def end_nodes(tree: PrefixTree):
  """int32 [..., G]: the node each response ends at (the root if it is empty)."""
  lengths = tree.lengths
  last = jnp.take_along_axis(tree.node, jnp.maximum(lengths - 1, 0)[..., None], axis=-1)[..., 0]
  return jnp.where(lengths > 0, last, 0)


def _children_reducer(tree, terminal=True):
  """(valid, parent, end, reduce): reduce(x_nodes [N], y_leaves [G]) sums over each
  node's children, real ones (by `node_parent`) and, if `terminal`, terminal ones."""
  n = tree.num_nodes
  valid = (tree.node_count > 0) & (jnp.arange(n) > 0)
  parent = jnp.where(valid, tree.node_parent, n)
  end = end_nodes(tree)

  def reduce(nodes, leaves):
    out = jax.ops.segment_sum(nodes, parent, num_segments=n)
    return out + jax.ops.segment_sum(leaves, end, num_segments=n) if terminal else out

  return valid, parent, end, reduce


def _child_count(tree, terminal=True):
  valid, _, _, reduce = _children_reducer(tree, terminal)
  return reduce(valid.astype(jnp.float32), jnp.ones(tree.group_size))


def _child_stats(tree, node_values, leaf_values=None, ddof=0):
  """Stats over each node's children; without `leaf_values`, over its child nodes only."""
  terminal = leaf_values is not None
  valid, parent, end, reduce = _children_reducer(tree, terminal)
  x = jnp.where(valid, jnp.asarray(node_values, jnp.float32), 0.0)
  y = jnp.asarray(leaf_values if terminal else jnp.zeros(tree.group_size), jnp.float32)
  count = reduce(valid.astype(jnp.float32), jnp.ones(tree.group_size))
  total = reduce(x, y)
  mean = total / jnp.maximum(count, 1.0)
  take = lambda v, ids: jnp.take(v, ids, mode="fill", fill_value=0)
  sq = reduce(jnp.where(valid, (x - take(mean, parent)) ** 2, 0.0), (y - mean[end]) ** 2)
  std = jnp.sqrt(jnp.where(count > ddof, sq / jnp.maximum(count - ddof, 1.0), 0.0))
  return ChildStats(count=count.astype(jnp.int32), sum=total, mean=mean, std=std)


def _child_mean_values(tree, rewards):
  n = tree.num_nodes
  log_c = jnp.log(jnp.maximum(_child_count(tree), 1.0))
  mask = tree.mask
  # log 1/P(s_{t+1} → end of g) = Σ_{t' >= t} log c(s_{t'+1}): a reverse cumulative sum.
  log_c_after = jnp.where(mask, jnp.take(log_c, tree.node, mode="fill", fill_value=0), 0.0)
  suffix = jnp.flip(jnp.cumsum(jnp.flip(log_c_after, -1), axis=-1), -1)
  rewards = jnp.asarray(rewards, jnp.float32)
  w = jnp.where(mask, jnp.exp(-suffix), 0.0)
  reduce = lambda v: jax.ops.segment_sum(v.reshape(-1), tree.node.reshape(-1), num_segments=n)
  num, den = reduce(w * rewards[:, None]), reduce(w)
  w_root = jnp.exp(-suffix[:, 0] - log_c[0])  # suffix is 0 for an empty response
  num, den = num.at[0].set(jnp.sum(w_root * rewards)), den.at[0].set(jnp.sum(w_root))
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def child_stats(tree: PrefixTree, node_values, leaf_values, ddof: int = 0) -> ChildStats:
  """Count, sum, mean and std over each node's children.

  Args:
    tree: a `PrefixTree` of [..., G, L] groups.
    node_values: float [..., N], the value of every node (used for its parent's stats).
    leaf_values: float [..., G], the value of each response's terminal child
      (usually its reward).
    ddof: as numpy's (1 = Bessel-corrected).
  """
  return _batched_child_stats(tree, node_values, leaf_values, ddof=ddof)


def child_mean_values(tree: PrefixTree, rewards) -> jax.Array:
  """Bottom-up node values [..., N]: V(terminal child) = R, V(u) = mean of u's children.

  Equals `node_mean(tree, rewards)` (mean over the responses below) when every
  node at a depth has the same number of children, e.g. a full fixed-branching tree.
  """
  return _batched_child_mean_values(tree, rewards)


_batched_child_stats = per_group(_child_stats, static=("ddof",))
_batched_child_mean_values = per_group(_child_mean_values)


def tree_values(tree: PrefixTree, rewards, kind: str = "children") -> jax.Array:
  """Node values [..., N]: 'children' (`child_mean_values`, bottom-up means of
  children) or 'leaves' (`node_mean`, the mean reward of the responses below)."""
  if kind == "children":
    return child_mean_values(tree, rewards)
  if kind == "leaves":
    return node_mean(tree, rewards)
  raise ValueError(f"unknown node value kind {kind!r}; choose 'children' or 'leaves'.")
