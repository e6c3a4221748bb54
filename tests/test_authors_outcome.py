"""`dr_grpo`, `ngrpo` and `passk` against plain-Python transcriptions of their authors' code.

Each `*_authors` function below is our own re-implementation (loops, Python floats) of what
the authors' public code computes for one prompt's group of outcome rewards, written after
reading it (not copied, not run). The tests compare `credit.get(name)` with it on random
groups: where the two agree they must match to float32 rounding; where they differ by a
convention the project's output must equal the transcription with that convention changed,
and a fixed case shows the two conventions giving different numbers.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit

L = 3  # tokens per response; outcome estimators broadcast one value to a response's tokens


def rollouts(rewards, row_mask=None, seed=0):
  rewards = np.asarray(rewards, np.float32)
  lengths = np.random.default_rng(seed).integers(1, L + 1, rewards.shape)
  mask = np.arange(L) < lengths[..., None]
  if row_mask is not None:
    row_mask = np.asarray(row_mask, bool)
    mask = mask & row_mask[..., None]
  return credit.Rollouts(tokens=np.zeros(rewards.shape + (L,), np.int32), mask=mask,
                         rewards=rewards, row_mask=row_mask)


def run(name, rewards, row_mask=None, **hparams):
  """The estimator's per-response advantages [..., G] (float64), after checking that it
  repeats one value on a response's tokens and puts 0 on the masked ones."""
  r = rollouts(rewards, row_mask)
  adv = np.asarray(credit.get(name)(r, **hparams))
  assert adv.dtype == np.float32 and adv.shape == r.mask.shape
  assert np.all(adv[~r.mask] == 0)
  first = adv[..., :1]
  assert np.all(np.where(r.mask, adv == first, True))
  return first[..., 0].astype(np.float64)


def per_group(fn, rewards, **kw):
  """Applies a one-group transcription to every group (last axis) of a [B, G] array."""
  return np.array([fn([float(x) for x in row], **kw) for row in np.asarray(rewards)])


def close(got, want, rel=2e-6, scale=1.0):
  np.testing.assert_allclose(got, want, rtol=rel, atol=rel * scale)


# Reward grids exact in float32, so float32 and float64 means agree up to rounding of the
# last division (no cancellation between nearly equal rewards).
QUARTERS = st.integers(-8, 8).map(lambda i: i / 4)
BINARY = st.sampled_from([0.0, 1.0])


def groups(values, g_min=2, g_max=6, b=2):
  """b groups of one random size in [g_min, g_max] (few shapes: eager JAX compiles per shape)."""
  return st.integers(g_min, g_max).flatmap(
      lambda g: st.lists(st.lists(values, min_size=g, max_size=g), min_size=b, max_size=b))


# ---------------------------------------------------------------------------------------------
# Dr. GRPO. Read: github sail-sg/understand-r1-zero, train_zero_math.py,
# ZeroMathLearner.compute_monte_carlo_advantages (commit dfca49dd460ee7cc8e4a5a162c876a7fd6993b87,
# 2025-08-27), critic_type="drgrpo": the outcome reward is the sum of the token rewards, the
# rewards are viewed as [-1, num_samples], the group mean is subtracted and (only for
# critic_type="grpo") nothing else is done: no std division, no special case for equal rewards.


def dr_grpo_authors(group, single_mean_zero=False):
  """One group's advantages R_i − mean(R). The authors' group mean of a group of one is its
  own reward (advantage 0); `single_mean_zero=True` is the project's convention (μ = 0 for a
  group of one, as verl's GRPO), which passes R through."""
  n = len(group)
  if n == 1 and single_mean_zero:
    return [group[0]]
  mean = 0.0
  for r in group:
    mean += r
  mean /= n
  return [r - mean for r in group]


REAL = st.one_of(QUARTERS, st.floats(-10, 10, allow_nan=False, width=32))


@settings(max_examples=25, deadline=None)
@given(groups(REAL))
def test_dr_grpo_is_the_authors_mean_centring(rewards):
  want = per_group(dr_grpo_authors, rewards)
  close(run("dr_grpo", rewards), want, scale=max(1.0, np.max(np.abs(rewards))))


@settings(max_examples=25, deadline=None)
@given(groups(REAL, g_min=1, g_max=1))
def test_dr_grpo_group_of_one_passes_the_reward_through(rewards):
  # Convention: the project's μ = 0 for a group of one.
  close(run("dr_grpo", rewards), per_group(dr_grpo_authors, rewards, single_mean_zero=True))


def test_dr_grpo_group_of_one_conventions_differ():
  assert dr_grpo_authors([0.75]) == [0.0]  # authors: R − R
  assert dr_grpo_authors([0.75], single_mean_zero=True) == [0.75]
  assert run("dr_grpo", [[0.75]]).tolist() == [[0.75]]  # project: R


