"""Outcome-level estimators: one advantage per response, broadcast to its tokens."""

import math

import jax.numpy as jnp

from credit.groups import all_equal, group_stats, loo_centred, to_tokens, whiten_nonzero
from credit.registry import register
from credit.rollouts import Rollouts


@register("grpo", rows=True)
@register("dr_grpo", rows=True, scale_by_std=False)
def grpo(rollouts: Rollouts, scale_by_std: bool = True, eps: float = 1e-6):
  """GRPO (Shao et al. 2024, eq. 3): A_i = (R_i − μ)/(σ + ε), σ Bessel-corrected.

  `scale_by_std=False` is Dr. GRPO (Liu et al. 2025): A_i = R_i − μ. A group of
  one gets μ = 0, σ = 1; a group whose rewards are all equal gets exactly 0. With a
  `row_mask` each group's statistics are over its rows (groups of varying size). Returns
  float32 [..., G, L], 0 on masked tokens.
  """
  return to_tokens(grpo_per_response(rollouts.rewards, scale_by_std=scale_by_std, eps=eps,
                                     rows=rollouts.row_mask), rollouts.mask)


def grpo_per_response(rewards, scale_by_std: bool = True, eps: float = 1e-6, rows=None):
  """`grpo` before it is broadcast to tokens, float32 [..., G]: estimators that reweight it
  use this, so weights of 1 give `grpo` bit for bit. `rows`: `Rollouts.row_mask` (0 on the
  padded rows)."""
  rewards = jnp.asarray(rewards, jnp.float32)
  mean, std = group_stats(rewards, rows)
  adv = rewards - mean
  if scale_by_std:
    adv = adv / (std + eps)
  if rows is not None:
    several = jnp.sum(rows, -1, keepdims=True) > 1
    return jnp.where(rows & ~(several & all_equal(rewards, rows)), adv, 0.0)
  if rewards.shape[-1] > 1:
    adv = jnp.where(all_equal(rewards), 0.0, adv)
  return adv


@register("rloo", rows=True)
def rloo(rollouts: Rollouts):
  """RLOO (Ahmadian et al. 2024, eq. 5): A_i = R_i − mean_{j≠i} R_j = G/(G−1)·(R_i − μ).

  A group of one gets 0 (with a `row_mask`: G = the group's rows). Returns float32
  [..., G, L], 0 on masked tokens.
  """
  return to_tokens(loo_centred(jnp.asarray(rollouts.rewards, jnp.float32),
                               rollouts.row_mask), rollouts.mask)


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(rollouts: Rollouts, eps: float = 1e-8):
  """REINFORCE++-baseline (Hu et al. 2025, §3): R_i − μ_group on every token,
  then whitened over all unmasked tokens of the batch.

  A batch whose centred rewards are all 0 gets exactly 0.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  centred = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
  if rewards.shape[-1] > 1:
    centred = jnp.where(all_equal(rewards), 0.0, centred)
  else:
    centred = jnp.zeros_like(rewards)
  return whiten_nonzero(to_tokens(centred, rollouts.mask), rollouts.mask, eps)


@register("qae")
def qae(rollouts: Rollouts, quantile: float = 0.5):
  """QAE (quantile advantage estimation): A_i = R_i − b, b = the K-quantile of the
  group's rewards, K = `quantile`.

  The quantile is the smallest reward whose empirical CDF reaches K (numpy's
  'inverted_cdf'), so b is one of the rewards: with binary rewards and success
  rate p, b = 0 when p <= 1 − K (only successes get credit) and b = 1 otherwise
  (only failures do). All-equal rewards give exactly 0.
  """
  if not 0.0 <= quantile <= 1.0:
    raise ValueError(f"quantile must be in [0, 1]; got {quantile}.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  g = rewards.shape[-1]
  index = min(max(math.ceil(quantile * g) - 1, 0), g - 1)
  baseline = jnp.sort(rewards, axis=-1)[..., index:index + 1]
  return to_tokens(rewards - baseline, rollouts.mask)


@register("ngrpo")
def ngrpo(rollouts: Rollouts, max_reward: float = 1.0, eps: float = 1e-6):
  """NGRPO: GRPO with μ', σ' (Bessel) over the group plus one virtual sample of
  reward `max_reward` (the best attainable), A_i = (R_i − μ')/(σ' + ε).

  A group whose rewards all equal `max_reward` gets exactly 0; any other
  all-equal group (e.g. all wrong) gets a negative advantage, so it still learns.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  virtual = jnp.full(rewards.shape[:-1] + (1,), max_reward, jnp.float32)
  augmented = jnp.concatenate([rewards, virtual], axis=-1)
  mean, std = group_stats(augmented)
  adv = jnp.where(all_equal(augmented), 0.0, (rewards - mean) / (std + eps))
  return to_tokens(adv, rollouts.mask)


def _ratio_of_binomials(top, bottom, k: int):
  """C(top, k)/C(bottom, k) = Π_{i<k} (top − i)/(bottom − i), 0 when top < k."""
  i = jnp.arange(k, dtype=jnp.float32)
  return jnp.prod(jnp.maximum(top[..., None] - i, 0.0) / (bottom - i), axis=-1)


@register("passk")
def passk(rollouts: Rollouts, k: int = 4, threshold: float = 0.5):
  """Pass@k training (Chen et al. 2025, analytic advantages): n samples, c correct
  (R > `threshold`), ρ = 1 − C(n−c, k)/C(n, k), σ = √(ρ(1−ρ));
  A₊ = (1 − ρ)/σ for correct responses,
  A₋ = (1 − ρ − C(n−c−1, k−1)/C(n−1, k−1))/σ for incorrect ones.

  k = 1 gives (R − p)/√(p(1−p)), GRPO with the population std on binary rewards.
  Groups with c = 0 or c = n (σ = 0) get exactly 0. Needs 1 <= k <= n.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  n = rewards.shape[-1]
  if not 1 <= k <= n:
    raise ValueError(f"passk needs 1 <= k <= group size {n}; got k={k}.")
  correct = rewards > threshold
  c = jnp.sum(correct, axis=-1, dtype=jnp.float32)
  rho = 1.0 - _ratio_of_binomials(n - c, float(n), k)
  sigma = jnp.sqrt(jnp.maximum(rho * (1.0 - rho), 0.0))
  fail_all = _ratio_of_binomials(n - c - 1.0, n - 1.0, k - 1)  # C(n−c−1,k−1)/C(n−1,k−1)
  safe = jnp.where(sigma > 0, sigma, 1.0)
  a_pos, a_neg = (1.0 - rho) / safe, (1.0 - rho - fail_all) / safe
  adv = jnp.where(correct, a_pos[..., None], a_neg[..., None])
  return to_tokens(jnp.where((sigma > 0)[..., None], adv, 0.0), rollouts.mask)
