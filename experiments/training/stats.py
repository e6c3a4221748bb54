"""Paired statistics over seeds (pure numpy + math, no scipy).

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

METHODS = ('t', 'bootstrap')


def _betacf(a: float, b: float, x: float) -> float:
  """Continued fraction of the regularized incomplete beta (modified Lentz)."""
  tiny, eps = 1e-300, 1e-15
  qab, qap, qam = a + b, a + 1.0, a - 1.0
  c, d = 1.0, 1.0 - qab * x / qap
  d = 1.0 / (d if abs(d) > tiny else tiny)
  h = d
  for m in range(1, 10000):
    m2 = 2 * m
    for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
      d = 1.0 + num * d
      d = 1.0 / (d if abs(d) > tiny else tiny)
      c = 1.0 + num / c
      c = c if abs(c) > tiny else tiny
      h *= d * c
    if abs(d * c - 1.0) < eps:
      break
  return h


def betainc(a: float, b: float, x: float) -> float:
  """Regularized incomplete beta I_x(a, b) for a, b > 0, 0 <= x <= 1."""
  if x <= 0.0:
    return 0.0
  if x >= 1.0:
    return 1.0
  lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
  if x < (a + 1.0) / (a + b + 2.0):
    return math.exp(lbt) * _betacf(a, b, x) / a
  return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
  """Student t CDF with df degrees of freedom."""
  tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
  return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
  """Student t quantile (inverse CDF) by bisection on `t_cdf`, 0 < p < 1."""
  if not 0.0 < p < 1.0:
    raise ValueError(f'p must be in (0, 1), got {p}')
  if p < 0.5:
    return -t_quantile(1.0 - p, df)
  lo, hi = 0.0, 1.0
  while t_cdf(hi, df) < p:
    lo, hi = hi, 2.0 * hi
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if t_cdf(mid, df) < p:
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-12 * max(1.0, hi):
      break
  return 0.5 * (lo + hi)


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
