"""TreePO (Li et al. 2025): per-response advantages averaged over the subtrees
that contain the response."""

import jax.numpy as jnp

import trees
from credit.groups import rounding_tolerance, to_tokens, whiten_nonzero
from credit.registry import register
from credit.rollouts import Rollouts, tree_of


@register("treepo")
def treepo(rollouts: Rollouts, whiten: bool = True, eps: float = 1e-8):
  """TreePO (Li et al. 2025): A_i = mean over the ancestors a of response i
  of (R_i − mean reward of the leaves under a), counting only ancestors with
  more than one leaf (the root always), then whitened over the batch's tokens.

  Along a path the ancestors' leaf sets only change at branch points, so each
  distinct set (= each depth of a segment tree) is counted once: the root,
  plus the node after every branching token whose subtree holds > 1 leaf.
  `whiten=False` returns the raw averages. With no shared prefixes this is
  REINFORCE++-baseline. Returns float32 [..., G, L].
  """
  tree = tree_of(rollouts)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  _, v_after = trees.prefix_values(tree, rewards)
  counted = tree.branches & (tree.count > 1)
  tol = rounding_tolerance(rewards)
  gap = rewards[..., None] - v_after
  gap = jnp.where(counted & (jnp.abs(gap) > tol), gap, 0.0)  # rounding of equal means -> 0
  root = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
  root = jnp.where(jnp.abs(root) > tol[..., 0], root, 0.0)
  adv = (root + jnp.sum(gap, axis=-1)) / (1.0 + jnp.sum(counted, axis=-1))
  adv = to_tokens(adv, rollouts.mask)
  return whiten_nonzero(adv, rollouts.mask, eps) if whiten else adv
