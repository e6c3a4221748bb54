"""Host-side checks of a `Rollouts` batch, with errors that name the problem."""

import jax.numpy as jnp
import numpy as np

from credit.rollouts import Rollouts
from trees.prefix_tree import check_tokens_and_mask

_PER_TOKEN = ("logprobs", "old_logprobs", "ref_logprobs", "token_rewards", "values")


def validate(rollouts: Rollouts) -> Rollouts:
  """Raises ValueError on malformed rollouts; returns them unchanged otherwise.

  Checks: tokens are integers and mask boolean, of one shape [..., G, L]
  with G > 0; the mask is one run from position 0; rewards are [..., G] and
  finite; optional per-token fields have the tokens' shape and are finite on
  unmasked tokens. Call it outside jit (it reads values).
  """
  tokens, mask = jnp.asarray(rollouts.tokens), jnp.asarray(rollouts.mask)
  check_tokens_and_mask(tokens, mask)
  rewards = np.asarray(rollouts.rewards)
  if rewards.shape != tokens.shape[:-1]:
    raise ValueError(f"rewards must be [..., G] = {tokens.shape[:-1]} to match tokens "
                     f"{tokens.shape}; got {rewards.shape}.")
  if not np.issubdtype(rewards.dtype, np.number) or np.issubdtype(rewards.dtype, np.complexfloating):
    raise ValueError(f"rewards must be real numbers; got dtype {rewards.dtype}.")
  if not np.all(np.isfinite(rewards)):
    bad = tuple(int(i) for i in np.argwhere(~np.isfinite(rewards))[0])
    raise ValueError(f"rewards must be finite; rewards{list(bad)} = {rewards[bad]}.")
  for name in _PER_TOKEN:
    value = getattr(rollouts, name)
    if value is None:
      continue
    value = np.asarray(value)
    if value.shape != tokens.shape:
      raise ValueError(f"{name} must have the tokens' shape {tokens.shape}; got {value.shape}.")
    if not np.all(np.isfinite(value) | ~np.asarray(mask)):
      raise ValueError(f"{name} has non-finite values on unmasked tokens.")
  return rollouts
