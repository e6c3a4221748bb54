"""Paired statistics over seeds (numpy; the t quantiles from scipy).

    stats.paired_difference(acc_tempo, acc_grpo)            # paired t interval
    stats.paired_difference(a, b, method='bootstrap')       # percentile bootstrap

Both take per-seed values of two methods run with the same seeds (a[i] and b[i]
share seed i: the same prompts and the same held-out set) and describe d = a - b:
  't':         mean(d) ± t_{n-1, (1+level)/2} · sd(d) / sqrt(n)  (sd with ddof = 1).
  'bootstrap': the (1-level)/2 and (1+level)/2 quantiles of the means of
               `num_boot` resamples of d with replacement (fixed `seed`).
With n = 1 pair the mean is d[0] and both ends are nan (no spread to estimate);
n = 0 raises ValueError. With few seeds (3) the bootstrap interval is far too
narrow (only 10 distinct resamples): the t interval is the one to read.
"""

import math

import numpy as np
import scipy.stats

METHODS = ('t', 'bootstrap')


def t_cdf(t: float, df: float) -> float:
  """Student t CDF with df degrees of freedom (scipy.stats.t)."""
  return float(scipy.stats.t.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
  """Student t quantile (inverse CDF), 0 < p < 1 (scipy.stats.t)."""
  if not 0.0 < p < 1.0:
    raise ValueError(f'p must be in (0, 1), got {p}')
  return float(scipy.stats.t.ppf(p, df))


def paired_difference(a, b, level: float = 0.95, method: str = 't', num_boot: int = 10000,
                      seed: int = 0) -> dict:
  """Mean of a - b over pairs with a `level` interval -> dict(mean, lo, hi, n, method)."""
  a, b = np.asarray(a, float).ravel(), np.asarray(b, float).ravel()
  if a.shape != b.shape:
    raise ValueError(f'paired inputs differ in length: {a.size} vs {b.size}')
  if a.size == 0:
    raise ValueError('paired_difference needs at least one pair')
  if method not in METHODS:
    raise ValueError(f'unknown interval method {method!r}; valid: {", ".join(METHODS)}')
  if not 0.0 < level < 1.0:
    raise ValueError(f'level must be in (0, 1), got {level}')
  d = a - b
  n, mean = d.size, float(d.mean())
  lo = hi = float('nan')
  if n > 1 and method == 't':
    half = t_quantile(0.5 + level / 2.0, n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    lo, hi = mean - half, mean + half
  elif n > 1:
    idx = np.random.default_rng(seed).integers(0, n, size=(num_boot, n))
    lo, hi = (float(q) for q in np.quantile(d[idx].mean(1), [0.5 - level / 2, 0.5 + level / 2]))
  return dict(mean=mean, lo=lo, hi=hi, n=int(n), method=method, level=level)


# ----------------------------------------------------------------------------
# Power and rank correlation (issue 42: the credit-sensitivity study).


def min_detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
  """The smallest true mean paired difference a two-sided paired t test at level `alpha`
  detects with probability `power` over `n` pairs whose differences have standard
  deviation `sd` (issue 42):

      MDE = (t_{1-alpha/2, n-1} + t_{power, n-1}) · sd / sqrt(n).

  The usual closed form (the noncentral t replaced by a shifted central t); its exact
  power at the MDE is within about 0.02 of `power` for n >= 5 (tests/test_sensitivity.py).
  sd = 0 gives 0. Raises ValueError for n < 2 (no spread to estimate), a non-finite or
  negative sd, alpha outside (0, 1) or power outside (0, 1).
  """
  if not (isinstance(n, (int, np.integer)) and n >= 2):
    raise ValueError(f'min_detectable_effect needs n >= 2 pairs (an int), got {n!r}')
  if not (math.isfinite(sd) and sd >= 0):
    raise ValueError(f'sd must be finite and >= 0, got {sd!r}')
  if not 0.0 < alpha < 1.0:
    raise ValueError(f'alpha must be in (0, 1), got {alpha}')
  if not 0.0 < power < 1.0:
    raise ValueError(f'power must be in (0, 1), got {power}')
  df = n - 1
  return (t_quantile(1.0 - alpha / 2.0, df) + t_quantile(power, df)) * float(sd) / math.sqrt(n)


def _points(x, y):
  """x, y as float arrays of equal length >= 2 and finite values, else ValueError."""
  x, y = np.asarray(x, float).ravel(), np.asarray(y, float).ravel()
  if x.shape != y.shape:
    raise ValueError(f'spearman inputs differ in length: {x.size} vs {y.size}')
  if x.size < 2:
    raise ValueError(f'spearman needs at least 2 points, got {x.size}')
  if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
    raise ValueError('spearman inputs must be finite (drop the nan points first)')
  return x, y


def _rank_corr(rx, ry):
  """Pearson correlation along the last axis of rank arrays; nan where either is constant."""
  rx = rx - rx.mean(-1, keepdims=True)
  ry = ry - ry.mean(-1, keepdims=True)
  den = np.sqrt((rx * rx).sum(-1) * (ry * ry).sum(-1))
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.where(den > 0, (rx * ry).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def spearman(x, y) -> float:
  """Spearman's rank correlation of paired points (issue 42): the Pearson correlation of
  their ranks, ties given their average rank (as scipy.stats.spearmanr).

  Degenerate input: a constant x or y has no ranking, so rho is undefined and nan is
  returned (not an error: a report shows it as such). ValueError for fewer than 2 points,
  lengths that differ, or a non-finite value.
  """
  x, y = _points(x, y)
  return float(_rank_corr(scipy.stats.rankdata(x), scipy.stats.rankdata(y)))


def spearman_interval(x, y, level: float = 0.95, num_boot: int = 10000, seed: int = 0) -> dict:
  """Spearman's rho with a percentile bootstrap interval over points (issue 42) ->
  dict(rho, lo, hi, n, level, num_boot, valid).

  Each of `num_boot` resamples draws n points with replacement (fixed `seed`); the ends
  are the (1-level)/2 and (1+level)/2 quantiles of the resamples' rho. Resamples whose x
  or y is constant (rho undefined: e.g. one point drawn n times) are left out; `valid`
  counts the others, and with none the ends are nan. With few points the interval is
  wide and coarse (n = 4: 35 distinct resamples): read it as such. Input checks as
  `spearman`.
  """
  x, y = _points(x, y)
  if not 0.0 < level < 1.0:
    raise ValueError(f'level must be in (0, 1), got {level}')
  if num_boot < 1:
    raise ValueError(f'num_boot must be >= 1, got {num_boot}')
  rho = spearman(x, y)
  idx = np.random.default_rng(seed).integers(0, x.size, size=(num_boot, x.size))
  boot = _rank_corr(scipy.stats.rankdata(x[idx], axis=1), scipy.stats.rankdata(y[idx], axis=1))
  boot = boot[np.isfinite(boot)]
  lo = hi = float('nan')
  if boot.size:
    lo, hi = (float(q) for q in np.quantile(boot, [0.5 - level / 2, 0.5 + level / 2]))
  return dict(rho=rho, lo=lo, hi=hi, n=int(x.size), level=level, num_boot=int(num_boot),
              valid=int(boot.size))


def auroc(scores, labels) -> float:
  """Area under the ROC curve of `scores` for binary `labels` (True = positive): the chance
  that a random positive scores above a random negative, ties counting one half (the
  Mann-Whitney U over n₊·n₋, from average ranks). −inf scores rank last. Degenerate input:
  with no positive or no negative the area is undefined and nan is returned (as `spearman`
  does for a constant input). ValueError for lengths that differ or a nan score.
  """
  s, y = np.asarray(scores, float).ravel(), np.asarray(labels).ravel()
  if s.shape != y.shape:
    raise ValueError(f'auroc: {s.size} scores but {y.size} labels')
  if np.isnan(s).any():
    raise ValueError('auroc: a score is nan')
  y = y.astype(bool)
  pos, neg = int(y.sum()), int((~y).sum())
  if pos == 0 or neg == 0:
    return float('nan')
  ranks = scipy.stats.rankdata(s)
  return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))
