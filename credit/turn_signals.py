"""Turn credit from a per-turn signal besides the outcome: CAST's solver step counts or values
and IGPO's information gain (probe log-probs of the gold answer). `fn(turns, **hparams) ->
advantages [..., G, K]`, validated as `credit.agents`' estimators; registered (as token-level
estimators reading `rollouts.turns`) by `credit.agents`."""

import functools
import math

import jax
import jax.numpy as jnp

from credit.groups import last_tokens
from credit.turn_base import _EPS, _bucket_norm, _check_unit, _group_index, _grpo, _validated
from credit.turns import (Turns, check_state_values, check_turn_shapes, discounted_returns,
                          episode_returns)


def _per_state(turns: Turns, field: str, value, who: str, what: str):
  """float32 [..., G, K+1]: `value`, else turns.<field>; a ValueError naming both if
  neither is given or the shape is not state_ids'."""
  check_turn_shapes(turns)
  value = getattr(turns, field) if value is None else value
  if value is None:
    raise ValueError(f"{who} needs {field} [..., G, K+1] ({what}), as an argument or in "
                     f"turns.{field}.")
  elif jnp.shape(value) == jnp.shape(turns.state_ids):  # given as an argument: check values
    check_state_values(field, value, turns.turn_mask, allow_neg_inf=field == "answer_logprobs")
  value = jnp.asarray(value, jnp.float32)
  if value.shape != jnp.shape(turns.state_ids):
    raise ValueError(f"{field} must have state_ids' shape [..., G, K+1] = "
                     f"{jnp.shape(turns.state_ids)}; got {value.shape}.")
  return value


# --------------------------------------------------------------------------- CAST


CAST_SIGNALS = ("steps", "values")
CAST_OUTCOMES = ("grpo", "none")
CAST_COMPRESS = ("asinh", "none")
CAST_NORMALIZE = ("batch_rms", "none")
# CAST's first form in this project: the solver values' differences alone. With V = V^π
# (an oracle) it is the TD error, the exact turn advantage in expectation
# (`experiments/agent_credit_quality.py` scores it so).
CAST_VALUE_DIFFERENCE = dict(signal="values", outcome="none", alpha=1.0, compress="none",
                             normalize="none")


@_validated
def cast(turns: Turns, signal: str = "steps", outcome: str = "grpo", alpha: float = 0.1,
         compress: str = "asinh", normalize: str = "batch_rms", scale_by_std: bool = True,
         solver_steps=None, values_star=None, eps: float = _EPS):
  """CAST (the seed abstract's solver-value injection; the recipe of the paper's public code):

    A_k = A_outcome + α · n(c(d_k)),   d_k = N(s_k) − N(s_{k+1})   (signal 'steps')

  N(s) the solver's count of turns still needed (`turns.solver_steps`), so d_k = 1 for a
  turn that moves one step closer, 0 for one that changes nothing, −1 for one that moves
  away. c = asinh (`compress`; 'none': identity); n divides by the root mean square of c
  over every taken turn of the input batch (`normalize='batch_rms'`, 0 where all are 0;
  'none': no division); A_outcome is GRPO over the group's episode returns on every taken
  turn (`outcome='grpo'`, `scale_by_std`) or 0 ('none'); α = `alpha` (0.1 in the code).
  signal 'values': d_k = V*(s_{k+1}) − V*(s_k) of `turns.values_star` instead.
  `CAST_VALUE_DIFFERENCE` (values, no outcome, α 1, no compression or normalisation) is
  this project's first form, A_k = V*(s_{k+1}) − V*(s_k), which telescopes to
  V*(s_n) − V*(s_0); with an outcome-only reward it gives the solving move exactly 0
  and collapsed household training (README, "Multi-turn agents").
  Reading: the batch RMS spans the whole input (like `gtpo(normalize='batch')`), and α is
  applied after normalising. Returns float32 [..., G, K], 0 on untaken turns.
  """
  for name, value, valid in (("signal", signal, CAST_SIGNALS),
                             ("outcome", outcome, CAST_OUTCOMES),
                             ("compress", compress, CAST_COMPRESS),
                             ("normalize", normalize, CAST_NORMALIZE)):
    if value not in valid:
      raise ValueError(f"cast {name}={value!r}; valid: {', '.join(valid)}.")
  if not (math.isfinite(alpha) and alpha >= 0):
    raise ValueError(f"cast alpha must be finite and >= 0; got {alpha}.")
  mask = jnp.asarray(turns.turn_mask, bool)
  if signal == "steps":
    n = _per_state(turns, "solver_steps", solver_steps, "cast",
                   "the solver's turns-to-go N(s)")
    d = n[..., :-1] - n[..., 1:]
  else:
    v = _per_state(turns, "values_star", values_star, "cast", "the solver's state values")
    d = v[..., 1:] - v[..., :-1]
  d = jnp.where(mask, d, 0.0)
  if compress == "asinh":
    d = jnp.arcsinh(d)
  if normalize == "batch_rms":
    rms = jnp.sqrt(jnp.sum(d * d) / jnp.maximum(jnp.sum(mask), 1))
    # All zero: 0. A NaN (only under jit, unvalidated) stays NaN: `rms == 0` is False.
    d = jnp.where(rms == 0, 0.0, d / jnp.where(rms == 0, 1.0, rms))
  adv = alpha * d
  if outcome == "grpo":
    returns = episode_returns(turns.rewards, mask)
    base = jax.vmap(lambda r: _grpo(r, scale_by_std, eps))(
        returns.reshape(-1, returns.shape[-1])).reshape(returns.shape)
    adv = adv + base[..., None]
  return jnp.where(mask, adv, 0.0)


