"""Tests for experiments/agent_credit_quality.py: the true advantages and the CLI end to end."""

import json
import math

import numpy as np
import pytest

import credit
from experiments import agent_credit_quality as acq
from experiments import credit_quality as cq

B, G = 64, 64  # one MDP draw for every test here (test_main_tiny reuses its compiled sampler)
ROOMS, ROOM_G, GAMMA = 4, 256, 0.95


@pytest.fixture(scope="module")
def mdp():
  env = acq.mdp_env(0)
  return env, np.asarray(acq.mdp_logits(env, 0)), acq.sample("mdp", B, G, seed=0)


@pytest.fixture(scope="module")
def rooms():
  return acq.sokoban_env(), acq.sample("sokoban", ROOMS, ROOM_G, seed=1)


def python_values(env, logits, gamma):
  """Plain-Python backward induction: dicts q[t, s, a], v[t, s] (v[K, s] = 0)."""
  p, r = env.tables
  s_n, a_n, k_n = env.num_states, env.num_actions, env.max_turns
  terminal = [s >= env.num_live for s in range(s_n)]
  pi = []
  for s in range(s_n):
    e = [math.exp(float(x)) for x in logits[s]]
    pi.append([x / sum(e) for x in e])
  v = {(k_n, s): 0.0 for s in range(s_n)}
  q = {}
  for t in reversed(range(k_n)):
    for s in range(s_n):
      for a in range(a_n):
        q[t, s, a] = 0.0 if terminal[s] else sum(
            float(p[s, a, s2]) * (float(r[s, a, s2]) + gamma * (0.0 if terminal[s2] else
                                                                 v[t + 1, s2]))
            for s2 in range(s_n))
      v[t, s] = sum(pi[s][a] * q[t, s, a] for a in range(a_n))
  return q, v


def test_mdp_truth_matches_python_backward_induction(mdp):
  env, logits, batch = mdp
  q, v = python_values(env, logits, 1.0)
  p, r = env.tables
  mask, s, a = (np.asarray(x) for x in (batch.turns.turn_mask, batch.states, batch.actions))
  rewards, cast_values = np.asarray(batch.turns.rewards), np.asarray(batch.cast_values)
  assert mask[:, :, 0].all() and mask.sum() > 2 * B * G  # every start is live; most go on
  assert (s[:, :, 0] == s[:, :1, 0]).all()  # one start state per group
  checked = 0
  for i, j, k in zip(*np.nonzero(mask)):
    si, ai, sn = s[i, j, k], a[i, j, k], s[i, j, k + 1]
    assert batch.true_adv[i, j, k] == pytest.approx(q[k, si, ai] - v[k, si], abs=1e-5)
    assert batch.value_pi[i, j, k] == pytest.approx(v[k, si], abs=1e-5)
    assert p[si, ai, sn] > 0 and rewards[i, j, k] == pytest.approx(r[si, ai, sn], abs=1e-6)
    # cast's values_star: V plus the reward so far, so its advantage is r + V' - V.
    assert cast_values[i, j, k + 1] - cast_values[i, j, k] == pytest.approx(
        rewards[i, j, k] + v[k + 1, sn] - v[k, si], abs=1e-5)  # v = 0 past the end
    checked += 1
  assert checked == mask.sum()
  assert (batch.true_adv[~mask] == 0).all()
  assert np.asarray(batch.turns.success).mean() > 0.1


def test_mdp_cast_with_true_values_is_unbiased(mdp):
  # With V^π, cast's value difference is the TD error r + V' − V: its mean given (k, s, a)
  # is A^π exactly.
  env, logits, batch = mdp
  q, v = python_values(env, logits, 1.0)
  p, r = env.tables
  adv = acq.estimate("cast_value_difference", batch, 1.0)
  mask, true = np.asarray(batch.turns.turn_mask), np.asarray(batch.true_adv)
  keys = np.stack([np.broadcast_to(np.arange(env.max_turns), mask.shape),
                   np.asarray(batch.states)[..., :-1], np.asarray(batch.actions)], -1)[mask]
  cells = 0
  for k, s, a in np.unique(keys, axis=0):
    at = np.all(keys == (k, s, a), axis=1)
    n = int(at.sum())
    if n < 30:
      continue
    td = r[s, a] + np.array([v[k + 1, s2] for s2 in range(env.num_states)]) - v[k, s]
    sd = math.sqrt(float(np.sum(p[s, a] * (td - q[k, s, a] + v[k, s]) ** 2)))  # exact std
    x = adv[mask][at]
    assert abs(x.mean() - true[mask][at][0]) <= 4 * sd / math.sqrt(n) + 1e-5, (k, s, a, n)
    cells += 1
  assert cells >= 20
  a, t = adv[mask], true[mask]
  assert np.dot(a, t) / np.dot(t, t) == pytest.approx(1.0, abs=0.05)  # E[cast | A^π] = A^π
  assert cq.credit_metrics(adv, true, mask, np.abs(true) > 0.05)["corr"] > 0.5


