"""Sequential returns for per-token rewards, as masked reverse linear scans.

All arrays are [..., L] along the token axis (any leading dims, e.g. [B, G, L]);
the mask is a run from position 0 and the episode ends after its last token.
Every recurrence y_t = x_t + a_t·y_{t+1} is an associative scan (O(log L) depth).
"""

import jax
import jax.numpy as jnp

from credit.groups import last_tokens, masked_whiten
from credit.kl import kl_penalty
from credit.registry import register
from credit.rollouts import Rollouts


def reverse_linear_scan(x, a):
  """y_t = x_t + a_t·y_{t+1} along the last axis, with y_L = 0."""

  def compose(later, current):  # current ∘ later, as (scale, offset) of y_{t+1}.
    a_l, x_l = later
    a_c, x_c = current
    return a_c * a_l, x_c + a_c * x_l

  x, a = jnp.broadcast_arrays(x, a)
  return jax.lax.associative_scan(compose, (a, x), reverse=True, axis=x.ndim - 1)[1]


def discounted_returns(rewards, mask, gamma: float):
  """G_t = Σ_{k≥t} γ^{k−t} r_k over the unmasked tokens; 0 on masked ones."""
  m = mask.astype(jnp.float32)
  return reverse_linear_scan(rewards * m, gamma * m)


def gae_advantages(rewards, values, mask, gamma: float, lam: float):
  """GAE(γ, λ) (Schulman et al. 2016, eq. 16): A_t = Σ_k (γλ)^k δ_{t+k},
  δ_t = r_t + γ·V_{t+1} − V_t, with V = 0 after the last token."""
  m = mask.astype(jnp.float32)
  values = values * m
  next_values = jnp.concatenate([values[..., 1:], jnp.zeros_like(values[..., :1])], axis=-1)
  deltas = (rewards + gamma * next_values - values) * m
  return reverse_linear_scan(deltas, gamma * lam * m)


def td_lambda_returns(rewards, values, mask, gamma: float, lam: float):
  """TD(λ) returns G^λ_t = r_t + γ[(1 − λ)·V_{t+1} + λ·G^λ_{t+1}] (Sutton & Barto eq. 12.18),
  which equal A^GAE_t + V_t; 0 on masked tokens."""
  return jnp.where(mask, gae_advantages(rewards, values, mask, gamma, lam) + values, 0.0)


def outcome_token_rewards(rollouts: Rollouts):
  """Per-token rewards: `token_rewards` (0 if None) plus the outcome reward on the
  last unmasked token. float32 [..., G, L]."""
  mask = rollouts.mask
  last = last_tokens(mask)
  rewards = jnp.where(last, jnp.asarray(rollouts.rewards, jnp.float32)[..., None], 0.0)
  if rollouts.token_rewards is not None:
    rewards = rewards + jnp.where(mask, rollouts.token_rewards, 0.0)
  return rewards


@register("returns")
def returns(rollouts: Rollouts, gamma: float = 1.0):
  """REINFORCE credit (Williams 1992): A_t = discounted return-to-go of the
  per-token rewards plus the outcome reward at the end (no baseline)."""
  return discounted_returns(outcome_token_rewards(rollouts), rollouts.mask, gamma)


def _gae(rollouts: Rollouts, gamma: float = 1.0, lam: float = 0.95, whiten: bool = False,
         eps: float = 1e-8):
  """PPO's GAE(γ, λ) advantages (Schulman et al. 2016) from `rollouts.values`
  (critic V(s_t) before each token) and per-token plus outcome rewards. `whiten`: then
  whitened over every unmasked token of the batch (`masked_whiten`), as verl's
  `compute_gae_advantage_return` does (see docs/conventions.md for the small differences);
  the loop's critic targets are the unwhitened A + V. The loop fills `values` from its
  critic (`experiments/training/critic.py`)."""
  if rollouts.values is None:
    raise ValueError("gae needs rollouts.values (critic values per token).")
  adv = gae_advantages(outcome_token_rewards(rollouts), rollouts.values, rollouts.mask,
                       gamma, lam)
  return masked_whiten(adv, rollouts.mask, eps) if whiten else adv


gae = register("gae", needs=("values",))(_gae)
# PPO as verl runs it (`algorithm.adv_estimator=gae`, its defaults γ = λ = 1, advantages
# whitened over the batch); the loop's critic fills `values` (experiments/training/critic.py).
ppo = register("ppo", needs=("values",), gamma=1.0, lam=1.0, whiten=True)(_gae)


@register("reinforce_pp")
def reinforce_pp(rollouts: Rollouts, kl_coef: float = 0.01, kl_estimator: str = "k1",
                 gamma: float = 1.0, eps: float = 1e-8):
  """REINFORCE++ (Hu et al. 2025, eqs. 5–7): r_t = −β·KL_t (+ R at the last
  token), returns-to-go, whitened over all unmasked tokens of the batch.

  KL_t compares the sampling policy (`old_logprobs`, else `logprobs`) with
  `ref_logprobs`; without `ref_logprobs` there is no KL term.
  """
  rewards = outcome_token_rewards(rollouts)
  policy = rollouts.sampling_logprobs
  if rollouts.ref_logprobs is not None and policy is not None:
    rewards = rewards - kl_coef * kl_penalty(policy, rollouts.ref_logprobs, rollouts.mask,
                                             kl_estimator)
  ret = discounted_returns(rewards, rollouts.mask, gamma)
  return masked_whiten(ret, rollouts.mask, eps)
