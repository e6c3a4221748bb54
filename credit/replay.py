"""Replay credit (issue 23's off-policy family): R³ (#73) and AVATAR's replay (#34); offline
reward-weighted fine-tuning (#203); ADHint's hinted groups (#94).

The loop does the replaying (`experiments/training/replay.py`): with `needs=('replay',)` it
keeps each pool prompt's newest successful response and puts it in place of the last
response of a group whose responses all failed, with the log-probabilities it was sampled
with; with `'replay_failures'` too, it keeps the newest failure and puts it into groups that
all succeeded. The estimator then sees a group with signal where GRPO's would be all zero.
"""

import math

import jax.numpy as jnp

from credit.outcome import grpo
from credit.registry import register
from credit.rollouts import Rollouts
from credit.turn_base import _bucket_norm
from trees.step_graph import map_groups


@register("r3", needs=("replay",))
def r3(rollouts: Rollouts, success: float = 1.0, replay_logprobs: str = "behaviour",
       scale_by_std: bool = True, eps: float = 1e-6):
  """R³ (#73): GRPO over groups into which the loop replayed a stored success of the same
  prompt when none of their responses reached `success` (the loop reads `success` and
  `replay_logprobs`: 'behaviour' keeps the replayed response's sampling log-probs as its
  old log-probs, so the clipped ratio π_θ/π_behaviour corrects for its age; 'current'
  treats it as on-policy). The advantage is GRPO's on the batch as trained. Readings: the
  abstract's reflection step and its entropy-ranking reward for failures are not part of
  this estimator; one replayed response per all-fail group, the prompt's newest success.
  Returns float32 [..., G, L].
  """
  if replay_logprobs not in ("behaviour", "current"):
    raise ValueError(f"r3 replay_logprobs must be 'behaviour' or 'current'; got "
                     f"{replay_logprobs!r}.")
  del success  # read by the loop
  return grpo(rollouts, scale_by_std=scale_by_std, eps=eps)


def tas_weights(mask, tas: float = 1.0):
  """AVATAR's Temporal Advantage Shaping weights (#34), [..., L] float32.

  The abstract says TAS "upweights key reasoning phases"; the paper's project page names
  them: early (planning) and late (synthesis). Read as a U over the response: the k-th of a
  response's n tokens (those on `mask`, in order; u = k / (n − 1), 0 when n = 1) gets
  w = 1 + tas · (2u − 1)², rescaled so the weights average 1 over the response. So the first
  and last tokens weigh (1 + tas) times the middle one, and a response's summed advantage is
  unchanged (TAS moves credit within a response, it does not scale the step). tas = 0: all
  ones. 0 off `mask`.
  """
  tas = float(tas)
  if not math.isfinite(tas) or tas < 0:
    raise ValueError(f"tas (Temporal Advantage Shaping strength) must be finite and >= 0; "
                     f"got {tas}.")
  m = jnp.asarray(mask, bool)
  mf = m.astype(jnp.float32)
  n = jnp.sum(mf, -1, keepdims=True)
  k = jnp.cumsum(mf, -1) - mf
  u = k / jnp.maximum(n - 1.0, 1.0)
  w = jnp.where(m, 1.0 + tas * (2.0 * u - 1.0) ** 2, 0.0)
  return w * n / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1e-30)


@register("tas")
def tas(rollouts: Rollouts, tas: float = 1.0, scale_by_std: bool = True, eps: float = 1e-6):
  """Temporal Advantage Shaping alone (AVATAR #34, no replay): GRPO's advantage times
  `tas_weights` (the U over each response that upweights its first and last tokens, mean 1
  over the response). tas = 0 is GRPO. Returns float32 [..., G, L].
  """
  return grpo(rollouts, scale_by_std=scale_by_std, eps=eps) * tas_weights(rollouts.mask, tas)


@register("avatar", needs=("replay", "replay_failures"))
def avatar(rollouts: Rollouts, success: float = 1.0, replay_logprobs: str = "behaviour",
           tas: float = 1.0, scale_by_std: bool = True, eps: float = 1e-6):
  """AVATAR (#34): off-policy replay and Temporal Advantage Shaping. The replay, "reusing
  past experiences with greater reward diversity" to resolve vanishing advantages, is read
  as two-sided: a group whose responses all failed gets the prompt's newest stored success
  (as `r3`), and a group whose responses all succeeded gets its newest stored failure, each
  with its behaviour log-probs (the loop reads `success`, `replay_logprobs`). The advantage
  is GRPO's on the batch as trained, times `tas_weights` (tas = 0: the replay alone). Not
  built: the paper's difficulty tiers of the buffer and its hints. Returns float32
  [..., G, L].
  """
  return r3(rollouts, success=success, replay_logprobs=replay_logprobs,
            scale_by_std=scale_by_std, eps=eps) * tas_weights(rollouts.mask, tas)


@register("rwft")
def rwft(rollouts: Rollouts, baseline: float = 0.0):
  """Offline reward-weighted fine-tuning (#203): offline RL recast as SFT on stored rollouts,
  each weighted by its reward: A_i = R_i − b on every token (b = `baseline`, 0 in the
  paper's recipe; with 0/1 rewards, SFT on the successes). Run it with the no-ratio loss
  (`rgra`: −A·log π, weighted NLL) and the lagged sampler with `sampler.lag` >= the run's
  steps, so every rollout comes from the frozen warm start: a fixed offline dataset's
  distribution, drawn as training goes (`configs/replay.py:offline`). Returns float32
  [..., G, L], 0 on masked tokens.
  """
  r = jnp.asarray(rollouts.rewards, jnp.float32) - baseline
  return jnp.where(rollouts.mask, r[..., None], 0.0)


@register("adhint")
def adhint(rollouts: Rollouts, scale_by_std: bool = True, eps: float = 1e-6):
  """ADHint (#94) on the 'hinted' sampler's groups (experiments/training/hints.py: the first
  `hint_rows` responses of a group continue a prefix of the reference, its length from the
  prompt's difficulty prior, `hint_schedule = 'difficulty'`). Advantage estimation with the
  rollout-difficulty posterior, read as separate baselines: a hinted response is compared
  with the group's other hinted ones, an unhinted one with the unhinted ones, each subset
  normalised by its own mean and std (a subset of one, or of equal rewards: 0); so a hint
  that makes success easy does not drown the unhinted responses' signal, and vice versa.
  Hint tokens get no gradient (they are off `policy_mask`: the "selective masking for hint
  preservation"; the consistency-based modulation is not built). A response is hinted
  where its first token is off `policy_mask`; without a policy mask every response is
  unhinted and this is GRPO over the group (groups of two or more). Returns float32
  [..., G, L].
  """
  mask = jnp.asarray(rollouts.mask, bool)
  hinted = (jnp.zeros(mask.shape[:-1], bool) if rollouts.policy_mask is None
            else mask[..., 0] & ~jnp.asarray(rollouts.policy_mask, bool)[..., 0])
  r = jnp.asarray(rollouts.rewards, jnp.float32)
  one = lambda x, b: _bucket_norm(x, b, jnp.ones_like(b, bool), 2, bool(scale_by_std),
                                  float(eps))
  adv = map_groups(one, r.shape[:-1], r, hinted.astype(jnp.int32))
  return jnp.where(mask, adv[..., None], 0.0)