def test_cast_recipe_is_grpo_plus_the_compressed_normalised_difference(mdp):
  # `cast` (the training default) = GRPO's outcome advantage + 0.1 asinh(d) / rms, d the
  # value difference over every taken turn of the batch: by hand in NumPy.
  _, _, batch = mdp
  mask = np.asarray(batch.turns.turn_mask)
  d = np.where(mask, np.arcsinh(acq.estimate("cast_value_difference", batch, 1.0)), 0.0)
  rms = math.sqrt(float(np.sum(d * d) / mask.sum()))
  returns = np.sum(np.asarray(batch.turns.rewards), -1, keepdims=True)
  base = (returns - returns.mean(1, keepdims=True)) / (returns.std(1, ddof=1, keepdims=True)
                                                       + 1e-6)
  expect = np.where(mask, base + 0.1 * d / rms, 0.0)
  np.testing.assert_allclose(acq.estimate("cast", batch, 1.0), expect, atol=2e-5)


def test_truth_is_a_perfect_estimator(mdp):
  _, _, batch = mdp
  mask, true = np.asarray(batch.turns.turn_mask), np.asarray(batch.true_adv)
  decisive = np.abs(true) > 0.05
  perfect = cq.credit_metrics(true, true, mask, decisive)
  assert perfect["corr"] == pytest.approx(1.0, abs=1e-9) and perfect["sign"] == 1.0
  assert perfect["decisive_tokens"] > 100
  flipped = cq.credit_metrics(-true, true, mask, decisive)
  assert flipped["corr"] == pytest.approx(-1.0, abs=1e-9) and flipped["sign"] == 0.0


def test_trajectory_tokens_interleave_states_and_actions(mdp):
  _, _, batch = mdp
  small = acq.first_members(batch, 4)
  rollouts = acq.trajectory_rollouts(small)
  mask = np.asarray(small.turns.turn_mask)
  np.testing.assert_array_equal(rollouts.mask[..., 0::2], mask)
  np.testing.assert_array_equal(rollouts.mask[..., 1::2], mask)
  np.testing.assert_array_equal(rollouts.tokens[..., 1::2][mask], small.actions[mask])
  np.testing.assert_array_equal(rollouts.tokens[..., 0::2][mask],
                                np.asarray(small.turns.state_ids)[..., :-1][mask])
  grpo = acq.estimate("grpo", small, 1.0)  # the group-normalised return on every taken turn
  ret = rollouts.rewards
  mu, sd = ret.mean(-1, keepdims=True), ret.std(-1, ddof=1, keepdims=True)
  want = np.where(sd > 0, (ret - mu) / (sd + 1e-6), 0.0)[..., None]
  np.testing.assert_allclose(grpo, np.where(mask, want, 0.0), atol=1e-5)


def test_sokoban_truth_matches_monte_carlo(rooms):
  # Exact Q^π_0(s_0, a) and V^π_0(s_0) from the room graph vs the sampled returns (env.step).
  env, batch = rooms
  mask, rewards = np.asarray(batch.turns.turn_mask), np.asarray(batch.turns.rewards)
  returns = np.sum(rewards * GAMMA ** np.arange(env.max_turns), -1)  # [B, G] from turn 0
  q0 = batch.true_adv[..., 0] + batch.value_pi[..., 0]
  assert np.asarray(batch.turns.success).mean() > 0.05
  # Returns lie in [0, 1], so a mean μ has variance at most μ(1 − μ): 4 standard errors.
  close = lambda x, mu: abs(x.mean() - mu) <= 4 * math.sqrt(mu * (1 - mu) / len(x)) + 1e-6
  for i in range(ROOMS):
    assert close(returns[i], batch.value_pi[i, 0, 0]), i
    for a in range(4):
      at = batch.actions[i, :, 0] == a
      assert at.sum() > 30 and np.ptp(q0[i, at]) < 1e-6  # one Q per action
      assert close(returns[i, at], q0[i, at][0]), (i, a)
  assert (batch.true_adv[~mask] == 0).all()
  assert np.std(batch.true_adv[mask]) > 0.01


