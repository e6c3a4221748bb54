"""Polarity-asymmetric advantages and curricula (credit/polarity.py) against numpy loops."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
import credit.polarity  # noqa: F401  (registers the estimators)
from groups import groups, grpo_ref

EPS = 1e-6
SHAPES = dict(sizes=(1, 4), lengths=(5,))  # few shapes: each one compiles once


@functools.lru_cache(maxsize=None)
def _jitted(name, hp):
  return jax.jit(functools.partial(credit.get(name), **dict(hp)))


def est(name, rollouts, **hp):
  """credit.get(name)(rollouts, **hp), jitted once per (name, hparams, shape)."""
  return _jitted(name, tuple(sorted(hp.items())))(rollouts)


def weighted(adv, wp, wn):
  return np.vectorize(lambda a: wp * a if a > 0 else wn * a)(adv)


def tokens_of(per_response, mask):
  return np.where(mask, np.asarray(per_response)[..., None], 0.0)


def make(tokens, mask, rewards, **fields):
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, **fields)


def assert_close(adv, want):
  np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=15)
@given(groups(batch=(2,), **SHAPES))
def test_polarity_nsr_wapo_match_numpy(g):
  tokens, mask, rewards = g
  wp, wn = 2.5, 0.3
  r = make(tokens, mask, rewards)
  a = grpo_ref(rewards)
  assert_close(est("polarity", r, positive_weight=wp, negative_weight=wn),
               tokens_of(weighted(a, wp, wn), mask))
  assert_close(est("nsr", r), tokens_of(weighted(a, 0.0, 1.0), mask))
  centred = grpo_ref(rewards, scale_by_std=False)
  assert_close(est("wapo", r), tokens_of(weighted(centred, 1.0, 0.0), mask))
  assert_close(est("nsr", r, base="rloo"),
               tokens_of(weighted(rloo_ref(rewards), 0.0, 1.0), mask))


def rloo_ref(rewards):
  rewards = np.asarray(rewards, np.float64)
  g = rewards.shape[-1]
  if g == 1:
    return np.zeros_like(rewards)
  out = np.zeros_like(rewards)
  for idx in np.ndindex(rewards.shape[:-1]):
    r = rewards[idx]
    for i in range(g):
      out[idx + (i,)] = 0.0 if r.max() == r.min() else r[i] - (r.sum() - r[i]) / (g - 1)
  return out


@settings(max_examples=15)
@given(groups(batch=(2,), **SHAPES))
def test_unit_weights_are_the_base_exactly(g):
  r = make(*g)
  base = np.asarray(est("grpo", r))
  np.testing.assert_array_equal(est("polarity", r), base)
  np.testing.assert_array_equal(est("nsr", r, positive_weight=1.0), base)
  state = credit.init_state("capo")
  np.testing.assert_array_equal(est("capo", r.replace(credit_state=state), switch_step=0), base)
  np.testing.assert_array_equal(est("a_grae", r, asymmetry=False, difficulty=False), base)
  np.testing.assert_array_equal(
      est("a_grae", r, asymmetry=False, difficulty=False, scale_by_std=False),
      est("dr_grpo", r))
  np.testing.assert_array_equal(est("polarity", r, base="rloo"), est("rloo", r))


def capo_weight(step, switch, ramp):
  if ramp == 0:
    return 1.0 if step >= switch else 0.0
  return min(max((step - switch) / ramp, 0.0), 1.0)


@settings(max_examples=15)
@given(groups(batch=(2,), **SHAPES), st.integers(0, 6), st.sampled_from([0, 3]))
def test_capo_curriculum_over_steps(g, switch, ramp):
  tokens, mask, rewards = g
  r = make(tokens, mask, rewards)
  a = grpo_ref(rewards)
  state = credit.init_state("capo", switch_step=switch, ramp_steps=ramp)
  for step in range(8):
    assert int(state["step"]) == step
    got = est("capo", r.replace(credit_state=state), switch_step=switch, ramp_steps=ramp)
    assert_close(got, tokens_of(weighted(a, 1.0, capo_weight(step, switch, ramp)), mask))
    if capo_weight(step, switch, ramp) == 0:
      assert np.all(np.asarray(got) >= 0)
    state = credit.update_state("capo", state, r, switch_step=switch, ramp_steps=ramp)


def a_grae_ref(rewards, m=None, asymmetry=True, difficulty=True, alpha=1.0, scale_by_std=True):
  """The public A-GRAE formula with loops; m (training progress) defaults to this batch's."""
  rewards = np.asarray(rewards, np.float64)
  a0 = grpo_ref(rewards, scale_by_std)
  p = np.clip(rewards.mean(-1), 0.0, 1.0)
  if m is None:
    m = p.mean()
  out = np.zeros_like(a0)
  for idx in np.ndindex(rewards.shape[:-1]):
    for i in range(rewards.shape[-1]):
      s = a0[idx + (i,)]
      if difficulty:
        q = math.sqrt(p[idx])
        s = ((1 - m) * 0.5 * s / (1 - q + EPS) + m * 0.5 * s / (q + EPS)) if 0 < p[idx] < 1 else 0
      if asymmetry and s > 0:
        s *= min(1.0, m / alpha)
      out[idx + (i,)] = s
  return out