@settings(max_examples=25, deadline=None)
@given(groups(QUARTERS, g_min=3, g_max=5), st.data())
def test_dr_grpo_rows_are_groups_of_their_size(rewards, data):
  """With a `row_mask` (groups of varying size, a project extension: the authors' groups all
  have num_samples rows) each group is the authors' group of its rows; padded rows get 0."""
  rewards = np.asarray(rewards)
  b, g = rewards.shape
  rows = np.array([[j < data.draw(st.integers(1, g)) for j in range(g)] for _ in range(b)])
  got = run("dr_grpo", rewards, row_mask=rows)
  for i in range(b):
    want = dr_grpo_authors([float(x) for x in rewards[i][rows[i]]], single_mean_zero=True)
    close(got[i][rows[i]], want, scale=2.0)
    assert np.all(got[i][~rows[i]] == 0)


# ---------------------------------------------------------------------------------------------
# NGRPO. Read: github nangongrui-ngr/NGRPO, verl/trainer/ppo/core_algos.py,
# compute_ngrpo_outcome_advantage (commit e7a380415a64cd8ac102504c38a5f86069022f35,
# 2025-10-21), called from ray_trainer.compute_advantage with the training script's
# max_reward=1.0, add_max_reward_num=1 and its default epsilon=1e-6.


def ngrpo_authors(group, max_reward=1.0, add_max_reward_num=1, eps=1e-6,
                  augment_single=False):
  """(R_i − μ')/(σ' + eps), μ' and Bessel σ' over the group plus `add_max_reward_num` copies
  of `max_reward`. The authors give a group of one μ = 0, σ = 1 (no virtual sample):
  R/(1 + eps). `augment_single=True` is the project's convention: a group of one is
  augmented like any other."""
  n = len(group)
  if n == 1 and not augment_single:
    mean, std = 0.0, 1.0
  else:
    aug = list(group) + [max_reward] * add_max_reward_num
    mean = sum(aug) / len(aug)
    var = 0.0
    for x in aug:
      var += (x - mean) ** 2
    std = math.sqrt(var / (len(aug) - 1))
  return [(r - mean) / (std + eps) for r in group]


@settings(max_examples=25, deadline=None)
@given(groups(QUARTERS), st.sampled_from([1.0, 0.5, 2.0]))
def test_ngrpo_is_the_authors_virtual_best_sample(rewards, max_reward):
  want = per_group(ngrpo_authors, rewards, max_reward=max_reward)
  close(run("ngrpo", rewards, max_reward=max_reward), want, scale=4.0)


@settings(max_examples=25, deadline=None)
@given(groups(st.sampled_from([0.0, 1.0, 0.5]), g_min=2, g_max=4), st.data())
def test_ngrpo_all_at_max_is_exactly_zero_on_both(rewards, data):
  """Groups whose rewards all equal max_reward: the authors' (R − μ')/(0 + eps) is 0 because
  μ' = R exactly; the project's explicit all-equal rule gives the same 0."""
  rewards = np.asarray(rewards)
  rewards[0] = 1.0
  assert np.all(np.asarray(per_group(ngrpo_authors, rewards))[0] == 0)
  assert np.all(run("ngrpo", rewards)[0] == 0)


@settings(max_examples=25, deadline=None)
@given(groups(QUARTERS, g_min=1, g_max=1), st.sampled_from([1.0, 2.0]))
def test_ngrpo_group_of_one_gets_the_virtual_sample(rewards, max_reward):
  # Convention: the project augments a group of one too (the authors use μ = 0, σ = 1).
  want = per_group(ngrpo_authors, rewards, max_reward=max_reward, augment_single=True)
  close(run("ngrpo", rewards, max_reward=max_reward), want, scale=4.0)


