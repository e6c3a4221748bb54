"""Progress advantage as a scorer (credit/progress_scores.py) against a plain-Python reference
written from the authors' released code (deeplearning-wisc/progress-advantage: token and step
aggregations, best-of-N scoring, the three failure-attribution rules), and stats.auroc against
counting pairs."""

import functools
import math

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from credit import progress_scores as ps
from experiments.training import stats

SHAPE = (6, 12)  # [rows, L]: one compiled program per function and option


def agg_ref(values, strategy):
  """pa/aggregations.py's token and step aggregations, on a list."""
  if not values:
    return 0.0
  if strategy == 'mean':
    return sum(values) / len(values)
  if strategy == 'sum':
    return sum(values)
  if strategy == 'last':
    return values[-1]
  if strategy == 'min':
    return min(values)
  if strategy == 'max':
    return max(values)
  k = max(1, math.ceil(0.10 * len(values)))  # 'bottom10'
  return sum(sorted(values)[:k]) / k


def steps_ref(mask, ends):
  """One row's steps as lists of token positions: a step closes at an end token (inclusive);
  the tokens after the last end form one more step."""
  steps, cur = [], []
  for t in range(len(mask)):
    if not mask[t]:
      continue
    cur.append(t)
    if ends[t]:
      steps.append(cur)
      cur = []
  return steps + ([cur] if cur else [])


def step_rewards_ref(lp, ref, mask, ends, token_agg, beta):
  out = []
  for step in steps_ref(mask, ends):
    p = agg_ref([float(lp[t]) for t in step], token_agg)
    r = 0.0 if ref is None else agg_ref([float(ref[t]) for t in step], token_agg)
    out.append(beta * (p - r))
  return out


def failure_ref(rewards, rule):
  """runners/fa.py's three predictors; every step here is an action step."""
  idx = list(range(len(rewards)))
  if not idx:
    return 0
  if rule == 'min_cumulative':
    cum = np.cumsum(rewards)
    return min(idx, key=lambda i: (cum[i], i))
  if rule == 'sharpest_drop':
    if all(rewards[i] >= 0 for i in idx):
      return 0
    return min(idx, key=lambda i: (rewards[i], i))
  if len(idx) < 2:
    return 0
  deltas = [(rewards[j] - rewards[j - 1], j) for j in range(1, len(idx))]
  return min(deltas)[1] if any(d <= 0 for d, _ in deltas) else 0


@st.composite
def batches(draw):
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  n, l = SHAPE
  lengths = rng.integers(0, l + 1, size=n)
  lengths[0] = l  # a full row, and (below) an empty one
  lengths[1] = 0
  mask = np.arange(l) < lengths[:, None]
  ends = (rng.random(SHAPE) < draw(st.sampled_from([0.0, 0.2, 0.6]))) & mask
  lp = (-rng.exponential(size=SHAPE)).astype(np.float32)
  ref = (lp + rng.normal(size=SHAPE)).astype(np.float32)
  # a quarter of the values repeated, so that ties in the rules are exercised
  lp[rng.random(SHAPE) < 0.25] = -1.0
  ref[rng.random(SHAPE) < 0.25] = -1.0
  return lp, ref, mask, ends


@functools.lru_cache(maxsize=None)
def _scores(token_agg, with_ref):
  return jax.jit(lambda lp, ref, m, e: ps.step_scores(lp, ref if with_ref else None, m, e,
                                                      token_agg=token_agg, beta=0.5))


@functools.lru_cache(maxsize=None)
def _jitted(fn, **options):
  return jax.jit(functools.partial(fn, **options))


@given(batches(), st.sampled_from(ps.TOKEN_AGGS), st.booleans())
def test_step_scores_match_the_authors_aggregations(batch, token_agg, with_ref):
  lp, ref, mask, ends = batch
  scores, valid = (np.asarray(x) for x in _scores(token_agg, with_ref)(lp, ref, mask, ends))
  for i in range(SHAPE[0]):
    want = step_rewards_ref(lp[i], ref[i] if with_ref else None, mask[i], ends[i], token_agg,
                            0.5)
    assert valid[i].tolist() == [s < len(want) for s in range(SHAPE[1])]
    np.testing.assert_allclose(scores[i, :len(want)], want, rtol=1e-5, atol=1e-5)
    assert not scores[i, len(want):].any()


@given(batches(), st.sampled_from(ps.STEP_AGGS))
def test_trajectory_scores_match_the_authors_best_of_n_score(batch, step_agg):
  lp, ref, mask, ends = batch
  scores, valid = _scores('mean', True)(lp, ref, mask, ends)
  got = np.asarray(_jitted(ps.trajectory_scores, step_agg=step_agg)(scores, valid))
  for i in range(SHAPE[0]):
    rewards = step_rewards_ref(lp[i], ref[i], mask[i], ends[i], 'mean', 0.5)
    want = agg_ref(rewards, step_agg) if rewards else -np.inf  # no step: ranked last
    np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


@given(batches(), st.sampled_from(ps.RULES))
def test_failure_step_matches_the_authors_predictors(batch, rule):
  lp, ref, mask, ends = batch
  scores, valid = _scores('min', True)(lp, ref, mask, ends)
  got = np.asarray(_jitted(ps.failure_step, rule=rule)(scores, valid))
  for i in range(SHAPE[0]):
    # the reference reads the scores computed above, so that a float tie is the same tie
    n = int(np.asarray(valid[i]).sum())
    assert got[i] == failure_ref([float(x) for x in np.asarray(scores[i, :n])], rule)