@settings(max_examples=20)
@given(groups(batch=(3,), **SHAPES), st.booleans(), st.booleans(), st.sampled_from([0.5, 1.0]))
def test_a_grae_matches_the_public_formula(g, asymmetry, difficulty, alpha):
  tokens, mask, rewards = g
  r = make(tokens, mask, rewards)
  got = est("a_grae", r, asymmetry=asymmetry, difficulty=difficulty, alpha=alpha)
  want = a_grae_ref(rewards, asymmetry=asymmetry, difficulty=difficulty, alpha=alpha)
  np.testing.assert_allclose(np.asarray(got), tokens_of(want, mask), rtol=1e-4, atol=1e-4)
  assert np.all(np.isfinite(np.asarray(got)))


def test_a_grae_suppresses_positives_early_and_shifts_to_hard_groups():
  # Three groups of 4 binary rewards: easy (p = 3/4), medium (1/2), hard (1/4).
  rewards = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
  mask = np.ones((3, 4, 2), bool)
  r = make(np.zeros((3, 4, 2), np.int32), mask, rewards)
  # One batch seen, decay 0.9: the bias-corrected m is ema / (1 − 0.9).
  low = {"ema": jnp.float32(0.02), "count": jnp.int32(1)}  # m = 0.2: early training
  high = {"ema": jnp.float32(0.09), "count": jnp.int32(1)}  # m = 0.9: late training
  early = np.asarray(credit.get("a_grae")(r.replace(credit_state=low), progress="ema"))[..., 0]
  late = np.asarray(credit.get("a_grae")(r.replace(credit_state=high), progress="ema"))[..., 0]
  np.testing.assert_allclose(early, a_grae_ref(rewards, m=0.2), rtol=1e-4)
  np.testing.assert_allclose(late, a_grae_ref(rewards, m=0.9), rtol=1e-4)
  grpo = grpo_ref(rewards)
  # Early: positives are scaled by m = 0.2 relative to negatives; easy groups weigh more.
  ratio = lambda a: a[a > 0].max() / -a[a < 0].min()
  assert ratio(early[1]) == pytest.approx(0.2 * ratio(grpo[1]), rel=1e-3)
  assert np.abs(early[0]).max() > np.abs(early[2]).max()
  assert np.abs(late[2]).max() > np.abs(late[0]).max()  # late: hard groups weigh more
  with pytest.raises(ValueError, match="credit_state"):
    credit.get("a_grae")(r, progress="ema")


def test_a_grae_ema_state_is_a_bias_corrected_ema_of_batch_pass_rates():
  rng = np.random.default_rng(0)
  state = credit.init_state("a_grae", ema_decay=0.5)
  means = []
  for step in range(4):
    rewards = (rng.random((5, 4)) < 0.3 + 0.15 * step).astype(np.float32)
    r = make(np.zeros((5, 4, 3), np.int32), np.ones((5, 4, 3), bool), rewards)
    got = credit.get("a_grae")(r.replace(credit_state=state), progress="ema", ema_decay=0.5)
    m = rewards.mean(-1).mean()
    if means:  # m before this batch: bias-corrected EMA of the earlier batches
      w = np.array([0.5 ** (len(means) - 1 - k) for k in range(len(means))])
      want_m = (w * np.array(means)).sum() / w.sum()
    else:
      want_m = m
    np.testing.assert_allclose(np.asarray(got)[..., 0], a_grae_ref(rewards, m=want_m),
                               rtol=1e-4, atol=1e-5)
    means.append(m)
    state = credit.update_state("a_grae", state, r, ema_decay=0.5)
  assert int(state["count"]) == 4


