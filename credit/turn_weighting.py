"""Turn confidence and turn weighting for multi-turn agents (issue 23's turn family).

`taura` and `copo_turns` rescale a trajectory's outcome advantage turn by turn with the
policy's uncertainty (`rollouts.entropy`) or confidence (`rollouts.logprobs`) on each turn,
averaged over the turn's action tokens (`rollouts.turns.token_turn`); the loop computes the
entropy with a teacher-forced pass when an estimator needs it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from credit.outcome import grpo_per_response
from credit.registry import register
from credit.rollouts import Rollouts
from credit.turns import validate_turns


def _turn_weighted(rollouts: Rollouts, signal, w_min: float, w_max: float, eps: float, who,
                   what):
  """GRPO of the trajectory's return x clip(s_{i,k} / s̄_i, w_min, w_max) on turn k's action
  tokens: s_{i,k} the mean of `signal` [..., G, L] over the turn's action tokens, s̄_i its
  mean over the trajectory's turns with action tokens (s̄ <= eps: weights 1)."""
  if not 0 <= w_min <= 1 <= w_max:
    raise ValueError(f"{who} needs 0 <= w_min <= 1 <= w_max; got {w_min}, {w_max}.")
  turns = rollouts.turns
  if turns is None or turns.token_turn is None:
    raise ValueError(f"{who} needs rollouts.turns with token_turn (multi-turn trajectories).")
  validate_turns(turns, rollouts)
  k = turns.num_turns
  token_turn = jnp.asarray(turns.token_turn, jnp.int32)
  on = (token_turn >= 0) & jnp.asarray(rollouts.mask, bool)
  if not isinstance(signal, jax.core.Tracer):
    bad = ~np.isfinite(np.asarray(signal, np.float32)) & np.asarray(on)
    if bad.any():
      raise ValueError(f"{who}: {what} is not finite at "
                       f"{list(int(i) for i in np.argwhere(bad)[0])} (an action token).")
  x = jnp.where(on, jnp.asarray(signal, jnp.float32), 0.0)
  onehot = jax.nn.one_hot(jnp.where(on, token_turn, k), k + 1, dtype=jnp.float32)[..., :k]
  count = jnp.sum(onehot, -2)  # [..., G, K] action tokens per turn
  h = jnp.sum(onehot * x[..., None], -2) / jnp.maximum(count, 1.0)
  has = count > 0
  h_bar = jnp.sum(jnp.where(has, h, 0.0), -1) / jnp.maximum(jnp.sum(has, -1), 1)
  # s̄ <= eps: weights 1. A NaN (only under jit) stays NaN: `NaN <= eps` is False.
  low = (h_bar <= eps)[..., None]
  w = jnp.clip(jnp.where(low, 1.0, h / jnp.where(low, 1.0, h_bar[..., None])), w_min, w_max)
  per_token = jnp.take_along_axis(w, jnp.clip(token_turn, 0, k - 1), -1)
  adv = grpo_per_response(jnp.asarray(rollouts.rewards, jnp.float32), eps=eps)
  return jnp.where(on, adv[..., None] * per_token, 0.0)


@register("taura", needs=("turns", "entropy"))
def taura(rollouts: Rollouts, w_min: float = 0.5, w_max: float = 2.0, eps: float = 1e-6):
  """TAURA (#45, Turn-aware Adaptive Uncertainty Rescaled Advantage), our reading of the
  abstract ("turn-level entropy steers credit toward pivotal discovery turns"):

    A_{i,t} = A_i · clip(H_{i,k} / H̄_i, w_min, w_max),   k the turn of token t,

  A_i the GRPO advantage of trajectory i's return (`rollouts.rewards`), H_{i,k} the mean
  token entropy of turn k's action tokens (`rollouts.entropy`, `turns.token_turn`), H̄_i
  its mean over the trajectory's turns with action tokens: uncertain (high-entropy) turns
  carry more of the trajectory's credit, confident ones less, about the same total before
  clipping. H̄_i = 0 (a certain policy) gives weights 1. Outcome counterpart (tested):
  equal turn entropies give GRPO. Returns float32 [..., G, L], 0 off the action tokens.
  """
  if rollouts.entropy is None:
    raise ValueError("taura needs rollouts.entropy (per-token policy entropy; the loop "
                     "computes it when the estimator needs ('entropy',)).")
  return _turn_weighted(rollouts, rollouts.entropy, w_min, w_max, eps, "taura",
                        "rollouts.entropy")


@register("copo_turns", needs=("turns", "logprobs"))
def copo_turns(rollouts: Rollouts, w_min: float = 0.5, w_max: float = 2.0, eps: float = 1e-6):
  """CoPO (#43, CogRouter's Cognition-aware Policy Optimization), our reading of a vague
  abstract ("step-level credit assignment via confidence-aware advantage reweighting"; the
  confidence of the resulting action): TAURA's form with the turn's confidence in place of
  its entropy, c_{i,k} = exp(mean log π of turn k's action tokens) (`rollouts.logprobs`,
  the sampling policy's), A_{i,t} = A_i · clip(c_{i,k} / c̄_i, w_min, w_max): confident
  actions carry more of their trajectory's credit. Registered as `copo_turns` (`copo` is
  #112's). Equal turn confidences give GRPO. Returns float32 [..., G, L].
  """
  lp = rollouts.sampling_logprobs
  if lp is None:
    raise ValueError("copo_turns needs rollouts.logprobs (the sampled tokens' log-probs).")
  turns = rollouts.turns
  if turns is None or turns.token_turn is None:
    raise ValueError("copo_turns needs rollouts.turns with token_turn (multi-turn trajectories).")
  # The turn's geometric-mean probability: the turn's mean log-prob first, then exp.
  k = turns.num_turns
  token_turn = jnp.asarray(turns.token_turn, jnp.int32)
  on = (token_turn >= 0) & jnp.asarray(rollouts.mask, bool)
  lpf = jnp.where(on, jnp.asarray(lp, jnp.float32), 0.0)
  onehot = jax.nn.one_hot(jnp.where(on, token_turn, k), k + 1, dtype=jnp.float32)[..., :k]
  mean_lp = jnp.sum(onehot * lpf[..., None], -2) / jnp.maximum(jnp.sum(onehot, -2), 1.0)
  conf = jnp.exp(jnp.take_along_axis(mean_lp, jnp.clip(token_turn, 0, k - 1), -1))
  return _turn_weighted(rollouts, jnp.where(on, conf, 0.0), w_min, w_max, eps, "copo_turns",
                        "the turn confidence (exp of rollouts.logprobs)")
