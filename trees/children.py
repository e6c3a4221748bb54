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

`level_stats` computes the same values and child statistics per *level*
([G, G] tables, see `PrefixTree.level`): the node runs only change at the G − 1
adjacent lcps, so the estimators read them per level and expand to tokens with
one column gather (`trees.expand_levels`) instead of reducing over N = 1 + G·L nodes.
"""

import flax
import jax
import jax.numpy as jnp

from trees.node_values import node_mean, per_group
from trees.prefix_tree import PrefixTree, expand_levels


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


@flax.struct.dataclass
class LevelStats:
  """Node values and child statistics per response and level. Each [..., G, G].

  Entry [g, j] is about g's node at level j: the deepest node whose responses
  are the trie-order run `run_first[g, j]..run_last[g, j]`, at the level's last
  position (level 0: the whole group, the root or the deepest node all share;
  g's terminal child once g has ended). Its children are the runs at level
  j + 1 inside it (terminal children included), so `count`, `sum`, `mean`,
  `std` equal `child_stats` at that node; the nodes of the run above it have
  one child each and the same `value`.

  Attributes:
    value: float32, V of the node (`tree_values`).
    count: int32, its number of children (1 for a terminal child).
    sum, mean: float32, of its children's values.
    std: float32, of its children's values with the requested ddof (0 where count <= ddof).
    start: int32, the level where g's segment through level j starts: the last
      level <= j at which g's run shrank (a branch; 0 if none).
    parent: int32, start − 1: the level of the branch point s_b that segment
      hangs from (−1 if g has not branched by level j).
  """

  value: jax.Array
  count: jax.Array
  sum: jax.Array
  mean: jax.Array
  std: jax.Array
  start: jax.Array
  parent: jax.Array


def _level_stats(tree, rewards, value="children", ddof=0):
  """One group's `LevelStats` from the run tables [G, G]: O(G²) work, no [G, L] pass."""
  g, levels = tree.run_first.shape
  rewards = jnp.asarray(rewards, jnp.float32)
  first, size = tree.run_first, tree.run_last - tree.run_first + 1
  column = jnp.arange(levels, dtype=jnp.int32)
  ids = first + g * column  # one segment per (level, run)
  run_sum = lambda x: jax.ops.segment_sum(x.reshape(-1), ids.reshape(-1),
                                          num_segments=g * levels)[ids]
  rank = jnp.argsort(tree.order)  # trie position of each response
  # g heads its run at level j + 1 (after the last level every response is alone).
  head = jnp.concatenate([first[:, 1:], rank[:, None]], axis=1) == rank[:, None]
  count = run_sum(head.astype(jnp.float32))
  if value == "children":
    # V(u) = Σ_h P(u → h) R_h, log 1/P = Σ of log child counts below u on h's path.
    log_c = jnp.log(count)
    w = jnp.exp(-jnp.flip(jnp.cumsum(jnp.flip(log_c, 1), axis=1), 1))
    v = run_sum(w * rewards[:, None]) / run_sum(w)
  elif value == "leaves":
    v = run_sum(jnp.broadcast_to(rewards[:, None], first.shape)) / size
  else:
    raise ValueError(f"unknown node value kind {value!r}; choose 'children' or 'leaves'.")
  v_next = jnp.concatenate([v[:, 1:], rewards[:, None]], axis=1)  # the children's values
  total = run_sum(jnp.where(head, v_next, 0.0))
  mean = total / count
  sq = run_sum(jnp.where(head, (v_next - mean) ** 2, 0.0))
  std = jnp.sqrt(jnp.where(count > ddof, sq / jnp.maximum(count - ddof, 1.0), 0.0))
  shrank = jnp.concatenate([jnp.zeros((g, 1), bool), size[:, 1:] < size[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(shrank, column, 0), axis=1)
  return LevelStats(value=v, count=count.astype(jnp.int32), sum=total, mean=mean, std=std,
                    start=start, parent=start - 1)


def level_stats(tree: PrefixTree, rewards, value: str = "children", ddof: int = 0) -> LevelStats:
  """Node values and child statistics of every response's node at every level.

  The per-level form of `tree_values` + `child_stats`: equal (up to float
  rounding) to those node arrays read at `node[g, t]` for t at level j.

  Args:
    tree: a `PrefixTree` of [..., G, L] groups.
    rewards: float [..., G], the responses' rewards (their terminal children's values).
    value: 'children' or 'leaves', as in `tree_values`.
    ddof: for `std`, as numpy's (1 = Bessel-corrected).

  Returns:
    `LevelStats`, each field [..., G, G] in input row order.
  """
  return _batched_level_stats(tree, rewards, value=value, ddof=ddof)


def _level_to_tokens(tree, table):
  return jnp.where(tree.mask, expand_levels(table, tree.level), jnp.zeros((), table.dtype))


def level_to_tokens(tree: PrefixTree, table) -> jax.Array:
  """Per-token values from a per-level table: out[g, t] = table[g, level[t]], 0 on
  masked tokens. [..., G, G] -> [..., G, L], one column gather per group."""
  return _batched_level_to_tokens(tree, table)


_batched_level_stats = per_group(_level_stats, static=("value", "ddof"))
_batched_level_to_tokens = per_group(_level_to_tokens)


def tree_values(tree: PrefixTree, rewards, kind: str = "children") -> jax.Array:
  """Node values [..., N]: 'children' (`child_mean_values`, bottom-up means of
  children) or 'leaves' (`node_mean`, the mean reward of the responses below)."""
  if kind == "children":
    return child_mean_values(tree, rewards)
  if kind == "leaves":
    return node_mean(tree, rewards)
  raise ValueError(f"unknown node value kind {kind!r}; choose 'children' or 'leaves'.")
