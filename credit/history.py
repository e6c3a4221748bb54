"""Per-prompt history for stateful estimators: prompts that recur (a fixed pool) are read
through `Rollouts.prompt_ids`, each group's index in the pool."""

import jax
import jax.numpy as jnp
import numpy as np

from credit.rollouts import Rollouts


def pool_ids(rollouts: Rollouts, pool: int, name: str) -> jax.Array:
  """int32 [...]: `rollouts.prompt_ids`, checked against a state kept for a pool of `pool`
  prompts (the groups' leading shape; in [0, pool) when the values are concrete)."""
  if rollouts.prompt_ids is None:
    raise ValueError(f"{name}'s state keeps a history per prompt of a pool of {pool}; it "
                     f"needs Rollouts.prompt_ids (each group's index in the pool).")
  ids = rollouts.prompt_ids
  lead = jnp.shape(rollouts.rewards)[:-1]
  if jnp.shape(ids) != lead or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError(f"prompt_ids must be integers [...] = {lead}, one per group; got "
                     f"{jnp.result_type(ids)} {jnp.shape(ids)}.")
  if not isinstance(ids, jax.core.Tracer):
    bad = (np.asarray(ids) < 0) | (np.asarray(ids) >= pool)
    if bad.any():
      raise ValueError(f"prompt_ids must lie in [0, {pool}) (the pool {name}'s state was "
                       f"made for); got {np.asarray(ids)[bad].ravel()[:5].tolist()}.")
  return jnp.asarray(ids, jnp.int32)


def per_prompt_mean(ids, values, pool: int):
  """(mean [pool], seen bool [pool]): the mean of `values` [...] over the groups of each
  prompt id (a prompt drawn twice in one batch pools its groups)."""
  ids, values = jnp.ravel(ids), jnp.ravel(values)
  total = jnp.zeros((pool,), jnp.float32).at[ids].add(values)
  count = jnp.zeros((pool,), jnp.float32).at[ids].add(1.0)
  return total / jnp.maximum(count, 1.0), count > 0
