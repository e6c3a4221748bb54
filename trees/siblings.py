"""Statistics over sibling nodes: the child nodes of the same parent.

Responses that end at the parent are not counted here; `trees.child_stats`
counts them as terminal children, as the sibling-relative tree estimators
(Sibling-GRPO, SPO-tree's "grpo" mode, MARS²) do.
"""

import flax
import jax
import jax.numpy as jnp

from trees.children import _child_stats
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
  stats = _child_stats(tree, x)  # over the parent's child nodes
  gather = lambda v: jnp.where(valid, jnp.take(v, parent, mode="fill", fill_value=0), 0)
  count, total = gather(stats.count), gather(stats.sum)
  loo = jnp.where(count > 1, (total - x) / jnp.maximum(count - 1.0, 1.0), 0.0)
  return SiblingStats(count=count, mean=gather(stats.mean), std=gather(stats.std),
                      loo_mean=jnp.where(valid, loo, 0.0))


def sibling_stats(tree: PrefixTree, node_values) -> SiblingStats:
  """Mean, std, count and leave-one-out mean of `node_values` [..., N] over each
  node's siblings; 0 on the root and unused slots."""
  return _batched_sibling_stats(tree, node_values)


_batched_sibling_stats = per_group(_sibling_stats)
