"""SPO (Segment Policy Optimization, Guo et al. 2025): segment-level advantages
from Monte-Carlo values on a sampled tree (SPO-tree) or at cutpoints along a
chain (SPO-chain)."""

import jax.numpy as jnp

from credit.groups import whiten_nonzero
from credit.registry import register
from credit.rollouts import Rollouts, tree_of
from credit.tree_edges import edge_advantages


def _drop_zero_edges(rollouts, adv, drop_zero: bool = False, **_):
  return rollouts.mask & (adv != 0) if drop_zero else rollouts.mask


@register("spo_tree", loss_mask=_drop_zero_edges)
def spo_tree(rollouts: Rollouts, mode: str = "rloo", value: str = "children",
             drop_zero: bool = False, eps: float = 1e-8):
  """SPO-tree (Guo et al. 2025):
  V(leaf) = R, V(node) = mean of its children's values; every edge gets
  A = V(child) − V(parent) (`mode='rloo'`) or that difference over the std
  (Bessel-corrected: our choice) of the child's siblings' values + eps (`mode='grpo'`),
  on all tokens of the edge's segment.

  `value='leaves'` uses the mean reward of the responses below instead (equal
  for a full fixed-branching tree). `drop_zero=True` also takes zero-advantage
  segments out of the loss (`credit.loss_mask`). On a tree with no shared
  prefixes every response is one edge from the root, and 'rloo' mode is Dr.
  GRPO's R − μ, 'grpo' mode GRPO with eps = 1e-8. Returns float32 [..., G, L].
  """
  if mode not in ("rloo", "grpo"):
    raise ValueError(f"unknown SPO mode {mode!r}; choose 'rloo' or 'grpo'.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  return edge_advantages(tree_of(rollouts), rewards, value=value, baseline="parent",
                         normalise=mode == "grpo", ddof=1, eps=eps)


def _kept_tokens(rollouts, threshold):
  """Tokens with p <= threshold under the sampling policy (all if no log-probs)."""
  logprobs = rollouts.sampling_logprobs
  if logprobs is None:
    return rollouts.mask
  return rollouts.mask & (logprobs <= jnp.log(threshold))


def _probability_mask(rollouts, adv, threshold: float = 0.9, **_):
  return _kept_tokens(rollouts, threshold)


@register("spo_chain", loss_mask=_probability_mask)
def spo_chain(rollouts: Rollouts, threshold: float = 0.9, value: str = "children",
              whiten: bool = True, eps: float = 1e-8):
  """SPO-chain (Guo et al. 2025): segment k, between cutpoints c_{k−1} and
  c_k, gets A = V(c_k) − V(c_{k−1}), V(c) the mean outcome of the Monte-Carlo
  continuations sampled at cutpoint c; then the probability mask (tokens with
  p > `threshold` get no advantage and no loss) and whitening over the kept tokens.

  The cutpoints are the branch points of the rollouts' explicit tree, as built
  by the `tree_cutpoints` sampler (forks before tokens with p < threshold, every
  k-th kept); V is `value` as in `spo_tree`. p comes from `old_logprobs` (else
  `logprobs`); without either there is no probability mask. With no shared
  prefixes this is REINFORCE++-baseline (R − μ whitened over the batch).
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  adv = edge_advantages(tree_of(rollouts), rewards, value=value, baseline="parent")
  kept = _kept_tokens(rollouts, threshold)
  adv = jnp.where(kept, adv, 0.0)
  return whiten_nonzero(adv, kept, eps) if whiten else adv
