"""FRPO: GRPO with a future-KL correction folded into the advantages."""

import jax.numpy as jnp

from credit.outcome import grpo
from credit.registry import register
from credit.returns import discounted_returns
from credit.rollouts import Rollouts


@register("frpo", needs=("logprobs", "ref_logprobs"))
def frpo(rollouts: Rollouts, beta: float = 0.01, eps: float = 1e-6):
  """FRPO: A_{i,t} = A_i^GRPO − β·Σ_{t' >= t} log(π/π_ref)(y_{t'}), the reverse
  cumulative sum of the per-token log-ratios, added after the GRPO advantage
  (in place of a KL term in the loss).

  π is the sampling policy (`old_logprobs`, else `logprobs`); `ref_logprobs`
  is required. When π = π_ref this is GRPO. Returns float32 [..., G, L].
  """
  policy = rollouts.sampling_logprobs
  if policy is None or rollouts.ref_logprobs is None:
    raise ValueError("frpo needs rollouts.logprobs (or old_logprobs) and rollouts.ref_logprobs.")
  log_ratio = jnp.where(rollouts.mask, policy - rollouts.ref_logprobs, 0.0)
  future_kl = discounted_returns(log_ratio, rollouts.mask, 1.0)
  return grpo(rollouts, eps=eps) - beta * future_kl
