"""Log-ratio credit (credit/implied_values.py) against plain loops over groups and tokens."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
import credit.implied_values  # noqa: F401  (registers the estimators)
from groups import groups, grpo_ref

EPS = 1e-6
SHAPES = dict(sizes=(1, 4), lengths=(5,))


@functools.lru_cache(maxsize=None)
def _jitted(name, hp):
  return jax.jit(functools.partial(credit.get(name), **dict(hp)))


def est(name, rollouts, **hp):
  return _jitted(name, tuple(sorted(hp.items())))(rollouts)


def with_logprobs(g, seed, step_ends=False):
  tokens, mask, rewards = g
  rng = np.random.default_rng(seed)
  lp = (rng.normal(size=mask.shape) - 1.0).astype(np.float32)
  ref = (lp + 0.5 * rng.normal(size=mask.shape)).astype(np.float32)
  ends = (rng.random(mask.shape) < 0.3) & mask if step_ends else None
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, logprobs=lp, ref_logprobs=ref,
                         step_ends=ends)


def group_stats_ref(r, scale_by_std=True):
  """(μ, divisor, all equal) of one group, GRPO's conventions (group of one: μ 0, σ 1)."""
  g = len(r)
  if g == 1:
    return 0.0, (1.0 + EPS) if scale_by_std else 1.0, False
  equal = r.max() == r.min()
  div = 1.0 if equal or not scale_by_std else r.std(ddof=1) + EPS
  return r.mean(), div, equal


def vimpo_ref(ro, beta, lam, scale_by_std=True):
  """GAE over the implied values V(s_t) = V₀ + β Σ_{k<t} x_k, V(s_T) = 0, loop by loop."""
  mask = np.asarray(ro.mask)
  x = np.where(mask, np.asarray(ro.logprobs, np.float64) - np.asarray(ro.ref_logprobs), 0.0)
  rewards = np.asarray(ro.rewards, np.float64)
  out = np.zeros(mask.shape)
  for b in np.ndindex(rewards.shape[:-1]):
    r = rewards[b]
    g = len(r)
    mu, div, _ = group_stats_ref(r, scale_by_std)
    v0 = mu - beta * np.mean([x[b][j].sum() for j in range(g)]) if g > 1 else 0.0
    for i in range(g):
      n = int(mask[b][i].sum())
      values = [v0 + beta * x[b][i][:t].sum() for t in range(n)] + [0.0]
      deltas = [(r[i] if t == n - 1 else 0.0) + values[t + 1] - values[t] for t in range(n)]
      for t in range(n):
        out[b][i][t] = sum(lam ** (k - t) * deltas[k] for k in range(t, n)) / div
  return out


@settings(max_examples=20)
@given(groups(batch=(2,), **SHAPES), st.integers(0, 2**31 - 1), st.sampled_from([1.0, 0.7]),
       st.booleans())
def test_vimpo_matches_the_loop_reference(g, seed, lam, scale):
  r, beta = with_logprobs(g, seed), 0.3
  got = est("vimpo", r, beta=beta, lam=lam, scale_by_std=scale)
  np.testing.assert_allclose(np.asarray(got), vimpo_ref(r, beta, lam, scale), rtol=1e-4,
                             atol=1e-4)


@settings(max_examples=15)
@given(groups(batch=(2,), **SHAPES), st.integers(0, 2**31 - 1))
def test_vimpo_lambda_one_closed_form_and_identities(g, seed):
  r = with_logprobs(g, seed)
  mask, rewards = np.asarray(r.mask), np.asarray(r.rewards, np.float64)
  x = np.where(mask, np.asarray(r.logprobs, np.float64) - np.asarray(r.ref_logprobs), 0.0)
  got = np.asarray(est("vimpo", r, beta=0.1))  # the default (0.05) is covered above
  for b in np.ndindex(rewards.shape[:-1]):  # A_t = (R − V₀ − β Σ_{k<t} x_k) / divisor
    mu, div, _ = group_stats_ref(rewards[b])
    g_ = rewards.shape[-1]
    v0 = mu - 0.1 * x[b].sum(-1).mean() if g_ > 1 else 0.0
    want = (rewards[b][:, None] - v0 - 0.1 * (np.cumsum(x[b], -1) - x[b])) / div
    np.testing.assert_allclose(got[b], np.where(mask[b], want, 0.0), rtol=1e-4, atol=1e-4)
  grpo, dr = np.asarray(est("grpo", r)), np.asarray(est("dr_grpo", r))
  np.testing.assert_array_equal(est("vimpo", r, beta=0.0), grpo)
  np.testing.assert_array_equal(est("vimpo", r.replace(ref_logprobs=r.logprobs)), grpo)
  np.testing.assert_array_equal(est("vimpo", r, beta=0.0, scale_by_std=False), dr)


def step_sums_ref(x, mask, ends):
  out = np.zeros_like(x)
  for idx in np.ndindex(x.shape[:-1]):
    n, start = int(mask[idx].sum()), 0
    for t in range(n):
      if ends[idx][t] or t == n - 1:
        out[idx][start:t + 1] = x[idx][start:t + 1].sum()
        start = t + 1
  return out