# --------------------------------------------------------------------------- IGPO


_IGPO_VARIANTS = ("paper", "code")


@_validated
def igpo(turns: Turns, gamma: float = 1.0, answer_logprobs=None, scale_by_std: bool = True,
         eps: float = _EPS, variant: str = "paper"):
  """IGPO (Wang et al. 2025): information-gain turn rewards, group-normalised, discounted.

  p_k = exp(answer_logprobs_k), the policy's (length-normalised, i.e. geometric-mean
  per-token) probability of the gold answer given the history before turn k, from
  probe forward passes (default `turns.answer_logprobs`, [..., G, K+1]).
  Turn reward: r_k = p_{k+1} − p_k (the information gain of turn k) on every taken
  turn but the last, whose reward is the outcome instead; the environment's own
  turn rewards are added throughout (0 except the outcome for outcome-only tasks).
  The rewards of all taken turns of the group are z-normalised together (mean and
  Bessel std over the Σ n_g turns, ε; one turn in all, or all equal, gives 0), and
  a turn's advantage is the discounted sum of the normalised rewards from it on,
  A_k = Σ_{j≥k} γ^{j−k} r̃_j. Outcome counterpart (tested): with one turn per
  trajectory it is GRPO. Returns float32 [..., G, K], 0 on untaken turns.

  `variant='code'` is the authors' released code (GuoqingWang1/IGPO @bff163b,
  `core_algos.compute_grpo_outcome_advantage` with `adv_estimator=grpo`; docs/conventions.md):
  raw rewards (gains p_{k+1} − p_k, the outcome on the last turn), A_k = R_k − (1/G)
  Σ_g' R_{g',k} with R_k = Σ_{j≥k} γ^{j−k} r_j (untaken turns 0), no std division. The
  authors' baseline is per token position; this one is per turn index, equal when turns span
  the same positions across the group. `scale_by_std` and `eps` do not apply.
  """
  if variant not in _IGPO_VARIANTS:
    raise ValueError(f"igpo variant={variant!r}; valid: {', '.join(_IGPO_VARIANTS)}.")
  _check_unit("gamma", gamma)
  answer_logprobs = _per_state(turns, "answer_logprobs", answer_logprobs, "igpo",
                               "probe log-probs of the gold answer")
  if variant == "code":
    return _igpo_code(jnp.asarray(turns.rewards, jnp.float32),
                      jnp.asarray(turns.turn_mask, bool), answer_logprobs,
                      jnp.asarray(gamma, jnp.float32))
  return _igpo(jnp.asarray(turns.rewards, jnp.float32), jnp.asarray(turns.turn_mask, bool),
               answer_logprobs, jnp.asarray(gamma, jnp.float32), jnp.asarray(eps, jnp.float32),
               bool(scale_by_std))


def _igpo_rewards(rewards, mask, answer_logprobs):
  """Turn k's raw reward: its environment reward plus the gain p_{k+1} − p_k of the gold
  answer's probability (none on a trajectory's last turn)."""
  p = jnp.exp(answer_logprobs)
  return rewards + jnp.where(last_tokens(mask), 0.0, p[..., 1:] - p[..., :-1])


@functools.partial(jax.jit, static_argnums=(5,))
def _igpo(rewards, mask, answer_logprobs, gamma, eps, scale_by_std):
  reward = _igpo_rewards(rewards, mask, answer_logprobs)
  groups, group = _group_index(mask.shape)
  norm = _bucket_norm(reward.reshape(-1), group.reshape(-1), mask.reshape(-1), groups,
                      scale_by_std, eps)
  return discounted_returns(norm.reshape(mask.shape), mask, gamma)


@jax.jit
def _igpo_code(rewards, mask, answer_logprobs, gamma):
  """igpo(variant='code'): raw rewards, returns-to-go, minus the group's per-turn-index
  mean of the returns (untaken turns count 0 in it); no std division."""
  reward = jnp.where(mask, _igpo_rewards(rewards, mask, answer_logprobs), 0.0)
  returns = jnp.where(mask, discounted_returns(reward, mask, gamma), 0.0)
  return jnp.where(mask, returns - jnp.mean(returns, axis=-2, keepdims=True), 0.0)