def test_drop_suppressed_takes_the_zero_weight_polarity_out_of_the_loss():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0, 0.5], [0.3, 0.3, 0.3, 0.3, 0.3]], np.float32)
  mask = np.arange(4) < np.array([[4, 3, 2, 4, 1], [4, 4, 0, 2, 3]])[..., None]
  r = make(np.zeros((2, 5, 4), np.int32), mask, rewards)
  a = grpo_ref(rewards)[..., None]
  adv = credit.get("nsr")(r)
  np.testing.assert_array_equal(credit.loss_mask("nsr", r, adv), mask)
  np.testing.assert_array_equal(credit.loss_mask("nsr", r, adv, drop_suppressed=True),
                                mask & ~(a > 0))
  np.testing.assert_array_equal(credit.loss_mask("wapo", r, adv, drop_suppressed=True),
                                mask & ~(a < 0))
  state = credit.init_state("capo")
  early = r.replace(credit_state=state)
  np.testing.assert_array_equal(credit.loss_mask("capo", early, adv, drop_suppressed=True),
                                mask & ~(a < 0))
  late = r.replace(credit_state={"step": jnp.int32(25)})
  np.testing.assert_array_equal(credit.loss_mask("capo", late, adv, drop_suppressed=True), mask)


def test_jit_and_vmap():
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 3, (4, 6, 5)).astype(np.int32)
  mask = np.arange(5) < rng.integers(0, 6, (4, 6))[..., None]
  rewards = (rng.random((4, 6)) < 0.5).astype(np.float32)
  r = make(tokens, mask, rewards)
  for name, hp in [("nsr", {}), ("wapo", {}), ("polarity", dict(positive_weight=0.5))]:
    est = functools.partial(credit.get(name), **hp)
    eager = np.asarray(est(r))
    np.testing.assert_allclose(jax.jit(est)(r), eager, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.vmap(est)(r), eager, rtol=1e-6, atol=1e-7)
  state = {"step": jnp.int32(3)}
  capo = lambda x: credit.get("capo")(x.replace(credit_state=state), switch_step=5)
  np.testing.assert_allclose(jax.vmap(capo)(r), jax.jit(capo)(r), rtol=1e-6)
  np.testing.assert_allclose(jax.jit(capo)(r), weighted(np.asarray(credit.get("grpo")(r)), 1, 0),
                             rtol=1e-6)
  # a_grae 'batch': m is the mean over the call's leading dims (per group under vmap).
  a = jax.jit(functools.partial(credit.get("a_grae")))(r)
  np.testing.assert_allclose(a, tokens_of(a_grae_ref(rewards), mask), rtol=1e-4, atol=1e-5)


def test_errors_name_the_problem():
  r = make(np.zeros((2, 3, 2), np.int32), np.ones((2, 3, 2), bool), np.ones((2, 3), np.float32))
  with pytest.raises(ValueError, match="credit_state"):
    credit.get("capo")(r)
  with pytest.raises(ValueError, match="positive_weight"):
    credit.get("polarity")(r, positive_weight=-1.0)
  with pytest.raises(ValueError, match="negative_weight"):
    credit.get("polarity")(r, negative_weight=float("nan"))
  with pytest.raises(ValueError, match="needs"):
    credit.get("nsr")(r, base="frpo")
  with pytest.raises(ValueError, match="state"):
    credit.get("polarity")(r, base="capo")
  with pytest.raises(ValueError, match="another estimator"):
    credit.get("wapo")(r, base="wapo")
  with pytest.raises(ValueError, match="unknown credit estimator"):
    credit.get("nsr")(r, base="nope")
  with pytest.raises(ValueError, match="switch_step"):
    credit.get("capo")(r.replace(credit_state=credit.init_state("capo")), switch_step=-1)
  with pytest.raises(ValueError, match="alpha"):
    credit.get("a_grae")(r, alpha=0.0)
  with pytest.raises(ValueError, match="progress"):
    credit.get("a_grae")(r, progress="epoch")
  assert credit.stateful("capo") and credit.stateful("a_grae")
  assert not credit.stateful("nsr") and credit.needs("wapo") == ()
