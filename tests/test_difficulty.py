"""MAPO, HA-DW, AAPO, ADORA, DDCA, DVAO and COPO (credit/difficulty.py) against plain-Python
references, their reductions to GRPO, their state across steps, errors and degenerate groups."""

import functools
import math

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
import credit.difficulty  # noqa: F401  (registers the estimators)
from groups import groups, grpo_ref

NAMES = ["mapo", "hadw", "aapo", "aapo_history", "adora", "ddca", "dvao", "copo"]
GROUPS = groups(sizes=(1, 5), lengths=(1, 6), batch=(3,))  # four shapes: few compiles
SEEDS = st.integers(0, 2**31 - 1)


@functools.lru_cache(maxsize=None)
def _jitted(name, hp):
  return jax.jit(functools.partial(credit.get(name), **dict(hp)))


def run(name, r, **hp):
  """credit.get(name)(r, **hp), jitted once per (name, hparams, shape)."""
  return _jitted(name, tuple(sorted(hp.items())))(r)


@functools.partial(jax.jit, static_argnums=(0, 3))
def update(name, state, r, hp):
  return credit.update_state(name, state, r, **dict(hp))


def make(group, seed):
  tokens, mask, rewards = group
  rng = np.random.default_rng(seed)
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards,
                         token_rewards=rng.normal(size=mask.shape).astype(np.float32),
                         ref_rewards=rng.integers(0, 2, rewards.shape[:-1]).astype(np.float32))


def fixed(g=4, l=6, b=3, seed=0):
  rng = np.random.default_rng(seed)
  mask = np.arange(l) < rng.integers(1, l + 1, (b, g))[..., None]
  return make((rng.integers(0, 4, (b, g, l)).astype(np.int32), mask,
               rng.integers(0, 2, (b, g)).astype(np.float32)), seed + 1)


def check(adv, want, mask, rtol=1e-4, atol=1e-5):
  adv = np.asarray(adv)
  assert np.all(adv[~mask] == 0)
  np.testing.assert_allclose(adv, np.where(mask, np.asarray(want)[..., None], 0.0),
                             rtol=rtol, atol=atol)


def lengths_of(r):
  return r.mask.sum(-1)


# --- MAPO ----------------------------------------------------------------------------------

def mapo_ref(r, mix):
  out = np.zeros(r.rewards.shape)
  for b, rew in enumerate(r.rewards.astype(np.float64)):
    out[b] = grpo_ref(rew)
    if len(rew) > 1:
      p = np.mean(rew > 0.5)
      lam = mix * (1 - 4 * p * (1 - p))
      apd = np.zeros_like(rew) if rew.max() == rew.min() else (
          (rew - rew.mean()) / (abs(rew.mean()) + 1e-6))
      out[b] = (1 - lam) * out[b] + lam * apd
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, SEEDS)
def test_mapo_matches_the_reference(group, seed):
  r = make(group, seed)
  check(run("mapo", r, mix=0.8), mapo_ref(r, 0.8), r.mask)


def test_mapo_uses_percent_deviation_on_certain_groups():
  # The paper's "advantage reversion" example: [0.9, 1, 1, 1] is certain (p = 1, λ = 1).
  r = credit.Rollouts(tokens=np.zeros((3, 4, 6), np.int32), mask=np.ones((3, 4, 6), bool),
                      rewards=np.array([[0.9, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]], np.float32))
  adv = np.asarray(credit.get("mapo")(r))[..., 0]
  np.testing.assert_allclose(adv[0], (r.rewards[0] - 0.975) / 0.975, rtol=1e-5)
  np.testing.assert_allclose(adv[1], np.asarray(credit.get("grpo")(r))[1, :, 0])  # p = ½: GRPO


# --- HA-DW ---------------------------------------------------------------------------------

def hadw_ref_step(r, state, eta, lam, window):
  anchor, history, count = state
  y = float(np.mean(r.rewards.astype(np.float64)))
  if count == 0:
    rate = 1.0
  else:
    last = history[-window:]
    sigma = float(np.std(last)) if len(last) >= 2 else 1.0
    rate = min(max(eta * sigma, 0.0), 1.0)
  anchor = (1 - rate) * anchor + rate * y
  out = np.zeros(r.rewards.shape)
  for b, rew in enumerate(r.rewards.astype(np.float64)):
    a = grpo_ref(rew)
    diff = rew.mean() - anchor
    out[b] = a * lam * np.exp(-np.sign(a) * np.sign(diff) * abs(diff))
  return out, (anchor, history + [anchor], count + 1)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(GROUPS, SEEDS), min_size=5, max_size=5))
