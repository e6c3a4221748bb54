"""Group statistics shared by the outcome-level estimators."""

import jax.numpy as jnp


def group_stats(rewards, rows=None):
  """Mean and Bessel-corrected std over the group axis. [..., G] -> ([..., 1], [..., 1]).

  A group of one gets mean 0 and std 1, so GRPO passes its reward through. `rows` (bool
  [..., G], `Rollouts.row_mask`): the statistics of each group's True rows only, a group
  of n rows as a group of size n (one row: mean 0, std 1).
  """
  g = rewards.shape[-1]
  if rows is None:
    if g == 1:
      return jnp.zeros_like(rewards), jnp.ones_like(rewards)
    return (jnp.mean(rewards, axis=-1, keepdims=True),
            jnp.std(rewards, axis=-1, ddof=1, keepdims=True))
  n = jnp.sum(rows, axis=-1, keepdims=True)
  mean = jnp.sum(jnp.where(rows, rewards, 0.0), -1, keepdims=True) / jnp.maximum(n, 1)
  var = (jnp.sum(jnp.where(rows, (rewards - mean) ** 2, 0.0), -1, keepdims=True)
         / jnp.maximum(n - 1, 1))
  several = n > 1
  return jnp.where(several, mean, 0.0), jnp.where(several, jnp.sqrt(var), 1.0)


def all_equal(rewards, rows=None):
  """bool [..., 1]: every reward in the group (of its True `rows`) is the same (exactly)."""
  if rows is None:
    return jnp.max(rewards, axis=-1, keepdims=True) == jnp.min(rewards, axis=-1, keepdims=True)
  return (jnp.max(jnp.where(rows, rewards, -jnp.inf), axis=-1, keepdims=True)
          <= jnp.min(jnp.where(rows, rewards, jnp.inf), axis=-1, keepdims=True))


def to_tokens(per_response, mask):
  """Broadcasts [..., G] to the unmasked tokens [..., G, L] (0 elsewhere), float32."""
  return jnp.where(mask, per_response[..., None], 0.0).astype(jnp.float32)


def last_tokens(mask):
  """bool [..., L]: the last True position of each row of `mask` (a run from position 0)."""
  return mask & ~jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], axis=-1)


def masked_whiten(x, mask, eps=1e-8):
  """(x − mean)/(std + eps) over all unmasked tokens of the batch; 0 on masked ones.

  Exactly 0 everywhere if the deviations x − mean are all the same on the
  unmasked tokens (as computed; so whenever every unmasked x is equal, as
  `all_equal` does for `grpo`): the output would then be one constant, which
  is only float rounding of the mean over std + eps (all returns 0.7 gave
  ±0.97). Values that differ beyond that are whitened as usual.
  """
  n = jnp.maximum(jnp.sum(mask), 1)
  mean = jnp.sum(jnp.where(mask, x, 0.0)) / n
  dev = x - mean
  var = jnp.sum(jnp.where(mask, dev ** 2, 0.0)) / n
  varies = jnp.max(jnp.where(mask, dev, -jnp.inf)) > jnp.min(jnp.where(mask, dev, jnp.inf))
  return jnp.where(mask & varies, dev / (jnp.sqrt(var) + eps), 0.0)


def whiten_nonzero(x, mask, eps=1e-8):
  """`masked_whiten`: a batch whose x is 0 on every unmasked token stays 0.

  `masked_whiten` gives exact 0 for any batch of equal values, zeros included,
  so this is the same function; kept as the name the tree and outcome
  estimators use for that guarantee.
  """
  return masked_whiten(x, mask, eps)


def loo_mean(x, rows=None):
  """mean_{j≠i} x_j over the group axis [..., G] (0 for a group of one); over the True
  `rows` only when given."""
  if rows is None:
    g = x.shape[-1]
    if g == 1:
      return jnp.zeros_like(x)
    return (jnp.sum(x, axis=-1, keepdims=True) - x) / (g - 1)
  n = jnp.sum(rows, axis=-1, keepdims=True)
  total = jnp.sum(jnp.where(rows, x, 0.0), axis=-1, keepdims=True)
  return jnp.where(n > 1, (total - x) / jnp.maximum(n - 1, 1), 0.0)


def loo_centred(rewards, rows=None):
  """R_i − mean_{j≠i} R_j over the group axis [..., G] (its True `rows` when given);
  exactly 0 for a group of one and for a group whose rewards are all equal."""
  if rows is None and rewards.shape[-1] == 1:
    return jnp.zeros_like(rewards)
  single = jnp.sum(rows, -1, keepdims=True) <= 1 if rows is not None else False
  return jnp.where(all_equal(rewards, rows) | single, 0.0, rewards - loo_mean(rewards, rows))


def rounding_tolerance(rewards, rel: float = 1e-5):
  """[..., 1, 1]: differences of node values below this are float rounding (values are
  means of rewards, so they carry errors of about 1e-7 of the rewards' scale)."""
  scale = jnp.max(jnp.abs(rewards), axis=-1, keepdims=True)[..., None]
  return rel * jnp.maximum(scale, 1e-30)
