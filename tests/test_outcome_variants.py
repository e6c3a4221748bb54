"""QAE, NGRPO, Pass@k, PURE and FRPO against numpy / plain-Python references."""

import math

import chex
import jax
import numpy as np
import pytest

import credit


def rollouts(rewards, l=4, **fields):
  rewards = np.asarray(rewards, np.float32)
  shape = rewards.shape + (l,)
  mask = np.arange(l) < np.random.default_rng(0).integers(1, l + 1, rewards.shape)[..., None]
  return credit.Rollouts(tokens=np.zeros(shape, np.int32), mask=mask, rewards=rewards, **fields)


def per_response(adv, mask):
  """The value on each response's first token (outcome estimators repeat it)."""
  adv = np.asarray(adv)
  assert np.all(adv[~mask] == 0)
  return adv[..., 0]


REWARDS = np.random.default_rng(1).integers(0, 2, (16, 8)).astype(np.float32)
REWARDS[0], REWARDS[1] = 0.0, 1.0  # all wrong, all right
GRADED = np.random.default_rng(2).integers(0, 5, (8, 6)).astype(np.float32) / 4


@pytest.mark.parametrize("quantile", [0.0, 0.3, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("rewards", [REWARDS, GRADED], ids=["binary", "graded"])
def test_qae_baseline_is_the_inverted_cdf_quantile(quantile, rewards):
  r = rollouts(rewards)
  adv = per_response(credit.get("qae")(r, quantile=quantile), r.mask)
  b = np.quantile(rewards, quantile, axis=-1, method="inverted_cdf", keepdims=True)
  np.testing.assert_allclose(adv, rewards - b, atol=1e-6)


def test_qae_binary_credits_only_successes_or_only_failures():
  r = rollouts(REWARDS)
  adv = per_response(credit.get("qae")(r, quantile=0.6), r.mask)
  p = REWARDS.mean(-1)
  for i in range(len(p)):
    if p[i] <= 1 - 0.6:
      assert np.all(adv[i][REWARDS[i] == 0] == 0)
    else:
      assert np.all(adv[i][REWARDS[i] == 1] == 0)


def test_ngrpo_adds_one_virtual_best_sample():
  r = rollouts(REWARDS)
  adv = per_response(credit.get("ngrpo")(r), r.mask)
  aug = np.concatenate([REWARDS, np.ones((len(REWARDS), 1))], -1).astype(np.float64)
  want = (REWARDS - aug.mean(-1, keepdims=True)) / (aug.std(-1, ddof=1, keepdims=True) + 1e-6)
  want[1] = 0.0  # all at the maximum: exactly 0
  np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
  assert np.all(adv[0] < 0)  # all-wrong groups still get a (negative) signal
  assert np.all(adv[1] == 0)


def comb_ratio(a, b, k):
  return math.comb(a, k) / math.comb(b, k) if a >= k else 0.0


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_passk_matches_the_binomial_formula(k):
  r = rollouts(REWARDS)
  adv = per_response(credit.get("passk")(r, k=k), r.mask)
  n = REWARDS.shape[-1]
  for i, row in enumerate(REWARDS):
    c = int(row.sum())
    rho = 1 - comb_ratio(n - c, n, k)
    sigma = math.sqrt(rho * (1 - rho))
    for j, x in enumerate(row):
      if sigma == 0:
        want = 0.0
      elif x:
        want = (1 - rho) / sigma
      else:
        want = (1 - rho - comb_ratio(n - c - 1, n - 1, k - 1)) / sigma
      assert adv[i, j] == pytest.approx(want, rel=1e-4, abs=1e-5), (i, j, c)


def test_pass1_is_grpo_with_the_population_std():
  r = rollouts(REWARDS)
  adv = per_response(credit.get("passk")(r, k=1), r.mask)
  std = REWARDS.std(-1, keepdims=True)
  want = np.where(std > 0, (REWARDS - REWARDS.mean(-1, keepdims=True)) / np.maximum(std, 1e-9), 0)
  np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="1 <= k"):
    credit.get("passk")(r, k=9)


def pure_reference(token_rewards, mask, rewards, temperature, form):
  g, l = mask.shape
  returns = np.zeros((g, l))
  for i in range(g):
    n = int(mask[i].sum())
    r = token_rewards[i, :n].astype(np.float64)
    w = np.exp(-r / temperature - np.max(-r / temperature)) if n else r
    w = w / w.sum() if form == "min" and n else np.ones(n)
    step = w * r
    step[n - 1:n] += rewards[i]
    returns[i, :n] = np.cumsum(step[::-1])[::-1]
  g0 = returns[:, 0]
  base = (g0.sum() - g0) / (g - 1)
  return np.where(mask, returns - base[:, None], 0.0)


@pytest.mark.parametrize("form", ["min", "sum"])
def test_pure_min_and_sum_forms(form):
  rng = np.random.default_rng(3)
  r = rollouts(REWARDS[2:4], l=6)
  tr = rng.normal(size=r.mask.shape).astype(np.float32)
  adv = credit.get("pure")(r.replace(token_rewards=tr), form=form, temperature=0.5)
  for b in range(2):
    np.testing.assert_allclose(adv[b], pure_reference(tr[b], r.mask[b], REWARDS[2 + b], 0.5, form),
                               rtol=1e-4, atol=1e-5)


def test_pure_min_form_tends_to_the_minimum_and_reduces_to_rloo():
  r = rollouts(REWARDS[2:4], l=6)
  tr = np.random.default_rng(4).normal(size=r.mask.shape).astype(np.float32)
  with_process = r.replace(token_rewards=tr, rewards=np.zeros_like(r.rewards))
  adv = np.asarray(credit.get("pure")(with_process, temperature=1e-3))
  returns0 = adv[..., 0]  # G_0 − b
  g0 = np.where(r.mask, tr, np.inf).min(-1)
  base = (g0.sum(-1, keepdims=True) - g0) / (g0.shape[-1] - 1)
  np.testing.assert_allclose(returns0, g0 - base, atol=1e-3)
  np.testing.assert_array_equal(credit.get("pure")(r), credit.get("rloo")(r))


def test_frpo_subtracts_the_future_log_ratio():
  rng = np.random.default_rng(5)
  r = rollouts(REWARDS[:4], l=5)
  lp = rng.normal(size=r.mask.shape).astype(np.float32)
  ref = rng.normal(size=r.mask.shape).astype(np.float32)
  adv = credit.get("frpo")(r.replace(logprobs=lp, ref_logprobs=ref), beta=0.1)
  ratio = np.where(r.mask, lp - ref, 0.0)
  future = np.cumsum(ratio[..., ::-1], -1)[..., ::-1]
  np.testing.assert_allclose(adv, credit.get("grpo")(r) - 0.1 * future, rtol=1e-5, atol=1e-6)
  same = credit.get("frpo")(r.replace(logprobs=lp, ref_logprobs=lp))
  np.testing.assert_array_equal(same, credit.get("grpo")(r))
  with pytest.raises(ValueError, match="ref_logprobs"):
    credit.get("frpo")(r)
  assert credit.needs("frpo") == ("logprobs", "ref_logprobs")


@pytest.mark.parametrize("name", ["qae", "ngrpo", "passk", "pure", "frpo"])
def test_jit_and_group_of_one(name):
  lp = np.zeros((16, 8, 4), np.float32)
  r = rollouts(REWARDS, logprobs=lp, ref_logprobs=lp)
  fn = credit.get(name)
  np.testing.assert_allclose(jax.jit(fn)(r), fn(r), atol=1e-6)
  hp = dict(k=1) if name == "passk" else {}
  one = rollouts(REWARDS[:, :1], logprobs=lp[:, :1], ref_logprobs=lp[:, :1])
  chex.assert_tree_all_finite(fn(one, **hp))
