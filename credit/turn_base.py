"""Shared pieces of the turn-credit estimators (`credit.agents` and the issue-23 families built
on turns: `turn_signals`, `milestones`, `turn_norm`, `tool_credit`, `expert_traces`,
`hindsight`, `replay`): group normalisations, the per-group vmap with static hyperparameters,
input validation, the token spreading wrapper and the registry adapter that reads
`rollouts.turns`."""

import functools
import inspect
import math

import jax
import jax.numpy as jnp

from credit.turns import Turns, check_turn_shapes, turn_to_tokens, validate_turns
from trees.step_graph import map_groups

_EPS = 1e-6


def _gather(values, index, fill=0.0):
  """values[index], `fill` where index < 0 (one group)."""
  n = values.shape[0]
  return jnp.where(index >= 0, values[jnp.clip(index, 0, n - 1)], fill)


def _weighted_norm(x, w, scale_by_std: bool, eps: float, tol=0.0):
  """GRPO normalisation of x [M] where each entry counts w [M] times (w = 0: absent).

  μ = Σ w x / Σ w, σ Bessel-corrected over the Σ w rows. All present x equal
  (max − min <= tol) with more than one row -> exactly 0. One row in all gives
  μ = 0, σ = 1 (GRPO's group of one).
  """
  w = w.astype(jnp.float32)
  total = jnp.sum(w)
  mean = jnp.sum(w * x) / jnp.maximum(total, 1.0)
  var = jnp.sum(w * (x - mean) ** 2) / jnp.maximum(total - 1.0, 1.0)
  one = total <= 1.0
  adv = x - jnp.where(one, 0.0, mean)
  if scale_by_std:
    adv = adv / (jnp.where(one, 1.0, jnp.sqrt(var)) + eps)
  present = w > 0
  spread = jnp.max(jnp.where(present, x, -jnp.inf)) - jnp.min(jnp.where(present, x, jnp.inf))
  equal = spread <= tol
  return jnp.where(present & ~(equal & ~one), adv, 0.0)


def _grpo(returns, scale_by_std=True, eps=_EPS):
  """GRPO (Shao et al. 2024, eq. 3) over a group's episode returns [G] (as `credit.grpo`)."""
  return _weighted_norm(returns, jnp.ones_like(returns), scale_by_std, eps)


def _bucket_norm(x, bucket, valid, num_buckets, scale_by_std, eps, ddof=1):
  """x − mean of its bucket (/ (std + eps)) over entries with the same bucket id.

  x, bucket, valid: [M]. Buckets of one and buckets whose x are all equal give
  exactly 0 (GiGPO's step groups). std is Bessel-corrected for ddof=1. A non-finite x
  (possible only under jit, where inputs are not validated) makes its bucket NaN, a bucket
  of one included, never 0 (`~(hi <= lo)`: NaN compares False).
  """
  seg = jnp.where(valid, bucket, num_buckets)
  red = lambda op, v, ident: op(jnp.where(valid, v, ident), seg, num_segments=num_buckets + 1)
  count = red(jax.ops.segment_sum, jnp.ones_like(x), 0.0)
  mean = red(jax.ops.segment_sum, x, 0.0) / jnp.maximum(count, 1.0)
  dev = x - mean[seg]
  var = red(jax.ops.segment_sum, dev ** 2, 0.0) / jnp.maximum(count - ddof, 1.0)
  lo, hi = red(jax.ops.segment_min, x, jnp.inf), red(jax.ops.segment_max, x, -jnp.inf)
  adv = dev / (jnp.sqrt(var[seg]) + eps) if scale_by_std else dev
  adv = jnp.where(valid & (count[seg] > 1) & ~(hi[seg] <= lo[seg]), adv, 0.0)
  return jnp.where(valid & ~jnp.isfinite(x), jnp.nan, adv)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(fn, static, state_ids, rewards, turn_mask, success, params):
  """fn(state_ids, rewards, turn_mask, success, *params, **static) for one group,
  vmapped over the leading dims (jitted once per fn, static hparams and shapes)."""
  one = lambda s, r, m, ok: fn(s, r, m, ok, *params, **dict(static))
  return map_groups(one, state_ids.shape[:-2], state_ids, rewards, turn_mask, success)


