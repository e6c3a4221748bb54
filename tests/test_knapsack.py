"""Knapsack RL's rollout-budget allocation (#59, experiments/rollouts/knapsack.py) and groups
of varying size (`Rollouts.row_mask`): the allocation against a plain-Python dynamic
program, the padded sampler against i.i.d. sampling row for row, and the row-masked
estimators against the same estimators on each group's rows alone."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
from experiments.rollouts import knapsack, sampling
from tests.test_sampling import CFG, EOS, IDS, KEY, PAD, PROMPTS, params  # noqa: F401


def reference_value(n, p):
  return (1 - p ** n - (1 - p) ** n) * p * (1 - p) ** 2


def dp_best(rates, budget, lo, hi):
  """The largest Σ v(n_i, p_i) over n_i in [lo, hi] with Σ (n_i − lo) = budget (plain DP)."""
  best = {0: 0.0}
  for p in rates:
    nxt = {}
    for used, val in best.items():
      for extra in range(hi - lo + 1):
        if used + extra <= budget:
          v = val + reference_value(lo + extra, p)
          nxt[used + extra] = max(nxt.get(used + extra, -1.0), v)
    best = nxt
  return best.get(budget)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([-1.0, 0.0, 1.0, 0.125, 0.25, 0.5, 0.75, 0.875, 0.3]),
                min_size=1, max_size=5), st.integers(2, 4), st.sampled_from([(1, 6), (2, 8)]))
def test_allocation_is_the_knapsack_optimum(rates, g, bounds):
  lo, hi = bounds
  p = np.asarray(rates)
  total = len(rates) * g
  n = knapsack.allocate(p, total, default=g, min_rows=lo, max_rows=hi)
  assert n.sum() == total and n.min() >= lo and n.max() <= hi
  seen, live = p >= 0, (p > 0) & (p < 1)
  hard = seen & (p == 0)
  assert (n[~seen] >= g).all()                           # never seen: G ...
  if (n[~seen] > g).any():                               # ... unless the rest are full
    assert (n[live | hard] == hi).all()
  if (n[p == 1.0] > lo).any():  # always solved: the floor, unless all the others are full
    assert (n[p < 1] == hi).all()
  left = total - g * int((~seen).sum()) - lo * int(seen.sum())
  to_live = int(n[live].sum()) - lo * int(live.sum())
  # The live prompts' rollouts are a best split of what they got (the DP's optimum) ...
  got = sum(reference_value(k, q) for k, q in zip(n[live], p[live]))
  assert got == pytest.approx(dp_best(p[live], to_live, lo, hi), abs=1e-12)
  # ... and they get all of it unless every one is at its useful cap or the maximum.
  useful = np.clip(np.ceil(np.log(0.1) / np.log(np.maximum(p, 1 - p).clip(1e-12, 1 - 1e-12))),
                   lo, hi)
  if hard.any() and left > np.sum(np.where(live, useful - lo, 0)):
    assert n[hard].sum() > lo * hard.sum()               # the surplus went to unsolved prompts
  elif live.any():
    assert to_live == min(left, (hi - lo) * int(live.sum()))


def test_allocation_prefers_uncertain_prompts_and_refuses_impossible_budgets():
  p = np.array([0.5, 0.95, 0.05, 0.5])
  n = knapsack.allocate(p, 32, default=8, min_rows=2, max_rows=16)
  # The information gain p(1 − p)² favours the rarely solved prompt over the rarely failed.
  assert n.sum() == 32 and n[0] == n[3] and n[2] > n[0] > n[1]
  # What no uncertain or unsolved prompt can take goes to the unseen, then the solved ones.
  np.testing.assert_array_equal(
      knapsack.allocate(np.array([-1.0, 1.0]), 8, default=4, min_rows=2, max_rows=6), [6, 2])
  np.testing.assert_array_equal(
      knapsack.allocate(np.array([0.0, 1.0]), 8, default=4, min_rows=2, max_rows=5), [5, 3])
  with pytest.raises(ValueError, match='min_rows <= G <= max_rows'):
    knapsack.allocate(p, 32, default=8, min_rows=2, max_rows=4)


def test_uniform_budget_is_iid_sampling_and_every_row_keeps_its_stream(params):  # noqa: F811
  kw = dict(eos_id=EOS, pad_id=PAD, prompt_ids=IDS)
  g, gmax, l = 4, 6, 10
  iid = sampling.sample_iid(params, CFG, KEY, PROMPTS, gmax, l, **kw)
  same = knapsack.sample_budgeted(params, CFG, KEY, PROMPTS, [g] * 3, gmax, l, **kw)
  uneven = knapsack.sample_budgeted(params, CFG, KEY, PROMPTS, [6, 1, 5], gmax, l, **kw)
  for s, sizes in ((same, [g] * 3), (uneven, [6, 1, 5])):
    rows = np.arange(gmax)[None, :] < np.asarray(sizes)[:, None]
    np.testing.assert_array_equal(np.asarray(s.row_mask), rows)
    for name in ('tokens', 'mask', 'logprobs', 'entropy'):  # row j = i.i.d. response j
      want, got = np.asarray(getattr(iid, name)), np.asarray(getattr(s, name))
      np.testing.assert_allclose(got[rows], want[rows], atol=1e-5)  # (rounding: other batch)
    assert not np.asarray(s.mask)[~rows].any() and (np.asarray(s.tokens)[~rows] == PAD).all()
    credit.validate(credit.Rollouts(tokens=s.tokens, mask=s.mask, rewards=jnp.zeros(rows.shape),
                                    row_mask=s.row_mask))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2 ** 31 - 1))
def test_row_masked_estimators_equal_each_group_alone(seed):
  rng = np.random.default_rng(seed)
  b, g, l = 3, 6, 4
  sizes = rng.integers(1, g + 1, b)
  rows = np.arange(g)[None] < sizes[:, None]
  lengths = np.where(rows, rng.integers(1, l + 1, (b, g)), 0)
  mask = np.arange(l) < lengths[..., None]
  rewards = np.where(rows, rng.choice([0.0, 0.5, 1.0], (b, g)), rng.normal(size=(b, g)))
  tokens = rng.integers(0, 5, (b, g, l)).astype(np.int32)
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards.astype(np.float32),
                      row_mask=rows)
  for name in credit.row_masked():
    got = np.asarray(credit.get(name)(r))
    for i in range(b):
      n = sizes[i]
      alone = credit.Rollouts(tokens=tokens[i:i + 1, :n], mask=mask[i:i + 1, :n],
                              rewards=rewards[i:i + 1, :n].astype(np.float32))
      np.testing.assert_allclose(got[i, :n], np.asarray(credit.get(name)(alone))[0], atol=1e-6)
      assert not got[i, n:].any()  # padded rows: 0


def test_row_mask_is_refused_by_other_estimators_and_checked():
  rows = np.array([[True, True, False]])
  mask = np.array([[[1, 1], [1, 0], [0, 0]]], bool)
  r = credit.Rollouts(tokens=np.zeros((1, 3, 2), np.int32), mask=mask,
                      rewards=np.array([[1.0, 0.0, 0.0]], np.float32), row_mask=rows)
  with pytest.raises(ValueError, match="'tempo' does not support groups of varying size"):
    credit.get('tempo')(r)
  with pytest.raises(ValueError, match='padded row'):
    credit.validate(r.replace(row_mask=np.array([[True, False, False]])))
  with pytest.raises(ValueError, match='row_mask must be boolean'):
    credit.validate(r.replace(row_mask=np.ones((1, 2), bool)))


def test_pass_rates_and_signal_read_only_the_rows():
  rates = jnp.full((5,), -1.0)
  rewards = jnp.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
  rows = jnp.array([[True, True, False], [True, True, False]])
  new = np.asarray(knapsack.update_pass_rates(rates, jnp.array([3, 0]), rewards, rows))
  np.testing.assert_allclose(new, [1.0, -1, -1, 0.5, -1])
  assert knapsack.signal(rewards, rows) == (0.5, 0.5)     # [1, 0] differs, [1, 1] does not
  assert knapsack.signal(rewards) == (1.0, 1.0)
  assert knapsack.signal(rewards, jnp.array([[True] * 3, [True, False, False]])) == (0.5, 0.75)


def test_uniform_allocation_for_unseen_prompts_spends_exactly_g():
  for b, g in itertools.product((1, 3, 8), (2, 4)):
    np.testing.assert_array_equal(
        knapsack.allocate(-np.ones(b), b * g, default=g, min_rows=2, max_rows=16), g)
