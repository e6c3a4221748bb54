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