def _lift(fn, turns: Turns, params=(), **static):
  """`_run` on the turns' arrays; params are traced, static hparams are hashable."""
  check_turn_shapes(turns)
  return _run(fn, tuple(sorted(static.items())), jnp.asarray(turns.state_ids),
              jnp.asarray(turns.rewards, jnp.float32), jnp.asarray(turns.turn_mask, bool),
              None if turns.success is None else jnp.asarray(turns.success, bool),
              tuple(jnp.asarray(p, jnp.float32) for p in params))


def _validated(fn):
  """fn(turns, **hp) after `validate_turns(turns)` (values checked when concrete, so a NaN
  reward or a broken turn_mask raises instead of giving numbers); `fn.__wrapped__` skips it
  (the token wrappers validate once, tokens included)."""

  @functools.wraps(fn)
  def estimator(turns: Turns, *args, **hparams):
    return fn(validate_turns(turns), *args, **hparams)

  return estimator


def _check_unit(name, value, closed_low=True):
  if isinstance(value, jax.core.Tracer):  # traced hyperparameters are taken as they are
    return
  if not ((0.0 <= value if closed_low else 0.0 < value) and value <= 1.0):
    raise ValueError(f"{name} must be in {'[' if closed_low else '('}0, 1]; got {value}.")


def _group_index(shape):
  """(number of groups, int32 [..., G, K]: the flat index of each entry's group over the
  leading dims)."""
  *batch, g, k = shape
  groups = math.prod(batch)
  return groups, jnp.broadcast_to(jnp.arange(groups)[:, None, None], (groups, g, k)).reshape(shape)


def _token_level(fn):
  @functools.wraps(fn)
  def tokens(rollouts, turns: Turns, **hparams):
    if turns.token_turn is None:
      raise ValueError(f"{fn.__name__}_tokens needs turns.token_turn [..., G, L].")
    if jnp.shape(turns.token_turn) != jnp.shape(rollouts.mask):
      raise ValueError(f"turns.token_turn {jnp.shape(turns.token_turn)} must have the "
                       f"tokens' shape {jnp.shape(rollouts.mask)}.")
    validate_turns(turns, rollouts)
    adv = turn_to_tokens(fn.__wrapped__(turns, **hparams), turns.token_turn)
    return jnp.where(rollouts.mask, adv, 0.0)

  tokens.__name__ = f"{fn.__name__}_tokens"
  tokens.__doc__ = (f"`{fn.__name__}` spread over tokens: (rollouts, turns, **hparams) -> "
                    f"float32 [..., G, L], 0 where token_turn < 0 or mask is False.\n\n"
                    f"{fn.__doc__}")
  return tokens


def _from_rollouts(name, fn):
  def estimator(rollouts, **hparams):
    if rollouts.turns is None:
      raise ValueError(f"credit estimator {name!r} needs rollouts.turns (a credit.turns.Turns "
                       f"of multi-turn trajectories); got None.")
    return fn(rollouts, rollouts.turns, **hparams)

  turn_doc = inspect.getdoc(inspect.unwrap(fn)) or ''  # the turn function's, then the wrapper's
  estimator.__name__, estimator.__doc__ = name, f'{turn_doc}\n\n{inspect.getdoc(fn) or ""}'
  # The signature callers see (`credit.hparam_names`): rollouts, then the turn function's
  # hyperparameters (`fn` is a token wrapper whose signature follows __wrapped__ to it).
  turn_params = list(inspect.signature(fn).parameters.values())[1:]
  estimator.__signature__ = inspect.Signature(
      [inspect.Parameter("rollouts", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + turn_params)
  return estimator
