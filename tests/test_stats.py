"""Tests for experiments/training/stats.py against hard-coded references (no scipy)."""

import math

import numpy as np
import pytest

from experiments.training import stats

# Two-sided 95 % Student t critical values t_{df, 0.975}, df = 1..30 (standard tables).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def test_t_quantiles_match_the_table():
  for df, ref in enumerate(T975, start=1):
    assert abs(stats.t_quantile(0.975, df) - ref) < 6e-4, df
  assert stats.t_quantile(0.975, 4) == pytest.approx(2.776, abs=5e-4)
  assert stats.t_quantile(0.95, 10) == pytest.approx(1.812, abs=5e-4)
  assert stats.t_quantile(0.995, 1) == pytest.approx(63.657, abs=5e-3)
  assert stats.t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)  # the normal limit
  assert stats.t_quantile(0.025, 7) == pytest.approx(-stats.t_quantile(0.975, 7))
  assert stats.t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
  # df = 1 is Cauchy: F(t) = 1/2 + atan(t)/pi.
  for t in (-3.0, 0.3, 1.0, 7.0):
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_paired_t_interval_by_hand():
  a, b = [0.50, 0.62, 0.55, 0.70], [0.40, 0.58, 0.49, 0.60]
  d = np.subtract(a, b)
  r = stats.paired_difference(a, b)
  half = 3.182446 * d.std(ddof=1) / 2.0  # t_{3, 0.975} * sd / sqrt(4)
  assert r['method'] == 't' and r['n'] == 4
  assert r['mean'] == pytest.approx(d.mean())
  assert (r['lo'], r['hi']) == pytest.approx((d.mean() - half, d.mean() + half), abs=1e-6)
  # A 90 % interval is narrower.
  r90 = stats.paired_difference(a, b, level=0.9)
  assert r['lo'] < r90['lo'] < r90['hi'] < r['hi']


def test_bootstrap_is_reproducible_and_brackets_the_mean():
  rng = np.random.default_rng(1)
  a, b = rng.normal(1.0, 1.0, 12), rng.normal(0.0, 1.0, 12)
  r1 = stats.paired_difference(a, b, method='bootstrap', seed=3)
  r2 = stats.paired_difference(a, b, method='bootstrap', seed=3)
  assert r1 == r2 and r1['method'] == 'bootstrap'
  assert r1['lo'] < r1['mean'] < r1['hi']
  # Roughly the t interval for a moderate n (the percentile bootstrap is a bit narrower).
  t = stats.paired_difference(a, b)
  assert abs((r1['hi'] - r1['lo']) / (t['hi'] - t['lo']) - 1) < 0.3
  # Two pairs: the resample means are d0, (d0 + d1) / 2, d1 -> the 2.5 / 97.5 % ends are d0, d1.
  r = stats.paired_difference([1.0, 3.0], [0.0, 0.0], method='bootstrap')
  assert (r['lo'], r['hi']) == (1.0, 3.0)


@pytest.mark.parametrize('method', stats.METHODS)
def test_identical_inputs_give_a_zero_width_interval_at_zero(method):
  a = [0.3, 0.5, 0.9]
  r = stats.paired_difference(a, list(a), method=method)
  assert r['mean'] == r['lo'] == r['hi'] == 0.0 and r['n'] == 3


@pytest.mark.parametrize('method', stats.METHODS)
def test_one_pair_has_a_nan_interval_and_none_raises(method):
  r = stats.paired_difference([0.7], [0.5], method=method)
  assert r['mean'] == pytest.approx(0.2) and r['n'] == 1
  assert math.isnan(r['lo']) and math.isnan(r['hi'])
  with pytest.raises(ValueError, match='at least one pair'):
    stats.paired_difference([], [], method=method)
  with pytest.raises(ValueError, match='differ in length'):
    stats.paired_difference([1.0, 2.0], [1.0], method=method)
  with pytest.raises(ValueError, match='unknown interval method'):
    stats.paired_difference([1.0], [1.0], method='wilcoxon')


def test_min_detectable_effect_by_hand():
  # (t_{0.975, n-1} + t_{0.8, n-1}) sd / sqrt(n), quantiles from standard tables (issue 42).
  assert stats.min_detectable_effect(1.0, 10) == pytest.approx((2.262157 + 0.883404) / math.sqrt(10),
                                                               abs=1e-5)
  assert stats.min_detectable_effect(0.02, 5) == pytest.approx(0.02 * (2.776445 + 0.940965) /
                                                               math.sqrt(5), abs=1e-6)
  with pytest.raises(ValueError, match='n >= 2'):
    stats.min_detectable_effect(1.0, 1)


def test_spearman_by_hand():
  # No ties: 1 - 6 sum(d^2) / (n (n^2 - 1)) = 1 - 6 * 4 / 120.
  assert stats.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
  # A tie shares the average rank 2.5: Pearson of ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4).
  assert stats.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
  assert math.isnan(stats.spearman([2, 2, 2], [1, 2, 3]))