def test_ngrpo_group_of_one_conventions_differ():
  authors = ngrpo_authors([0.0])[0]  # 0/(1 + 1e-6)
  augmented = ngrpo_authors([0.0], augment_single=True)[0]  # [0, 1]: −0.5/(0.7071 + 1e-6)
  assert authors == 0.0
  assert augmented == pytest.approx(-1 / math.sqrt(2), rel=1e-5)
  np.testing.assert_allclose(run("ngrpo", [[0.0]]), [[augmented]], rtol=1e-6)
  assert run("ngrpo", [[1.0]]).tolist() == [[0.0]]  # R = max: both give 0 ...
  assert ngrpo_authors([0.5])[0] == pytest.approx(0.5, rel=1e-5)  # ... other R: R/(1 + eps)
  assert run("ngrpo", [[0.5]])[0, 0] == pytest.approx(-1 / math.sqrt(2), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Pass@k training. Read: github RUCAIBox/Passk_Training, code/passk_adv.py, calc_adv (and
# compute_advantage, which applies it to each uid's group of summed token rewards); commit
# c3ba575ecb31f47fd9f5c43b18c081d4a295f783 (2025-08-15; the file last changed in 00474d78).
# It uses scipy.special.comb (exact=False), which is 0 when N < 0 or k > N.


def _comb(n, k):
  return 0.0 if n < 0 or k < 0 or k > n else float(math.comb(n, k))


def passk_authors(group, k=4, eps=1e-6, correct=lambda r: r == 1.0):
  """c = #correct, ρ = 1 − C(n−c, k)/C(n, k), σ = √(ρ(1−ρ)); correct responses get
  (1 − ρ)/(σ + eps), responses with reward 0 get (1 − ρ − C(n−c−1, k−1)/C(n−1, k−1))/(σ + eps),
  any other reward is left as it is. The authors' `correct` is R == 1 and eps = 1e-6.

  eps = 0 is the project's convention: no eps, and 0 where σ = 0 (there both numerators
  are exactly 0, so the authors' output is 0 for every eps > 0 too)."""
  n = len(group)
  c = sum(1 for r in group if correct(r))
  rho = 1.0 - _comb(n - c, k) / _comb(n, k)
  sigma = math.sqrt(rho * (1.0 - rho))
  num_p = 1.0 - rho
  num_n = 1.0 - rho - _comb(n - c - 1, k - 1) / _comb(n - 1, k - 1)
  den = sigma + eps
  adv_p = num_p / den if den > 0 else 0.0
  adv_n = num_n / den if den > 0 else 0.0
  out = []
  for r in group:
    # The authors replace R == 1 by adv_p first, then every 0 (the original zeros, and a
    # replaced adv_p that is 0) by adv_n; adv_p = 0 only when ρ = 1, where adv_n = 0 too.
    v = adv_p if correct(r) else r
    out.append(adv_n if v == 0.0 else v)
  return out


def binarised(group, threshold=0.5):
  return [1.0 if r > threshold else 0.0 for r in group]


@settings(max_examples=25, deadline=None)
@given(groups(BINARY, g_min=1, g_max=6), st.data())
def test_passk_binary_rewards_match_the_authors_without_eps(rewards, data):
  # Convention: the project has no eps (σ = 0 gives 0); on {0, 1} rewards R == 1 is R > 0.5.
  k = data.draw(st.integers(1, len(rewards[0])))
  got = run("passk", rewards, k=k)
  close(got, per_group(passk_authors, rewards, k=k, eps=0.0), rel=2e-6)  # float32: ~1e-6
  # ... and the authors' eps = 1e-6 moves it by at most eps/σ relative (σ >= 0.21 for n <= 6).
  close(got, per_group(passk_authors, rewards, k=k), rel=2e-5, scale=4.0)


def test_passk_eps_conventions_differ():
  # n = 2, c = 1, k = 1: ρ = ½, σ = ½. Project: ±1 exactly; authors: ±0.5/(0.5 + 1e-6).
  assert run("passk", [[1.0, 0.0]], k=1).tolist() == [[1.0, -1.0]]
  assert passk_authors([1.0, 0.0], k=1, eps=0.0) == [1.0, -1.0]
  authors = passk_authors([1.0, 0.0], k=1)
  assert authors == pytest.approx([0.999998, -0.999998], abs=1e-9)
  assert np.float32(authors[0]) != np.float32(1.0)  # visible in float32


@settings(max_examples=25, deadline=None)
@given(groups(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, -0.5]), g_min=2, g_max=6),
       st.data())
def test_passk_graded_rewards_are_the_authors_on_binarised_rewards(rewards, data):
  """Difference: the authors count R == 1 as correct and pass any reward other than 0 and 1
  through unchanged; the project counts R > 0.5 and gives every response A₊ or A₋. The
  project equals the authors' code applied to 1[R > 0.5] (without eps)."""
  k = data.draw(st.integers(1, len(rewards[0])))
  want = [passk_authors(binarised(g), k=k, eps=0.0) for g in rewards]
  close(run("passk", rewards, k=k), want, rel=2e-6)


def test_passk_graded_rewards_differ():
  # n = 4, k = 2, rewards [0.8, 0, 0, 0]. Authors: c = #(R == 1) = 0, so ρ = 0, σ = 0; the
  # 0.8 is kept and the zeros get 0/(0 + 1e-6) = 0. Project: c = #(R > 0.5) = 1, ρ = ½,
  # σ = ½: A₊ = 1, A₋ = (½ − C(2,1)/C(3,1))/½ = −⅓.
  assert passk_authors([0.8, 0.0, 0.0, 0.0], k=2) == [0.8, 0.0, 0.0, 0.0]
  np.testing.assert_allclose(run("passk", [[0.8, 0.0, 0.0, 0.0]], k=2),
                             [[1.0, -1 / 3, -1 / 3, -1 / 3]], rtol=1e-6)
  # A reward of 2 (a bonus above 1): the authors keep 2, the project treats it as correct.
  assert passk_authors([2.0, 1.0, 0.0, 0.0], k=1)[0] == 2.0
  got = run("passk", [[2.0, 1.0, 0.0, 0.0]], k=1)
  np.testing.assert_allclose(got, [[1.0, 1.0, -1.0, -1.0]], rtol=1e-6)


def test_passk_k_above_group_size():
  # Authors: C(n, k) = 0 for k > n, so ρ = 1 − 0/0 is nan (numpy warns); the project raises.
  with np.errstate(invalid="ignore", divide="ignore"):
    rho = 1.0 - np.float64(0.0) / np.float64(_comb(2, 3))
  assert math.isnan(rho)
  with pytest.raises(ValueError, match="1 <= k <= group size"):
    run("passk", [[1.0, 0.0]], k=3)
