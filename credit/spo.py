"""SPO (Segment Policy Optimization, Guo et al. 2025): segment-level advantages
from Monte-Carlo values on a sampled tree (SPO-tree) or at cutpoints along a
chain (SPO-chain)."""

import jax.numpy as jnp

from credit.groups import rounding_tolerance, whiten_nonzero
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


def _chain_mask(rollouts, adv, threshold: float = 0.9, **_):
  """The probability mask on the chains; the continuations (`parent` >= 0) leave the loss."""
  kept = _kept_tokens(rollouts, threshold)
  return kept if rollouts.parent is None else kept & (rollouts.parent < 0)[..., None]


@register("spo_chain", loss_mask=_chain_mask)
def spo_chain(rollouts: Rollouts, threshold: float = 0.9, whiten: bool = True,
              eps: float = 1e-8):
  """SPO-chain (Guo et al. 2025, eq. 5 with Monte-Carlo values at cutpoints), as the
  authors' code computes it (AIFrameResearch/SPO, `_compute_token_advantages`).

  A chain (a root row, `parent` < 0) has cutpoints p_1 < ... < p_K, the positions its
  continuations were forked at (`fork`: they copied tokens[:p]); V(p) is the mean reward
  of the continuations forked at p, the chain's own outcome not among them. Token t gets
  V(p_k) − V(p_{k−1}) for the first cutpoint p_k > t, R − V(p_K) when t >= p_K, and 0
  when t < p_1 (the authors estimate no value at the prompt; a fork at p = 0 is that
  value, and then no token is before it). Then the probability mask (tokens with p >
  `threshold` under the sampling policy get 0 and leave the loss) and whitening over the
  kept chain tokens. Continuations only supply V: 0, and out of the loss (`loss_mask`).
  Needs the forks of the `tree_cutpoints` sampler (`Rollouts.parent`, `fork`). Returns
  float32 [..., G, L].
  """
  if rollouts.parent is None or rollouts.fork is None:
    raise ValueError("spo_chain needs the cutpoint forks (Rollouts.parent and Rollouts.fork, "
                     "set by the 'tree_cutpoints' sampler); these rollouts have none.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  parent = jnp.asarray(rollouts.parent, jnp.int32)
  fork = jnp.asarray(rollouts.fork, jnp.int32)
  g, length = rewards.shape[-1], rollouts.mask.shape[-1]
  cont = parent >= 0
  # V at each continuation's cutpoint: the mean reward of its chain's continuations there.
  same = (cont[..., :, None] & cont[..., None, :] & (parent[..., :, None] == parent[..., None, :])
          & (fork[..., :, None] == fork[..., None, :]))
  value = jnp.sum(jnp.where(same, rewards[..., None, :], 0.0), -1) / jnp.maximum(
      jnp.sum(same, -1), 1)
  # of[n, b]: b continues chain n. For chain n and token t, the cutpoints after t and at or
  # before it: the nearest of each (continuations at one cutpoint share V).
  of = cont[..., None, :] & (parent[..., None, :] == jnp.arange(g)[:, None])
  t = jnp.arange(length)
  after = of[..., None] & (fork[..., None, :, None] > t)  # [..., n, b, L]
  before = of[..., None] & (fork[..., None, :, None] <= t)
  nxt = jnp.argmin(jnp.where(after, fork[..., None, :, None], length + 1), axis=-2)
  prv = jnp.argmax(jnp.where(before, fork[..., None, :, None], -1), axis=-2)
  v_at = lambda idx: jnp.take_along_axis(value[..., None, :], idx, axis=-1)
  v_next = jnp.where(after.any(-2), v_at(nxt), rewards[..., None])
  adv = jnp.where(before.any(-2), v_next - v_at(prv), 0.0)
  adv = jnp.where(jnp.abs(adv) > rounding_tolerance(rewards), adv, 0.0)
  kept = _chain_mask(rollouts, adv, threshold)
  adv = jnp.where(kept, adv, 0.0)
  return whiten_nonzero(adv, kept, eps) if whiten else adv
