"""Progress advantage as a scorer (#52), the paper's uses of x_t = log π_θ(y_t) − log π_ref(y_t)
(π_θ RL-trained, π_ref its reference): step scores, trajectory scores for best-of-N selection
and uncertainty, and the step a failure is attributed to, read from the authors' released
code (deeplearning-wisc/progress-advantage: `pa/aggregations.py`, `runners/tau2_bon.py`,
`runners/fa.py`). The training bonus `progress_advantage` is the project's use, not theirs.

Steps close at `step_ends` (inclusive); the tokens after the last end form one more step.
Step arrays are [..., S] with S = L slots, step s at index s, `valid` where step s has tokens.
"""

import jax
import jax.numpy as jnp

TOKEN_AGGS = ('mean', 'sum', 'last', 'min', 'max')
STEP_AGGS = TOKEN_AGGS + ('bottom10',)
RULES = ('min_cumulative', 'sharpest_drop', 'sharpest_abs_drop')


def _check(value, allowed, what):
  if value not in allowed:
    raise ValueError(f'progress scores: unknown {what} {value!r}; valid: {", ".join(allowed)}')


def step_members(mask, step_ends):
  """bool [..., S, L]: token t belongs to step s (S = L). Masked tokens belong to none.
  L² per row: sized for scoring sampled responses, not for the training step."""
  mask = jnp.asarray(mask, bool)
  ends = jnp.asarray(step_ends, bool) & mask
  step = jnp.cumsum(ends, axis=-1) - ends  # a step's end token is its own
  slots = jnp.arange(mask.shape[-1])
  return (step[..., None, :] == slots[:, None]) & mask[..., None, :]


def _aggregate(x, member, agg: str):
  """[..., L], [..., S, L] -> [..., S]: `agg` of x over each step's tokens (0 for none)."""
  x = jnp.asarray(x, jnp.float32)[..., None, :]
  count = jnp.sum(member, axis=-1)
  if agg in ('mean', 'sum'):
    total = jnp.sum(jnp.where(member, x, 0.0), axis=-1)
    out = total / jnp.maximum(count, 1) if agg == 'mean' else total
  elif agg == 'min':
    out = jnp.min(jnp.where(member, x, jnp.inf), axis=-1)
  elif agg == 'max':
    out = jnp.max(jnp.where(member, x, -jnp.inf), axis=-1)
  else:  # 'last'
    last = jnp.max(jnp.where(member, jnp.arange(member.shape[-1]), -1), axis=-1)
    out = jnp.take_along_axis(x[..., 0, :], jnp.maximum(last, 0), axis=-1)
  return jnp.where(count > 0, out, 0.0)


def step_scores(logprobs, ref_logprobs, mask, step_ends, *, token_agg: str = 'mean',
                beta: float = 1.0):
  """(scores float32 [..., S], valid bool [..., S]): step s's progress advantage
  β·(agg_{t∈s} log π_θ(y_t) − agg_{t∈s} log π_ref(y_t)), each model's log-probs aggregated
  on its own as the authors' code does (for 'mean' and 'sum' the same as the aggregate of
  x_t). `ref_logprobs` None: β·agg_{t∈s} log π_θ, the authors' 'policy_logprob' baseline.
  Invalid slots (no step) are 0. Inputs [..., L]."""
  _check(token_agg, TOKEN_AGGS, 'token aggregation')
  member = step_members(mask, step_ends)
  scores = _aggregate(logprobs, member, token_agg)
  if ref_logprobs is not None:
    scores = scores - _aggregate(ref_logprobs, member, token_agg)
  return beta * scores, jnp.any(member, axis=-1)


def trajectory_scores(scores, valid, *, step_agg: str = 'mean'):
  """float32 [...]: the trajectory's score, `step_agg` over its valid steps ('bottom10': the
  mean of the lowest ⌈10 %⌉ of them, at least one). A trajectory without steps scores −inf
  (ranked last), as in the authors' best-of-N."""
  _check(step_agg, STEP_AGGS, 'step aggregation')
  scores = jnp.asarray(scores, jnp.float32)
  n = jnp.sum(valid, axis=-1)
  if step_agg == 'bottom10':
    k = jnp.maximum(1, jnp.ceil(0.1 * n).astype(jnp.int32))
    ranked = jnp.cumsum(jnp.sort(jnp.where(valid, scores, jnp.inf), axis=-1), axis=-1)
    out = jnp.take_along_axis(ranked, (k - 1)[..., None], axis=-1)[..., 0] / k
  else:
    out = _aggregate(scores, jnp.asarray(valid, bool)[..., None, :], step_agg)[..., 0]
  return jnp.where(n > 0, out, -jnp.inf)


def failure_step(scores, valid, *, rule: str = 'min_cumulative'):
  """int32 [...]: the step a failed trajectory's error is attributed to (`runners/fa.py`).
  'min_cumulative': the valid step where Σ_{s'≤s} score is least; 'sharpest_drop': the
  lowest-scoring valid step, or the first one if none is negative; 'sharpest_abs_drop': the
  valid step with the most negative change from the valid step before it, or the first if
  no change is ≤ 0. Ties: the earliest. No valid step: 0."""
  _check(rule, RULES, 'attribution rule')
  scores = jnp.where(valid, jnp.asarray(scores, jnp.float32), 0.0)
  first = jnp.argmax(valid, axis=-1).astype(jnp.int32)
  if rule == 'min_cumulative':
    return jnp.argmin(jnp.where(valid, jnp.cumsum(scores, -1), jnp.inf), -1).astype(jnp.int32)
  if rule == 'sharpest_drop':
    low = jnp.argmin(jnp.where(valid, scores, jnp.inf), -1).astype(jnp.int32)
    return jnp.where(jnp.any(valid & (scores < 0), -1), low, first)
  prev = _previous_valid(scores, valid)
  has_prev = valid & (jnp.cumsum(valid, -1) > 1)
  delta = jnp.where(has_prev, scores - prev, jnp.inf)
  drop = jnp.argmin(delta, -1).astype(jnp.int32)
  return jnp.where(jnp.any(delta <= 0, -1), drop, first)


def _previous_valid(scores, valid):
  """[..., S]: the score of the last valid step before each slot (0 before the first)."""
  def carry(last, sv):
    s, v = sv
    return jnp.where(v, s, last), last
  moved = jnp.moveaxis(scores, -1, 0), jnp.moveaxis(jnp.asarray(valid, bool), -1, 0)
  _, prev = jax.lax.scan(carry, jnp.zeros(scores.shape[:-1], jnp.float32), moved)
  return jnp.moveaxis(prev, 0, -1)