def test_hadw_follows_the_evolving_anchor(batches):
  hp = dict(eta=0.8, lambda_scale=1.3, window=3)
  state, ref = credit.init_state("hadw", **hp), (0.0, [], 0)
  for group, seed in batches:
    r = make(group, seed).replace(credit_state=state)
    want, ref = hadw_ref_step(r, ref, 0.8, 1.3, 3)
    check(run("hadw", r, **hp), want, r.mask)
    state = update("hadw", state, r, tuple(hp.items()))
    np.testing.assert_allclose(state["anchor"], ref[0], rtol=1e-5, atol=1e-6)
    assert int(state["count"]) == ref[2]


def test_hadw_at_the_anchor_is_grpo_and_shifts_credit_to_hard_groups():
  rewards = np.array([[1, 0, 1, 0]] * 3, np.float32)  # every group at pass rate ½
  r = credit.Rollouts(tokens=np.zeros((3, 4, 6), np.int32), mask=np.ones((3, 4, 6), bool),
                      rewards=rewards)
  at = {"anchor": np.float32(0.5), "history": np.full(4, 0.5, np.float32),
        "count": np.int32(2)}
  np.testing.assert_array_equal(credit.get("hadw")(r.replace(credit_state=at), window=4),
                                credit.get("grpo")(r))
  hard = r.replace(rewards=np.array([[1, 0, 0, 0]] * 3, np.float32),
                   credit_state={**at, "history": np.array([0.5, 0.4, 0.5, 0.4], np.float32)})
  adv = np.asarray(credit.get("hadw")(hard, window=4))[..., 0]
  base = np.asarray(credit.get("grpo")(hard))[..., 0]
  assert np.all(adv[base > 0] > base[base > 0]) and np.all(adv[base < 0] > base[base < 0])
  with pytest.raises(ValueError, match="window"):
    credit.init_state("hadw", window=1)
  with pytest.raises(ValueError, match="lambda_scale"):
    credit.get("hadw")(r, lambda_scale=0.0)


# --- AAPO ----------------------------------------------------------------------------------

@given(GROUPS, SEEDS)
def test_aapo_adds_the_clipped_margin_over_the_reference_models_reward(group, seed):
  r = make(group, seed)
  want = np.stack([grpo_ref(row) for row in r.rewards])
  want += 0.7 * np.clip(r.rewards - r.ref_rewards[..., None], -0.2, 0.28)
  check(run("aapo", r, coef=0.7), want, r.mask)


def test_aapo_without_reference_rewards_is_refused_by_name():
  with pytest.raises(ValueError, match="ref_rewards"):
    credit.get("aapo")(fixed().replace(ref_rewards=None))
  with pytest.raises(ValueError, match="ref_rewards"):  # one per group, not per response
    credit.validate(fixed().replace(ref_rewards=np.zeros((3, 4), np.float32)))
  with pytest.raises(ValueError, match="ref_rewards must be finite"):
    credit.validate(fixed().replace(ref_rewards=np.array([0.0, np.nan, 1.0], np.float32)))
  assert credit.validate(fixed()).ref_rewards is not None


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(GROUPS, SEEDS), min_size=3, max_size=3))
def test_aapo_history_adds_the_clipped_margin_over_the_tracked_reward(batches):
  hp = dict(coef=0.7, momentum=0.4)
  state, (ref, count) = credit.init_state("aapo_history", **hp), (0.0, 0)
  for group, seed in batches:
    r = make(group, seed).replace(credit_state=state)
    mean = float(np.mean(r.rewards.astype(np.float64)))
    used = mean if count == 0 else ref
    want = np.stack([grpo_ref(row) for row in r.rewards])
    want += 0.7 * np.clip(r.rewards - used, -0.2, 0.28)
    check(run("aapo_history", r, **hp), want, r.mask)
    rate = 1.0 if count == 0 else 0.4
    ref, count = (1 - rate) * ref + rate * mean, count + 1
    state = update("aapo_history", state, r, tuple(hp.items()))
    np.testing.assert_allclose(state["reference"], ref, rtol=1e-5, atol=1e-6)


# --- ADORA ---------------------------------------------------------------------------------

