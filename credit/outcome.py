"""Outcome-level estimators: one advantage per response, broadcast to its tokens."""

import jax.numpy as jnp

from credit.groups import all_equal, group_stats, masked_whiten, to_tokens
from credit.registry import register
from credit.rollouts import Rollouts


@register("grpo")
@register("dr_grpo", scale_by_std=False)
def grpo(rollouts: Rollouts, scale_by_std: bool = True, eps: float = 1e-6):
  """GRPO (Shao et al. 2024, eq. 3): A_i = (R_i − μ)/(σ + ε), σ Bessel-corrected.

  `scale_by_std=False` is Dr. GRPO (Liu et al. 2025): A_i = R_i − μ. A group of
  one gets μ = 0, σ = 1; a group whose rewards are all equal gets exactly 0.
  Returns float32 [..., G, L], 0 on masked tokens.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  mean, std = group_stats(rewards)
  adv = rewards - mean
  if scale_by_std:
    adv = adv / (std + eps)
  if rewards.shape[-1] > 1:
    adv = jnp.where(all_equal(rewards), 0.0, adv)
  return to_tokens(adv, rollouts.mask)


@register("rloo")
def rloo(rollouts: Rollouts):
  """RLOO (Ahmadian et al. 2024, eq. 5): A_i = R_i − mean_{j≠i} R_j = G/(G−1)·(R_i − μ).

  A group of one gets 0. Returns float32 [..., G, L], 0 on masked tokens.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  g = rewards.shape[-1]
  if g == 1:
    return to_tokens(jnp.zeros_like(rewards), rollouts.mask)
  others = (jnp.sum(rewards, axis=-1, keepdims=True) - rewards) / (g - 1)
  return to_tokens(jnp.where(all_equal(rewards), 0.0, rewards - others), rollouts.mask)


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
  tokens = to_tokens(centred, rollouts.mask)
  return jnp.where(jnp.all(tokens == 0), 0.0, masked_whiten(tokens, rollouts.mask, eps))
