"""Monte Carlo values at forks (`credit.values.mc_values`, issue 24 item 3) against
plain-Python references and its identities: TEMPO's TD term, telescoping to R − μ."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import credit
from groups import groups, sampled_trees
import trees

SETTINGS = settings(max_examples=20, deadline=None)
MC = jax.jit(lambda r: credit.get("mc_values")(r))
MC_STEP = jax.jit(lambda r: credit.get("mc_values")(r, granularity="step"))


def prefix_value_ref(tokens, mask, rewards, g, t):
  """Mean reward of the responses whose first t tokens equal response g's (t = 0: all)."""
  key = tuple(tokens[g][:t])
  same = [j for j in range(len(rewards))
          if mask[j][:t].all() and tuple(tokens[j][:t]) == key] if t else range(len(rewards))
  return float(np.mean([rewards[j] for j in same]))


@SETTINGS
@given(groups(sizes=(1, 3, 6), lengths=(5,), batch=(2,)))
def test_token_credit_is_the_difference_of_prefix_values(group):
  tokens, mask, rewards = group
  got = np.asarray(MC(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards)))
  for b in range(tokens.shape[0]):
    for g in range(tokens.shape[1]):
      for t in range(tokens.shape[2]):
        want = (prefix_value_ref(tokens[b], mask[b], rewards[b], g, t + 1)
                - prefix_value_ref(tokens[b], mask[b], rewards[b], g, t)) if mask[b, g, t] else 0
        assert got[b, g, t] == pytest.approx(want, abs=1e-5), (b, g, t)


@SETTINGS
@given(sampled_trees(), st.integers(0, 2**31 - 1))
def test_identities_on_sampled_trees(sample, seed):
  tokens, mask, rewards, parent, fork = sample
  tree = trees.from_forks(tokens, mask, parent, fork)
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, tree=tree)
  adv = np.asarray(credit.get("mc_values")(r), np.float64)
  # TEMPO without scaling = (R − μ) + the TD term; mc_values is the TD term.
  outcome = np.asarray(credit.get("dr_grpo")(r), np.float64)
  np.testing.assert_allclose(adv, np.asarray(credit.get("tempo")(r, scale_by_std=False))
                             - outcome, atol=1e-5)
  # Along each response with a token, the credit telescopes to V̂(its last prefix) − μ: R − μ
  # unless longer responses extend it (then the mean of their rewards and its own).
  has = mask.any(-1)
  mu = rewards.mean(-1, keepdims=True)
  _, after = trees.prefix_values(tree, rewards)
  last = np.take_along_axis(np.asarray(after), np.maximum(mask.sum(-1) - 1, 0)[..., None], -1)
  np.testing.assert_allclose(adv.sum(-1)[has], (last[..., 0] - mu)[has], atol=1e-5)
  leaf = has & np.isclose(last[..., 0], rewards)
  np.testing.assert_allclose(adv.sum(-1)[leaf], (rewards - mu)[leaf], atol=1e-5)
  # Steps: every token of a step carries the step's summed credit; totals unchanged.
  ends = (np.random.default_rng(seed).random(mask.shape) < 0.3) & mask
  step = np.asarray(credit.get("mc_values")(r.replace(step_ends=ends), granularity="step"))
  for b, g in np.ndindex(mask.shape[:2]):
    n = int(mask[b, g].sum())
    start = 0
    for t in range(n):
      if ends[b, g, t] or t == n - 1:
        np.testing.assert_allclose(step[b, g, start:t + 1], adv[b, g, start:t + 1].sum(),
                                   atol=1e-5)
        start = t + 1
  assert np.all(step[~mask] == 0)


def test_step_needs_step_ends_and_options_are_checked():
  r = credit.Rollouts(tokens=np.zeros((2, 3), np.int32), mask=np.ones((2, 3), bool),
                      rewards=np.array([1.0, 0.0], np.float32))
  with pytest.raises(ValueError, match="step_ends"):
    credit.get("mc_values")(r, granularity="step")
  with pytest.raises(ValueError, match="granularity"):
    credit.get("mc_values")(r, granularity="turn")
  scaled = credit.get("mc_values")(r, scale_by_std=True)
  np.testing.assert_allclose(np.asarray(scaled),
                             np.asarray(credit.get("mc_values")(r)) / (np.std([1, 0], ddof=1)
                                                                       + 1e-6), rtol=1e-5)


def agent_rollouts_with_values(seed, rng):
  """`test_turn_weighting.make`'s multi-turn rollouts with random critic values and dense
  turn rewards."""
  from test_turn_weighting import make
  r = make(seed)
  values = rng.normal(size=r.mask.shape).astype(np.float32)
  return r.replace(values=values, turns=r.turns.replace(
      rewards=np.where(r.turns.turn_mask, rng.normal(size=r.turns.turn_mask.shape),
                       0.0).astype(np.float32)))


def check_whitened_on_tokens(got, raw, token_turn, seed):
  """got [G, L] is raw[(i, k)] (turn advantages) whitened over all turns, on turn k's tokens."""
  xs = np.array(list(raw.values()))
  for i, t in np.ndindex(got.shape):
    k = token_turn[i][t]
    want = 0.0 if k < 0 else (raw[i, k] - xs.mean()) / (xs.std() + 1e-8)
    assert got[i, t] == pytest.approx(want, abs=1e-4), (seed, i, t)