def adora_ref(r, weight, favoured, cap):
  out = np.zeros(r.rewards.shape)
  for b, rew in enumerate(r.rewards):
    n = lengths_of(r)[b]
    pos = [n[i] for i in range(len(rew)) if rew[i] > 0.5]
    neg = [n[i] for i in range(len(rew)) if rew[i] <= 0.5 and n[i] < cap]
    max_pos = max(pos) if pos else -math.inf
    mean_neg = float(np.mean(neg)) if neg else -math.inf
    out[b] = grpo_ref(rew) * (favoured if max_pos > mean_neg else weight)
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, SEEDS)
def test_adora_matches_the_reference(group, seed):
  r = make(group, seed)
  check(run("adora", r, weight=0.2, favoured_weight=1.5),
        adora_ref(r, 0.2, 1.5, r.mask.shape[-1]), r.mask)
  check(run("adora", r, truncation_length=4), adora_ref(r, 0.1, 1.0, 4), r.mask)


# --- DDCA ----------------------------------------------------------------------------------

def ddca_ref(r, beta, dynamic):
  out = np.zeros(r.rewards.shape)
  for b, rew in enumerate(r.rewards):
    n = lengths_of(r)[b].astype(np.float64)
    correct = rew > 0.5
    a_len = np.zeros(len(rew))
    if correct.any():
      mu, sigma = n[correct].mean(), n[correct].std()
      with np.errstate(over="ignore"):
        s = 1 / (1 + np.exp(-(n - mu) / (sigma + 1e-8)))
      a_len[correct] = -(s[correct] - s[correct].mean())
      if dynamic:
        a_len *= correct.sum() / len(rew)
    out[b] = grpo_ref(rew) + beta * a_len
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, SEEDS, st.booleans())
def test_ddca_matches_the_reference(group, seed, dynamic):
  r = make(group, seed)
  check(run("ddca", r, beta=0.5, dynamic=dynamic), ddca_ref(r, 0.5, dynamic), r.mask)


def test_ddca_prefers_shorter_correct_responses_more_on_easy_groups():
  mask = np.arange(6) < np.array([[2, 6, 3, 3]] * 3)[..., None]
  rewards = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)  # easy, hard
  r = credit.Rollouts(tokens=np.zeros((3, 4, 6), np.int32), mask=mask, rewards=rewards)
  adv = np.asarray(credit.get("ddca")(r))[..., 0]
  assert adv[0, 0] > 0 > adv[0, 1]  # all correct: only the length term, shorter gains
  base = np.asarray(credit.get("grpo")(r))[1, :, 0]
  gain_easy, gain_hard = adv[0, 0] - adv[0, 1], (adv[1, 0] - base[0]) - (adv[1, 1] - base[1])
  assert gain_easy > gain_hard > 0  # ρ = 1 against ρ = ½


# --- DVAO ----------------------------------------------------------------------------------

def dvao_ref(r, objectives, weighting):
  out = np.zeros(r.rewards.shape)
  for b, rew in enumerate(r.rewards.astype(np.float64)):
    n, g = lengths_of(r)[b], len(rew)
    obj = {"outcome": rew,
           "process": np.array([r.token_rewards[b, i, :n[i]].astype(np.float64).sum()
                                for i in range(g)]),
           "brevity": -n / r.mask.shape[-1]}
    advs, scales = [], []
    for k in objectives:
      x = obj[k]
      std = 1.0 if g == 1 else (0.0 if x.max() == x.min() else x.std(ddof=1))
      advs.append(grpo_ref(x))
      scales.append(std ** 2 if weighting == "variance" else std)
    total = sum(scales)
    out[b] = sum((s / total if total > 0 else 0.0) * a for s, a in zip(scales, advs))
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, SEEDS, st.sampled_from([(("outcome", "process"), "variance"),
                                       (("outcome", "process", "brevity"), "std")]))
def test_dvao_matches_the_reference(group, seed, options):
  r = make(group, seed)
  objectives, weighting = options
  check(run("dvao", r, objectives=objectives, weighting=weighting),
        dvao_ref(r, objectives, weighting), r.mask, atol=2e-5)


def test_dvao_ignores_a_constant_objective_and_needs_token_rewards():
  r = fixed(seed=3)
  flat = r.replace(token_rewards=np.where(r.mask, 1.0 / r.mask.sum(-1, keepdims=True), 0.0)
                   .astype(np.float32))  # every response's process reward sums to 1
  np.testing.assert_allclose(credit.get("dvao")(flat), credit.get("grpo")(flat), atol=1e-6)
  assert credit.needs("dvao") == ("token_rewards",)
  with pytest.raises(ValueError, match="token_rewards"):
    credit.get("dvao")(r.replace(token_rewards=None))
  with pytest.raises(ValueError, match="objectives"):
    credit.get("dvao")(r, objectives=("outcome", "style"))
  with pytest.raises(ValueError, match="weighting"):
    credit.get("dvao")(r, weighting="entropy")