def test_the_papers_intent_on_a_hand_made_case():
  """Two 3-step responses; RL raised the second one's middle step and lowered its last step
  (log π_θ − log π_ref = +1 and −2 per token), the first is unchanged: the first scores 0,
  the second has the lowest step at its last step and is ranked below the first by every
  step aggregation that sees the drop."""
  ref = np.full((2, 6), -1.0, np.float32)
  lp = ref.copy()
  lp[1, 2:4] += 1.0
  lp[1, 4:6] -= 2.0
  mask = np.ones((2, 6), bool)
  ends = np.zeros((2, 6), bool)
  ends[:, [1, 3, 5]] = True
  scores, valid = ps.step_scores(lp, ref, mask, ends)
  np.testing.assert_allclose(np.asarray(scores)[:, :3], [[0, 0, 0], [0, 1, -2]])
  assert np.asarray(valid).sum(-1).tolist() == [3, 3]
  for agg in ('mean', 'sum', 'min', 'last', 'bottom10'):
    t = np.asarray(ps.trajectory_scores(scores, valid, step_agg=agg))
    assert t[1] < t[0], agg
  assert np.asarray(ps.failure_step(scores, valid, rule='sharpest_drop'))[1] == 2
  assert np.asarray(ps.failure_step(scores, valid, rule='min_cumulative'))[1] == 2


@pytest.mark.parametrize('what,value', [('token_agg', 'median'), ('step_agg', 'p10'),
                                        ('rule', 'first')])
def test_unknown_options_are_refused_by_name(what, value):
  x, m = np.zeros((1, 3), np.float32), np.ones((1, 3), bool)
  with pytest.raises(ValueError, match=value):
    if what == 'token_agg':
      ps.step_scores(x, x, m, m, token_agg=value)
    elif what == 'step_agg':
      ps.trajectory_scores(x, m, step_agg=value)
    else:
      ps.failure_step(x, m, rule=value)


@given(st.lists(st.tuples(st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 2.0]), st.booleans()),
                min_size=2, max_size=12))
def test_auroc_counts_pairs(points):
  s = np.array([p[0] for p in points])
  y = np.array([p[1] for p in points])
  pos, neg = s[y], s[~y]
  if not len(pos) or not len(neg):
    assert math.isnan(stats.auroc(s, y))
    return
  pairs = [(a > b) + 0.5 * (a == b) for a in pos for b in neg]
  assert stats.auroc(s, y) == pytest.approx(np.mean(pairs))


def test_auroc_refuses_nan_and_mismatched_lengths():
  with pytest.raises(ValueError, match='nan'):
    stats.auroc([0.1, np.nan], [True, False])
  with pytest.raises(ValueError, match='labels'):
    stats.auroc([0.1, 0.2], [True])


def test_the_scripts_selection_and_attribution_on_hand_made_samples():
  """experiments/progress_scoring.py on two prompts x 3 responses of 4 tokens (2 steps of 2):
  best-of-N takes the top progress score (the first on a tie), AUROC and attribution count
  what they should, and a failure whose first wrong step was not written is left out."""
  import ml_collections
  from experiments import progress_scoring

  ref = np.full((2, 3, 4), -1.0, np.float32)
  lp = ref.copy()
  lp[0, 1] += 1.0            # prompt 0: response 1 raised everywhere (and correct)
  lp[0, 2, 2:] -= 1.0        # response 2 lowered in its second step (wrong there)
  lp[1, 0, :2] -= 1.0        # prompt 1: response 0 lowered in its first step (wrong there)
  mask = np.ones((2, 3, 4), bool)
  mask[1, 2, 2:] = False     # prompt 1, response 2: stopped after its first step
  ends = np.zeros((2, 3, 4), bool)
  ends[..., 1] = True
  ends[..., 3] = True
  success = np.array([[False, True, False], [False, True, False]])
  first_wrong = np.array([[0, 2, 1], [0, 2, 1]])  # [1, 2] wrote 1 step and failed at step 1
  d = dict(mask=mask, ends=ends, lp=lp, ref=ref, success=success, first_wrong=first_wrong)
  sc = ml_collections.ConfigDict(dict(aggregations='mean/mean', beta=1.0, failure_token_agg='min'))
  sel = progress_scoring.selection(d, sc)
  # prompt 0 picks response 1 (score +1); prompt 1: responses 1 and 2 tie at 0, the first wins
  assert sel['progress_advantage mean/mean']['best_of_n'] == 1.0
  # scores [0, 1, -0.5], [-0.5, 0, 0]: the positive 1 beats all 4 negatives, the positive 0
  # beats the two at -0.5 and ties the two at 0
  assert sel['progress_advantage mean/mean']['auroc'] == pytest.approx((4 + 3) / 8)
  fa = progress_scoring.attribution(d, sc)
  assert (fa['failed'], fa['attributable']) == (4, 3)
  # failures [0,0] (no drop: first step, right), [0,2] (drop at step 1, right), [1,0] (right)
  assert fa['progress_advantage sharpest_drop']['accuracy'] == 1.0
  assert fa['first_step'] == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match='token/step'):
    progress_scoring.aggregations('mean')
