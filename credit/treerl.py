"""TreeRL (Hou et al. 2025, EPTree): process credit from leave-one-out normalised
leaf rewards on an entropy-forked tree."""

import jax
import jax.numpy as jnp

import trees
from credit.groups import loo_centred, rounding_tolerance
from credit.registry import register
from credit.rollouts import Rollouts, tree_of


@register("treerl")
def treerl(rollouts: Rollouts, sqrt_leaves: bool = False, variant: str = "paper"):
  """TreeRL (Hou et al. 2025): leaves R̃_i = R_i − mean_{j≠i} R_j, node values
  V(s) = mean of R̃ over the responses below s, and every segment gets the node
  reward (V(s) − V(parent(s))) + V(s) of the node it leads to (global plus local
  advantage), divided by √n(s) (leaves below s) if `sqrt_leaves`.

  `variant='code'` is what the authors' released code runs (THUDM/TreeRL, `tree_node.py`
  with `weighted_value_style='sqrt'`, `parallel_mcts.fill_in_paths`; docs/conventions.md):
  V'(s) = V(s)/√n(s) before the difference is taken, and a segment whose difference is 0
  takes the last non-zero difference above it on its path (`sqrt_leaves` does not apply).
  The default is the paper's formula (the README's results).

  With no shared prefixes every response is one segment from the root, where
  V = 0, so either variant is 2·RLOO. A group of one or all-equal rewards give exactly 0.
  Returns float32 [..., G, L].
  """
  if variant not in ("paper", "code"):
    raise ValueError(f"unknown treerl variant {variant!r}; choose 'paper' or 'code'.")
  if variant == "code" and sqrt_leaves:
    raise ValueError("treerl: sqrt_leaves is the paper variant's weighting; variant='code' "
                     "divides by √n(s) before the differences.")
  tree = tree_of(rollouts)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  normalised = loo_centred(rewards)
  v_before, v_after = trees.prefix_values(tree, normalised)
  if variant == "code":
    n_before = trees.to_tokens(tree, tree.node_count, before=True)  # n(s_t)
    n_after = tree.count  # n(s_{t+1})
    v_before = v_before / jnp.sqrt(jnp.maximum(n_before, 1).astype(jnp.float32))
    v_after = v_after / jnp.sqrt(jnp.maximum(n_after, 1).astype(jnp.float32))
  diff = jnp.where(tree.branches, v_after - v_before, 0.0)
  if variant == "code":
    diff = _fill_in(diff, tree.branches & tree.mask, rounding_tolerance(rewards))
  node_reward = diff + v_after
  if sqrt_leaves:
    node_reward = node_reward / jnp.sqrt(jnp.maximum(tree.count, 1).astype(jnp.float32))
  return trees.segment_fill(tree, node_reward)


def _fill_in(diff, starts, tol):
  """The authors' `fill_in_paths`: along each response, a segment whose difference is 0
  (below `tol`, float rounding of equal means) takes the previous segment's, filled first.
  diff, starts: [..., G, L] (starts: the segments' first tokens); tol [..., 1, 1]."""
  t = jnp.arange(diff.shape[-1])
  nonzero = starts & (jnp.abs(diff) > tol)
  last = jax.lax.cummax(jnp.where(nonzero, t, -1), axis=diff.ndim - 1)
  filled = jnp.take_along_axis(diff, jnp.maximum(last, 0), axis=-1)
  return jnp.where(starts, jnp.where(last >= 0, filled, 0.0), diff)