def test_sokoban_cast_values_and_metrics(rooms):
  env, batch = rooms
  mask, success = np.asarray(batch.turns.turn_mask), np.asarray(batch.turns.success)
  ends = np.take_along_axis(np.asarray(batch.cast_values), mask.sum(-1)[..., None], -1)[..., 0]
  np.testing.assert_allclose(ends, success.astype(np.float32))  # CAST's 1 solved / 0 failed
  start = np.asarray(batch.cast_values)[:, 0, 0]  # V*(s_0) = γ^(d* − 1), d* <= K
  d = np.log(start) / np.log(GAMMA) + 1
  np.testing.assert_allclose(d, np.round(d), atol=1e-3)
  assert (np.round(d) >= 1).all() and (np.round(d) <= env.max_turns).all()
  out = acq.evaluate(batch, ["cast", "cast_value_difference", "grpo"], [4], GAMMA)
  for name, per_g in out["results"].items():
    assert all(math.isfinite(per_g[4][k]) for k in ("corr", "mse", "sign")), name
  assert out["groups"][4]["turns"] == mask[:, :4].sum()


def test_main_tiny(tmp_path):
  # The CLI end to end on the fixture's draw (its sampler is compiled). Only the two cheap
  # estimators: every agent estimator costs seconds of compile (tests/test_agent_credit.py
  # tests them; the default run uses them all).
  report = acq.main(["--envs", "mdp", "--group_sizes", str(G), "--seeds", "1",
                     "--mdp_groups", str(B), "--estimators", "cast_value_difference,grpo",
                     "--workdir", str(tmp_path)])
  assert (tmp_path / "agent_credit_quality.png").exists()
  saved = json.loads((tmp_path / "agent_credit_quality.json").read_text())
  assert set(saved["summary"]["mdp"]) == {"cast_value_difference", "grpo"}
  summary = report["summary"]["mdp"]
  for name, per_g in summary.items():
    assert all(math.isfinite(per_g[G][k][0]) for k in ("corr", "mse", "sign")), name
  assert summary["cast_value_difference"][G]["corr"][0] > summary["grpo"][G]["corr"][0] + 0.1


def test_turn_token_estimators_read_exact_policy_and_oracle_values(mdp):
  # The token-level turn estimators see π's exact log-probs/entropies on the action tokens
  # and V^π as an oracle critic: with λ = 0 ppo_turns is the one-step TD error
  # r_k + V^π_{k+1}(s_{k+1}) − V^π_k(s_k), with λ = 1 the return-to-go minus V^π_k(s_k).
  env, logits, batch = mdp
  small = acq.first_members(batch, 4)
  r = acq.turn_rollouts(small)
  mask, s, a = (np.asarray(x) for x in (small.turns.turn_mask, small.states, small.actions))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  lp = np.asarray(r.logprobs)[..., 1::2]
  np.testing.assert_allclose(lp[mask], logp[s[..., :-1], a][mask], rtol=1e-5, atol=1e-5)
  ent = -(np.exp(logp) * logp).sum(-1)
  np.testing.assert_allclose(np.asarray(r.entropy)[..., 1::2][mask], ent[s[..., :-1]][mask],
                             rtol=1e-5, atol=1e-5)
  rewards, v = np.asarray(small.turns.rewards, np.float64), np.asarray(small.value_pi, np.float64)
  v_next = np.where(np.concatenate([mask[..., 1:], np.zeros_like(mask[..., :1])], -1),
                    v[..., 1:], 0.0)
  td0 = np.where(mask, rewards + v_next - v[..., :-1], 0.0)
  got0 = np.asarray(credit.get("ppo_turns")(r, gamma=1.0, lam=0.0, whiten=False))[..., 1::2]
  np.testing.assert_allclose(got0, td0, atol=1e-5)
  to_go = np.cumsum(rewards[..., ::-1], -1)[..., ::-1]
  got1 = np.asarray(credit.get("ppo_turns")(r, gamma=1.0, lam=1.0, whiten=False))[..., 1::2]
  np.testing.assert_allclose(got1, np.where(mask, to_go - v[..., :-1], 0.0), atol=1e-5)
  # Every one of them gives finite turn advantages of the truth's shape.
  for name in acq.TURN_TOKEN_ESTIMATORS:
    adv = acq.estimate(name, small, 1.0)
    assert adv.shape == small.true_adv.shape and np.isfinite(adv).all(), name
