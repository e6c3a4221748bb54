"""Group statistics shared by the outcome-level estimators."""

import jax.numpy as jnp


def group_stats(rewards):
  """Mean and Bessel-corrected std over the group axis. [..., G] -> ([..., 1], [..., 1]).

  A group of one gets mean 0 and std 1, so GRPO passes its reward through.
  """
  g = rewards.shape[-1]
  if g == 1:
    return jnp.zeros_like(rewards), jnp.ones_like(rewards)
  return (jnp.mean(rewards, axis=-1, keepdims=True),
          jnp.std(rewards, axis=-1, ddof=1, keepdims=True))


def all_equal(rewards):
  """bool [..., 1]: every reward in the group is the same (exactly)."""
  return jnp.max(rewards, axis=-1, keepdims=True) == jnp.min(rewards, axis=-1, keepdims=True)


def to_tokens(per_response, mask):
  """Broadcasts [..., G] to the unmasked tokens [..., G, L] (0 elsewhere), float32."""
  return jnp.where(mask, per_response[..., None], 0.0).astype(jnp.float32)


def masked_whiten(x, mask, eps=1e-8):
  """(x − mean)/(std + eps) over all unmasked tokens of the batch; 0 on masked ones."""
  n = jnp.maximum(jnp.sum(mask), 1)
  mean = jnp.sum(jnp.where(mask, x, 0.0)) / n
  var = jnp.sum(jnp.where(mask, (x - mean) ** 2, 0.0)) / n
  return jnp.where(mask, (x - mean) / (jnp.sqrt(var) + eps), 0.0)
