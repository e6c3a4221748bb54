"""Tree-GRPO (Ji et al. 2025, tree search for LLM-agent RL): group-relative
advantages within the prompt's group and within each sampled tree."""

import jax.numpy as jnp

import trees
from credit.groups import to_tokens
from credit.outcome import grpo
from credit.registry import register
from credit.rollouts import Rollouts, tree_of


@register("tree_grpo")
def tree_grpo(rollouts: Rollouts, eps: float = 1e-6):
  """Tree-GRPO (Ji et al. 2025): A_i = (R_i − μ_group)/(σ_group + ε)
  + (R_i − μ_tree)/(σ_tree + ε), σ Bessel-corrected.

  A *tree* is a subtree of the root: the responses that share their first
  node (with `trees.from_forks`, a root chain and everything forked from it
  after position 0). A tree with one leaf, or all-equal rewards, adds exactly
  0, so with no shared prefixes this is GRPO. Empty responses form no tree.
  Returns float32 [..., G, L].
  """
  tree = tree_of(rollouts)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  first = tree.node[..., 0]  # [..., G], N for an empty response
  gather = lambda v: jnp.take_along_axis(v, first, axis=-1, mode="fill", fill_value=0)
  mean = gather(trees.node_mean(tree, rewards))
  std = gather(trees.node_std(tree, rewards, ddof=1))
  equal = gather(trees.node_max(tree, rewards)) == gather(trees.node_min(tree, rewards))
  within = jnp.where(equal | ~tree.mask[..., 0], 0.0, (rewards - mean) / (std + eps))
  return grpo(rollouts.replace(mask=tree.mask), eps=eps) + to_tokens(within, tree.mask)
