"""TreeRL (Hou et al. 2025, EPTree): process credit from leave-one-out normalised
leaf rewards on an entropy-forked tree."""

import jax.numpy as jnp

import trees
from credit.groups import loo_centred
from credit.registry import register
from credit.rollouts import Rollouts, tree_of


@register("treerl")
def treerl(rollouts: Rollouts, sqrt_leaves: bool = False):
  """TreeRL (Hou et al. 2025): leaves R̃_i = R_i − mean_{j≠i} R_j, node values
  V(s) = mean of R̃ over the responses below s, and every segment gets the node
  reward (V(s) − V(parent(s))) + V(s) of the node it leads to (global plus local
  advantage), divided by √n(s) (leaves below s) if `sqrt_leaves`.

  With no shared prefixes every response is one segment from the root, where
  V = 0, so this is 2·RLOO. A group of one or all-equal rewards give exactly 0.
  Returns float32 [..., G, L].
  """
  tree = tree_of(rollouts)
  normalised = loo_centred(jnp.asarray(rollouts.rewards, jnp.float32))
  v_before, v_after = trees.prefix_values(tree, normalised)
  node_reward = jnp.where(tree.branches, v_after - v_before, 0.0) + v_after
  if sqrt_leaves:
    node_reward = node_reward / jnp.sqrt(jnp.maximum(tree.count, 1).astype(jnp.float32))
  return trees.segment_fill(tree, node_reward)
