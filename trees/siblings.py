"""Statistics over siblings: the children of the same parent node.

Used by sibling-relative tree estimators (Sibling-GRPO, SPO-tree's "grpo"
mode, MARS²): each node is compared with the other children of its parent.
"""

import flax
import jax
import jax.numpy as jnp

from trees.node_values import per_group
from trees.prefix_tree import PrefixTree


@flax.struct.dataclass
class SiblingStats:
  """Per-node statistics over the node's siblings (itself included). Each [..., N].

  Attributes:
    count: number of children of the node's parent (0 for the root and unused slots).
    mean: mean of the siblings' values.
    std: population std of the siblings' values (0 for an only child).
    loo_mean: mean of the *other* siblings' values (0 for an only child).
  """

  count: jax.Array
  mean: jax.Array
  std: jax.Array
  loo_mean: jax.Array


def _sibling_stats(tree, node_values):
  valid = (tree.node_count > 0) & (jnp.arange(tree.num_nodes) > 0)
  parent = jnp.where(valid, tree.node_parent, tree.num_nodes)
  x = jnp.where(valid, jnp.asarray(node_values, jnp.float32), 0.0)
  reduce = lambda v: jax.ops.segment_sum(v, parent, num_segments=tree.num_nodes)
  gather = lambda v: jnp.take(v, parent, mode="fill", fill_value=0)
  count = gather(reduce(valid.astype(jnp.float32)))
  total = gather(reduce(x))
  mean = total / jnp.maximum(count, 1.0)
  var = gather(reduce(jnp.where(valid, (x - mean) ** 2, 0.0))) / jnp.maximum(count, 1.0)
  loo = jnp.where(count > 1, (total - x) / jnp.maximum(count - 1.0, 1.0), 0.0)
  zero = lambda v: jnp.where(valid, v, 0.0)
  return SiblingStats(count=zero(count).astype(jnp.int32), mean=zero(mean),
                      std=zero(jnp.sqrt(var)), loo_mean=zero(loo))


def sibling_stats(tree: PrefixTree, node_values) -> SiblingStats:
  """Mean, std, count and leave-one-out mean of `node_values` [..., N] over each
  node's siblings; 0 on the root and unused slots."""
  return _batched_sibling_stats(tree, node_values)


_batched_sibling_stats = per_group(_sibling_stats)