# --- COPO ----------------------------------------------------------------------------------

def copo_ref(r, coef):
  rew = r.rewards.astype(np.float64)
  mu = rew.mean(-1)
  glob = np.zeros_like(mu)
  if len(mu) > 1 and mu.max() > mu.min():
    glob = (mu - mu.mean()) / (mu.std(ddof=1) + 1e-6)
  out = np.zeros(rew.shape)
  for b in range(len(rew)):
    p = np.mean(rew[b] > 0.5)
    h = 0.0 if p in (0.0, 1.0) else -(p * math.log(p) + (1 - p) * math.log(1 - p))
    lam = coef * (1 - h / math.log(2))
    out[b] = (1 - lam) * grpo_ref(rew[b]) + lam * glob[b]
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, SEEDS)
def test_copo_matches_the_reference(group, seed):
  r = make(group, seed)
  check(run("copo", r, coef=0.8), copo_ref(r, 0.8), r.mask)


def test_copo_gives_consistent_groups_a_global_signal():
  rewards = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]], np.float32)
  r = credit.Rollouts(tokens=np.zeros((3, 4, 6), np.int32), mask=np.ones((3, 4, 6), bool),
                      rewards=rewards)
  adv = np.asarray(credit.get("copo")(r))[..., 0]
  assert np.all(adv[0] > 0) and np.all(adv[1] < 0)  # GRPO gives both exactly 0
  np.testing.assert_allclose(adv[2], np.asarray(credit.get("grpo")(r))[2, :, 0], rtol=1e-6)


# --- shared properties ---------------------------------------------------------------------

IDENTITY = {"mapo": dict(mix=0.0), "aapo": dict(coef=0.0), "aapo_history": dict(coef=0.0),
            "adora": dict(weight=1.0, favoured_weight=1.0), "ddca": dict(beta=0.0),
            "dvao": dict(objectives=("outcome",)), "copo": dict(coef=0.0)}


@pytest.mark.parametrize("name", sorted(IDENTITY))
@pytest.mark.parametrize("kind", ["binary", "real"])
def test_unit_weights_give_grpo_exactly(name, kind):
  r = fixed(seed=7)
  if kind == "real":
    r = r.replace(rewards=np.random.default_rng(8).normal(size=r.rewards.shape)
                  .astype(np.float32))
  np.testing.assert_array_equal(credit.get(name)(r, **IDENTITY[name]), credit.get("grpo")(r))


@pytest.mark.parametrize("name, bad", [("mapo", dict(mix=2.0)),
                                       ("aapo_history", dict(momentum=0.0)),
                                       ("aapo", dict(clip_low=-0.1)), ("adora", dict(weight=-1)),
                                       ("ddca", dict(beta=-0.2)), ("copo", dict(coef=1.5)),
                                       ("hadw", dict(eta=2.0))])
def test_bad_hyperparameters_are_refused(name, bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    credit.get(name)(fixed(), **bad)


@pytest.mark.parametrize("name", NAMES)
def test_jit_vmap_and_degenerate_groups(name):
  r = fixed(seed=11)
  np.testing.assert_allclose(run(name, r), credit.get(name)(r), atol=1e-6)
  per_slice = np.stack([np.asarray(run(name, jax.tree.map(lambda x: x[b], r)))
                        for b in range(3)])
  np.testing.assert_allclose(jax.jit(jax.vmap(credit.get(name)))(r), per_slice, atol=1e-6)
  chex.assert_tree_all_finite(run(name, fixed(g=1, seed=13)))
  r = fixed(seed=15)
  mask = r.mask.copy()
  mask[0] = False  # a group with no tokens
  adv = np.asarray(run(name, r.replace(mask=mask, rewards=np.full((3, 4), 0.7, np.float32))))
  chex.assert_tree_all_finite(adv)
  assert np.all(adv[~mask] == 0)
  if name not in ("aapo", "aapo_history", "dvao", "ddca"):  # beyond the group's spread
    np.testing.assert_array_equal(adv, 0.0)
  assert credit.stateful(name) == (name in ("hadw", "aapo_history"))