@settings(max_examples=20)
@given(groups(batch=(2,), **SHAPES), st.integers(0, 2**31 - 1),
       st.sampled_from(["token", "step"]))
def test_progress_advantage_matches_the_loop_reference(g, seed, granularity):
  r, center = with_logprobs(g, seed, step_ends=True), True
  name = "progress_advantage" + ("_step" if granularity == "step" else "")
  got = np.asarray(est(name, r, coef=0.5))
  mask, rewards = np.asarray(r.mask), np.asarray(r.rewards, np.float64)
  x = np.where(mask, np.asarray(r.logprobs, np.float64) - np.asarray(r.ref_logprobs), 0.0)
  if granularity == "step":
    x = step_sums_ref(x, mask, np.asarray(r.step_ends))
  want = np.zeros(mask.shape)
  for b in np.ndindex(rewards.shape[:-1]):
    base = grpo_ref(rewards[b])
    mean = x[b][mask[b]].mean() if center and mask[b].any() else 0.0
    want[b] = np.where(mask[b], base[:, None] + 0.5 * (x[b] - mean), 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(est(name, r, coef=0.0), est("grpo", r))
  np.testing.assert_array_equal(est(name, r.replace(ref_logprobs=r.logprobs)), est("grpo", r))


@settings(max_examples=20)
@given(groups(batch=(2,), **SHAPES), st.integers(0, 2**31 - 1), st.booleans(),
       st.sampled_from([0.0, 1.0]))
def test_endogenous_reward_matches_the_loop_reference(g, seed, length_normalize, weight):
  r = with_logprobs(g, seed)
  got = np.asarray(est("endogenous", r, coef=0.2, length_normalize=length_normalize,
                       verifiable_weight=weight))
  mask, rewards = np.asarray(r.mask), np.asarray(r.rewards, np.float64)
  ref = np.asarray(r.ref_logprobs, np.float64)
  want = np.zeros(mask.shape)
  for b in np.ndindex(rewards.shape[:-1]):
    score = np.array([ref[b][i][mask[b][i]].sum() for i in range(len(rewards[b]))])
    if length_normalize:
      score = score / np.maximum(mask[b].sum(-1), 1)
    adv = grpo_ref(weight * rewards[b] + 0.2 * score)
    want[b] = np.where(mask[b], adv[:, None], 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(est("endogenous", r, coef=0.0), est("grpo", r))


def test_endogenous_prefers_the_response_the_base_model_finds_likely():
  mask = np.ones((1, 3, 4), bool)
  ref = np.log(np.array([[[0.9] * 4, [0.5] * 4, [0.1] * 4]], np.float32))
  r = credit.Rollouts(tokens=np.zeros((1, 3, 4), np.int32), mask=mask,
                      rewards=np.ones((1, 3), np.float32), ref_logprobs=ref)
  adv = np.asarray(credit.get("endogenous")(r))[0, :, 0]  # all rewards equal: E decides
  assert adv[0] > adv[1] > adv[2]


def test_jit_vmap_and_errors():
  rng = np.random.default_rng(3)
  g = (rng.integers(0, 3, (3, 4, 6)).astype(np.int32),
       np.arange(6) < rng.integers(0, 7, (3, 4))[..., None],
       (rng.random((3, 4)) < 0.5).astype(np.float32))
  r = with_logprobs(g, 0, step_ends=True)
  for name in ("vimpo", "progress_advantage", "progress_advantage_step", "endogenous"):
    whole = np.asarray(jax.jit(credit.get(name))(r))
    np.testing.assert_allclose(jax.jit(jax.vmap(credit.get(name)))(r), whole, rtol=1e-5,
                               atol=1e-6)
    assert np.all(whole[~np.asarray(r.mask)] == 0) and np.all(np.isfinite(whole))
  x = np.where(r.mask, r.logprobs - r.ref_logprobs, 0.0)  # center=False: no group mean
  np.testing.assert_allclose(jax.jit(functools.partial(credit.get("progress_advantage"),
                                                       center=False))(r),
                             np.asarray(jax.jit(credit.get("grpo"))(r)) + x, rtol=1e-5,
                             atol=1e-6)
  no_ref = r.replace(ref_logprobs=None)
  for name in ("vimpo", "progress_advantage", "endogenous"):
    with pytest.raises(ValueError, match="ref_logprobs"):
      credit.get(name)(no_ref)
  with pytest.raises(ValueError, match="logprobs"):
    credit.get("vimpo")(r.replace(logprobs=None))
  with pytest.raises(ValueError, match="step_ends"):
    credit.get("progress_advantage_step")(r.replace(step_ends=None))
  with pytest.raises(ValueError, match="beta"):
    credit.get("vimpo")(r, beta=-0.1)
  with pytest.raises(ValueError, match="lam"):
    credit.get("vimpo")(r, lam=1.5)
  with pytest.raises(ValueError, match="granularity"):
    credit.get("progress_advantage")(r, granularity="word")
  with pytest.raises(ValueError, match="coef"):
    credit.get("endogenous")(r, coef=-1.0)
  assert credit.needs("vimpo") == ("logprobs", "ref_logprobs")
  assert credit.needs("progress_advantage_step") == ("logprobs", "ref_logprobs", "step_ends")
  assert credit.needs("endogenous") == ("ref_logprobs",)