def test_ppo_turns_matches_a_loop_reference():
  """GAE over turns from the critic's value before each turn's first action token, whitened
  over the batch's taken turns, spread over the action tokens."""
  rng = np.random.default_rng(0)
  for seed in range(5):
    r = agent_rollouts_with_values(seed, rng)
    g = r.mask.shape[0]
    values = r.values
    gamma, lam = 0.9, 0.8
    got = np.asarray(credit.get("ppo_turns")(r, gamma=gamma, lam=lam))
    tt, tm, rw = (np.asarray(x) for x in (r.turns.token_turn, r.turns.turn_mask, r.turns.rewards))
    raw = {}
    for i in range(g):
      n = int(tm[i].sum())
      v = [float(values[i][list(tt[i]).index(k)]) for k in range(n)] + [0.0]
      acc = 0.0
      for k in reversed(range(n)):
        delta = rw[i][k] + gamma * v[k + 1] - v[k]
        acc = delta + gamma * lam * acc
        raw[i, k] = acc
    check_whitened_on_tokens(got, raw, tt, seed)
  with pytest.raises(ValueError, match="values"):
    credit.get("ppo_turns")(r.replace(values=None))


def test_bilevel_gae_matches_a_loop_reference():
  """Turn-level GAE, then token-level GAE inside each turn seeded with the turn's return
  target G_k = A_k + V(s_k) on its last action token; at token γ = λ = 1, G_k − V(token)."""
  rng = np.random.default_rng(1)
  for seed in range(4):
    r = agent_rollouts_with_values(seed, rng)
    g, l = r.mask.shape
    values = r.values
    gamma, lam, tg, tl = 0.9, 0.8, 0.95, 0.7
    got = np.asarray(credit.get("bilevel_gae")(r, gamma=gamma, lam=lam, token_gamma=tg,
                                               token_lam=tl, whiten=False))
    tt, tm, rw = (np.asarray(x) for x in (r.turns.token_turn, r.turns.turn_mask, r.turns.rewards))
    want = np.zeros((g, l))
    for i in range(g):
      n = int(tm[i].sum())
      toks = {k: [t for t in range(l) if tt[i][t] == k] for k in range(n)}
      v = [float(values[i][toks[k][0]]) for k in range(n)] + [0.0]
      acc, turn_adv = 0.0, {}
      for k in reversed(range(n)):
        acc = rw[i][k] + gamma * v[k + 1] - v[k] + gamma * lam * acc
        turn_adv[k] = acc
      for k in range(n):
        target, a = turn_adv[k] + v[k], 0.0
        for j, t in reversed(list(enumerate(toks[k]))):
          last = j == len(toks[k]) - 1
          nv = 0.0 if last else float(values[i][toks[k][j + 1]])
          delta = (target if last else 0.0) + tg * nv - float(values[i][t])
          a = delta + (0.0 if last else tg * tl * a)
          want[i, t] = a
    np.testing.assert_allclose(got, want, atol=1e-4)
  # token γ = λ = 1: each action token gets G_k − V(token), whitened over action tokens.
  one = np.asarray(credit.get("bilevel_gae")(r, gamma=gamma, lam=lam, whiten=False))
  i, k = 0, 0
  toks = [t for t in range(l) if tt[i][t] == k]
  np.testing.assert_allclose(one[i, toks], one[i, toks[-1]] + values[i, toks[-1]]
                             - values[i, toks], atol=1e-5)


def test_hiper_matches_a_segment_loop_and_reduces_to_ppo_turns():
  """HiPER's HAE (credit.milestones.hiper) against a loop over explicit milestone segments;
  ω = 0 without milestones is ppo_turns."""
  rng = np.random.default_rng(2)
  for seed in range(4):
    r = agent_rollouts_with_values(seed, rng)
    g = r.mask.shape[0]
    tm = np.asarray(r.turns.turn_mask)
    key = (rng.random(tm.shape) < 0.35) & tm
    r = r.replace(turns=r.turns.replace(milestones=key.astype(np.int32)))
    gamma, lam, high_lam, omega = 0.9, 0.7, 0.6, 0.5
    got = np.asarray(credit.get("hiper")(r, gamma=gamma, lam=lam, high_lam=high_lam,
                                         omega=omega))
    tt, rw = np.asarray(r.turns.token_turn), np.asarray(r.turns.rewards)
    raw = {}
    for i in range(g):
      n = int(tm[i].sum())
      v = [float(r.values[i][list(tt[i]).index(k)]) for k in range(n)] + [0.0]
      ends = [k for k in range(n) if key[i, k] or k == n - 1]
      segs = [(e0 + 1 if j else 0, e) for j, (e0, e) in enumerate(zip([-1] + ends, ends))]
      high = 0.0
      for s, e in reversed(segs):
        ret = sum(gamma ** (k - s) * rw[i][k] for k in range(s, e + 1))
        high = ret + gamma ** (e - s + 1) * v[e + 1] - v[s] + gamma ** (e - s + 1) * high_lam * high
        acc = 0.0
        for k in reversed(range(s, e + 1)):
          acc = rw[i][k] + gamma * v[k + 1] - v[k] + gamma * lam * acc
          raw[i, k] = acc + (omega * high if k == s else 0.0)
    check_whitened_on_tokens(got, raw, tt, seed)
    none = r.replace(turns=r.turns.replace(milestones=np.zeros_like(key, np.int32)))
    np.testing.assert_allclose(np.asarray(credit.get("hiper")(none, gamma=gamma, lam=lam,
                                                             omega=0.0)),
                               np.asarray(credit.get("ppo_turns")(r, gamma=gamma, lam=lam)),
                               atol=1e-5)
  with pytest.raises(ValueError, match="milestones"):
    credit.get("hiper")(r.replace(turns=r.turns.replace(milestones=None)))
