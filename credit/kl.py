"""Per-token KL estimators between the policy and a reference (Schulman 2020).

x = log π(y_t) − log π_ref(y_t) on the sampled token; each estimator is
float32 [..., G, L], 0 on masked tokens.
"""

import jax.numpy as jnp


def kl_k1(logprobs, ref_logprobs, mask):
  """k1 = x: unbiased for KL(π‖π_ref), high variance, can be negative."""
  return jnp.where(mask, logprobs - ref_logprobs, 0.0)


def kl_k2(logprobs, ref_logprobs, mask):
  """k2 = x²/2: biased, low variance, non-negative."""
  return jnp.where(mask, 0.5 * (logprobs - ref_logprobs) ** 2, 0.0)


def kl_k3(logprobs, ref_logprobs, mask):
  """k3 = exp(−x) + x − 1: unbiased for KL(π‖π_ref), low variance, non-negative."""
  x = logprobs - ref_logprobs
  return jnp.where(mask, jnp.expm1(-x) + x, 0.0)


ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logprobs, ref_logprobs, mask, estimator: str = "k3"):
  """The named estimator ('k1', 'k2' or 'k3')."""
  if estimator not in ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(ESTIMATORS)}.")
  return ESTIMATORS[estimator](logprobs, ref_logprobs, mask)
