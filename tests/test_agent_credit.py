"""Turn-level agent credit (credit.agents) against plain-Python references."""

import collections
import math
import statistics

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
from credit import agents
from credit.turns import Turns, discounted_returns, episode_returns, turn_to_tokens, validate_turns
from test_step_graph import turn_groups  # noqa: E402 (tests/ is on sys.path)

EPS = 1e-6
G, K = 4, 3  # one shape for the property tests, so each estimator compiles once


# ----------------------------------------------------------------- references (dicts, loops)


def lengths_of(mask):
  return [int(sum(row)) for row in mask]


def ref_returns(rewards, mask, gamma):
  out = np.zeros(np.shape(mask))
  for i, n in enumerate(lengths_of(mask)):
    acc = 0.0
    for k in reversed(range(n)):
      acc = float(rewards[i][k]) + gamma * acc
      out[i][k] = acc
  return out


def ref_episode(rewards, mask):
  return [sum(float(rewards[i][k]) for k in range(n)) for i, n in enumerate(lengths_of(mask))]


def ref_norm(x, rows, scale, tol=0.0):
  """x normalised by mean / Bessel std of `rows` (one row: 0 and 1; equal rows: 0)."""
  if not rows:
    return 0.0
  if len(rows) == 1:
    mu, sd = 0.0, 1.0
  else:
    if max(rows) - min(rows) <= tol:
      return 0.0
    mu, sd = statistics.fmean(rows), statistics.stdev(rows)
  return (x - mu) / (sd + EPS) if scale else x - mu


def ref_bucket(x, bucket, scale, pop=False):
  """x − mean(bucket) (/ std + eps); 0 for a bucket of one or of equal values."""
  if len(bucket) < 2 or max(bucket) == min(bucket):
    return 0.0
  sd = statistics.pstdev(bucket) if pop else statistics.stdev(bucket)
  return (x - statistics.fmean(bucket)) / (sd + EPS) if scale else x - statistics.fmean(bucket)


def ref_grpo(rewards, mask, scale=True):
  r = ref_episode(rewards, mask)
  return [ref_norm(x, r, scale) for x in r]


def ref_gigpo(ids, rewards, mask, success, gamma=0.95, omega=1.0, mode="mean_norm",
              episode_stats_per_step=True):
  scale = mode == "mean_std_norm"
  n, r, ret = lengths_of(mask), ref_episode(rewards, mask), ref_returns(rewards, mask, gamma)
  rows = [r[i] for i in range(len(n)) for _ in range(n[i])] if episode_stats_per_step else r
  buckets = collections.defaultdict(list)
  for i in range(len(n)):
    for k in range(n[i]):
      buckets[ids[i][k]].append(ret[i][k])
  out = np.zeros(np.shape(mask))
  for i in range(len(n)):
    for k in range(n[i]):
      out[i][k] = ref_norm(r[i], rows, scale) + omega * ref_bucket(ret[i][k], buckets[ids[i][k]],
                                                                   scale)
  return out


def ref_gagpo(ids, rewards, mask, success, gamma=1.0, lam=1.0, normalize="group"):
  n, ret = lengths_of(mask), ref_returns(rewards, mask, gamma)
  visits = collections.defaultdict(list)
  for i in range(len(n)):
    for k in range(n[i]):
      visits[ids[i][k]].append(ret[i][k])
  value = {s: statistics.fmean(v) for s, v in visits.items()}
  adv = np.zeros(np.shape(mask))
  for i in range(len(n)):
    acc = 0.0
    for k in reversed(range(n[i])):
      nxt = value[ids[i][k + 1]] if k + 1 < n[i] else 0.0
      delta = float(rewards[i][k]) + gamma * nxt - value[ids[i][k]]
      acc = delta + gamma * lam * acc
      adv[i][k] = acc
  if normalize == "none":
    return adv
  rows = [adv[i][k] for i in range(len(n)) for k in range(n[i])]
  tol = 1e-5 * float(np.max(np.abs(ret)))
  for i in range(len(n)):
    for k in range(n[i]):
      adv[i][k] = ref_norm(adv[i][k], rows, normalize == "group", tol)
  return adv


def ref_salt(ids, rewards, mask, success, scale_by_std=True):
  n, traj = lengths_of(mask), ref_grpo(rewards, mask, scale_by_std)
  through = collections.defaultdict(set)
  for i in range(len(n)):
    for k in range(n[i]):
      through[(ids[i][k], ids[i][k + 1])].add(i)
  out = np.zeros(np.shape(mask))
  for i in range(len(n)):
    for k in range(n[i]):
      out[i][k] = statistics.fmean(traj[j] for j in through[(ids[i][k], ids[i][k + 1])])
  return out


def ref_distances(ids, mask, goal_states):
  """BFS from the goal states over reversed edges: {state: fewest turns to a goal}."""
  n = lengths_of(mask)
  pred = collections.defaultdict(set)
  for i in range(len(n)):
    for k in range(n[i]):
      pred[ids[i][k + 1]].add(ids[i][k])
  dist, frontier = {s: 0 for s in goal_states}, list(goal_states)
  while frontier:
    nxt = []
    for v in frontier:
      for u in pred[v]:
        if u not in dist:
          dist[u] = dist[v] + 1
          nxt.append(u)
    frontier = nxt
  return dist


def ref_graphgpo(ids, rewards, mask, success, omega=0.9, success_reward=1.0, beta_episode=1.0,
                 beta_graph=1.0, edges="distinct", scale_by_std=True):
  n, r = lengths_of(mask), ref_episode(rewards, mask)
  ok = [bool(s) for s in success] if success is not None else [x > 0 for x in r]
  dist = ref_distances(ids, mask, {ids[i][n[i]] for i in range(len(n)) if ok[i]})
  states = {ids[i][k] for i in range(len(n)) for k in range(n[i] + 1)}
  far = max(dist.values(), default=0) + 1
  d = {s: dist.get(s, far) for s in states}
  out_edges = collections.defaultdict(list)
  for i in range(len(n)):
    for k in range(n[i]):
      out_edges[ids[i][k]].append(ids[i][k + 1])
  value = lambda s2: success_reward * omega ** d[s2]
  episode = ref_grpo(rewards, mask, scale_by_std)
  out = np.zeros(np.shape(mask))
  for i in range(len(n)):
    for k in range(n[i]):
      nexts = out_edges[ids[i][k]]
      if edges == "distinct":
        nexts = sorted(set(nexts))
      a_g = ref_bucket(value(ids[i][k + 1]), [value(s2) for s2 in nexts], True, pop=True)
      out[i][k] = beta_episode * episode[i] + beta_graph * a_g
  return out


def ref_gtpo(rewards, mask, gamma=1.0, normalize="group_turn", scale_by_std=True):
  """rewards, mask: [..., G, K] (leading dims looped)."""
  rewards, mask = np.asarray(rewards), np.asarray(mask)
  flat_r, flat_m = rewards.reshape((-1,) + rewards.shape[-2:]), mask.reshape((-1,) + mask.shape[-2:])
  ret = [ref_returns(r, m, gamma) for r, m in zip(flat_r, flat_m)]
  buckets = collections.defaultdict(list)
  key = lambda b, i, k: {"group_turn": (b, k), "group": b, "batch": 0}[normalize]
  for b, m in enumerate(flat_m):
    for i, nn in enumerate(lengths_of(m)):
      for k in range(nn):
        buckets[key(b, i, k)].append(ret[b][i][k])
  out = np.zeros(flat_m.shape)
  for b, m in enumerate(flat_m):
    for i, nn in enumerate(lengths_of(m)):
      for k in range(nn):
        out[b][i][k] = ref_bucket(ret[b][i][k], buckets[key(b, i, k)], scale_by_std)
  return out.reshape(mask.shape)


# ----------------------------------------------------------------- property tests

VARIANTS = {  # label: (name, hparams, reference); run together, so each shape compiles once
  "gigpo": ("gigpo", {}, ref_gigpo),
  "gigpo_std": ("gigpo", dict(mode="mean_std_norm", episode_stats_per_step=False, gamma=0.9,
                              omega=0.5), ref_gigpo),
  "gagpo": ("gagpo", dict(gamma=0.9, lam=0.8), ref_gagpo),
  "gagpo_raw": ("gagpo", dict(normalize="none"), ref_gagpo),
  "gagpo_mean": ("gagpo", dict(normalize="group_mean", lam=0.5), ref_gagpo),
  "salt": ("salt", {}, ref_salt),
  "graphgpo": ("graphgpo", {}, ref_graphgpo),
  "graphgpo_visits": ("graphgpo", dict(edges="visits", omega=0.5, beta_graph=0.7), ref_graphgpo),
}
GTPO = {"gtpo": {}, "gtpo_group": dict(normalize="group", gamma=0.9),
        "gtpo_batch": dict(normalize="batch", scale_by_std=False)}
SUBSET = ("gigpo", "gagpo", "salt", "graphgpo", "gtpo", "gtpo_batch", "cast")  # one per estimator


def run_all(turns, values, labels=None):
  out = {label: agents.AGENT_ESTIMATORS[name](turns, **hp)
         for label, (name, hp, _) in VARIANTS.items() if labels is None or label in labels}
  out.update({label: agents.gtpo(turns, **hp) for label, hp in GTPO.items()
              if labels is None or label in labels})
  out["cast"] = agents.cast(turns, values_star=values, **agents.CAST_VALUE_DIFFERENCE)
  return out


ALL = jax.jit(run_all)  # each shape compiles once (jit compile time dominates these tests)
SOME = jax.jit(lambda turns, values: run_all(turns, values, SUBSET))


def as_turns(ids, rewards, mask, success=None):
  return Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success)


def values_like(ids):
  return np.random.default_rng(0).normal(size=ids.shape).astype(np.float32)


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K),)))
def test_matches_reference(group):
  ids, rewards, mask, success = group
  turns = validate_turns(as_turns(ids, rewards, mask, success))
  values = values_like(ids)
  got = jax.tree.map(np.asarray, ALL(turns, values))
  py_ids = ids.tolist()
  for label, (name, hp, ref) in VARIANTS.items():
    want = ref(py_ids, rewards, mask, success, **hp)
    np.testing.assert_allclose(got[label], want, rtol=2e-4, atol=2e-5, err_msg=f"{name} {hp}")
    assert np.all(got[label][~mask] == 0)
  for label, hp in GTPO.items():
    np.testing.assert_allclose(got[label], ref_gtpo(rewards, mask, **hp), rtol=2e-4, atol=2e-5,
                               err_msg=f"gtpo {hp}")
  want = np.where(mask, values[:, 1:] - values[:, :-1], 0.0)
  np.testing.assert_allclose(got["cast"], want, atol=1e-6)


def test_graphgpo_without_success_flags_uses_positive_returns():
  ids = np.array([[0, 1, 2, 3], [0, 1, 4, 4], [0, 5, 6, 3], [0, 5, 7, 8]], np.int32)
  rewards = np.array([[0, 0, 1], [0, 0, 0], [0, 0, 2], [0, 0, 0]], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], bool)
  without = {"graphgpo": agents.graphgpo(as_turns(ids, rewards, mask))}
  flagged = ALL(as_turns(ids, rewards, mask, np.array([1, 0, 1, 0], bool)), values_like(ids))
  for label in without:
    np.testing.assert_allclose(without[label], flagged[label], atol=1e-6)
    np.testing.assert_allclose(without[label], ref_graphgpo(ids.tolist(), rewards, mask, None,
                                                            **VARIANTS[label][1]), atol=1e-5)


def unique_states(start_shared):
  ids = np.arange(G * (K + 1), dtype=np.int32).reshape(G, K + 1) * 7919 + 3
  if start_shared:
    ids[:, 0] = -1
  return ids


def outcome_rewards(rng, mask, kind):
  last = mask & ~np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], -1)
  r = rng.integers(0, 2, (G, 1)) if kind == "binary" else rng.normal(size=(G, 1))
  return np.where(last, r, 0.0).astype(np.float32)


def grpo_per_turn(rewards, mask, name="grpo"):
  r = np.asarray(episode_returns(rewards, mask))
  rollouts = credit.Rollouts(tokens=np.zeros((G, K), np.int32), mask=mask, rewards=r)
  return np.asarray(credit.get(name)(rollouts))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["binary", "real"]), st.booleans())
def test_reduce_to_outcome_credit_without_shared_states(seed, kind, dense):
  rng = np.random.default_rng(seed)
  mask = np.arange(K) < rng.integers(1, K + 1, (G, 1))
  rewards = (np.where(mask, rng.normal(size=(G, K)), 0).astype(np.float32) if dense
             else outcome_rewards(rng, mask, kind))
  ids = unique_states(start_shared=False)
  success = np.asarray(episode_returns(rewards, mask)) > 0
  got = ALL(as_turns(ids, rewards, mask, success), values_like(ids))
  grpo, dr_grpo = grpo_per_turn(rewards, mask), grpo_per_turn(rewards, mask, "dr_grpo")
  tol = dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["gigpo_std"], grpo, **tol)  # per-trajectory statistics
  weighted = ref_gigpo(ids.tolist(), rewards, mask, None)  # only the episode term is left
  np.testing.assert_allclose(got["gigpo"], weighted, **tol)
  np.testing.assert_allclose(got["salt"], grpo, **tol)
  np.testing.assert_allclose(got["graphgpo"], grpo, **tol)
  np.testing.assert_array_equal(got["gagpo_raw"], 0.0)
  # One shared start state: GAGPO is Dr. GRPO on the first turn's return, 0 after it.
  shared = ALL(as_turns(unique_states(start_shared=True), rewards, mask, success),
               values_like(ids))
  first = np.asarray(discounted_returns(rewards, mask, 1.0))[:, 0]
  want = np.zeros((G, K))
  want[:, 0] = dr_grpo[:, 0] if not dense else first - first.mean()
  np.testing.assert_allclose(shared["gagpo_raw"], want, **tol)
  # GTPO per (group, turn) with outcome rewards, γ = 1 and equal lengths: GRPO on every turn.
  full = np.ones((G, K), bool)
  out = outcome_rewards(rng, full, kind)
  np.testing.assert_allclose(ALL(as_turns(ids, out, full, success), values_like(ids))["gtpo"],
                             grpo_per_turn(out, full), **tol)


def test_cast_telescopes_to_terminal_minus_start_value():
  rng = np.random.default_rng(3)
  mask = np.arange(K) < rng.integers(0, K + 1, (G, 1))
  values = rng.normal(size=(G, K + 1)).astype(np.float32)
  turns = as_turns(np.zeros((G, K + 1), np.int32), np.zeros((G, K), np.float32), mask)
  n = mask.sum(-1)
  np.testing.assert_allclose(np.sum(agents.cast(turns, values_star=values,
                                         **agents.CAST_VALUE_DIFFERENCE), -1),
                             values[np.arange(G), n] - values[:, 0], atol=1e-5)


def ref_cast(rewards, mask, steps, alpha, compress, normalize, outcome, scale=True):
  """The paper's recipe, loops over a batch [B, G, K]: α · asinh(N(s_k) − N(s_{k+1})) / RMS
  over every taken turn of the batch, plus GRPO of the group's returns."""
  b, g, k = np.shape(mask)
  d = {(i, j, t): float(steps[i][j][t]) - float(steps[i][j][t + 1])
       for i in range(b) for j in range(g) for t in range(k) if mask[i][j][t]}
  if compress == "asinh":
    d = {key: math.asinh(x) for key, x in d.items()}
  if normalize == "batch_rms" and d:
    rms = math.sqrt(sum(x * x for x in d.values()) / len(d))
    d = {key: (x / rms if rms > 0 else 0.0) for key, x in d.items()}
  out = np.zeros((b, g, k))
  for i in range(b):
    base = ref_grpo(rewards[i], mask[i], scale) if outcome == "grpo" else [0.0] * g
    for (bi, j, t), x in d.items():
      if bi == i:
        out[i, j, t] = alpha * x + base[j]
  return out


CAST_RECIPES = [dict(alpha=0.1, compress="asinh", normalize="batch_rms", outcome="grpo"),
                dict(alpha=0.5, compress="none", normalize="batch_rms", outcome="none"),
                dict(alpha=1.0, compress="asinh", normalize="none", outcome="grpo")]


@settings(max_examples=20, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_cast_recipe_matches_reference(group, which, seed):
  """CAST as the paper's code runs it (#CAST seed: solver values injected into RLVR): GRPO's
  outcome advantage plus α of the asinh-compressed, batch-RMS-normalised step-count
  advantage N(s_k) − N(s_{k+1}); every option against the loops."""
  ids, rewards, mask, success = group
  steps = np.random.default_rng(seed).integers(0, 6, ids.shape).astype(np.float32)
  hp = CAST_RECIPES[which]
  turns = validate_turns(as_turns(ids, rewards, mask, success))
  got = np.asarray(agents.cast(turns, solver_steps=steps, **hp))
  np.testing.assert_allclose(got, ref_cast(rewards, mask, steps, **hp), rtol=2e-4, atol=2e-5)


def test_cast_recipe_identities():
  """α = 0 is GRPO on every turn; outcome 'none' with all-equal step counts is 0 (the RMS of
  zeros divides nothing); the solving move (N 1 → 0) and a step closer get the same
  positive step credit, a useless move 0 and a step away the negative of it."""
  rng = np.random.default_rng(5)
  mask = np.arange(K) < rng.integers(1, K + 1, (G, 1))
  rewards = outcome_rewards(rng, mask, "binary")
  turns = as_turns(np.zeros((G, K + 1), np.int32), rewards, mask)
  steps = rng.integers(0, 4, (G, K + 1)).astype(np.float32)
  np.testing.assert_allclose(agents.cast(turns, solver_steps=steps, alpha=0.0),
                             grpo_per_turn(rewards, mask), atol=1e-6)
  flat = np.full((G, K + 1), 3.0, np.float32)
  assert np.all(np.asarray(agents.cast(turns, solver_steps=flat, outcome="none")) == 0)
  full = np.ones((1, 4), bool)
  one = as_turns(np.zeros((1, 5), np.int32), np.zeros((1, 4), np.float32), full)
  adv = np.asarray(agents.cast(one, solver_steps=np.array([[2, 3, 3, 2, 1]], np.float32),
                               outcome="none", alpha=1.0))[0]
  assert adv[0] < 0 and adv[1] == 0 and adv[2] > 0 and adv[3] == pytest.approx(adv[2])
  assert adv[0] == pytest.approx(-adv[2])


# Under an outer vmap: the estimator with the distance loop, one with batch statistics, CAST.
MAPPED = jax.jit(jax.vmap(lambda turns, values: run_all(turns, values,
                                                        ("graphgpo", "gtpo_batch"))))


@settings(max_examples=2, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)))
def test_leading_dims_vmap_and_jit(group):
  ids, rewards, mask, success = group
  turns = as_turns(ids, rewards, mask, success)
  values = np.stack([values_like(ids[0])] * 2)
  batched = SOME(turns, values)  # leading dims inside each estimator
  mapped = MAPPED(turns, values)  # jit of vmap over the batch dim
  per_group = [ALL(jax.tree.map(lambda x: x[b], turns), values[b]) for b in range(2)]
  for label in batched:
    if label == "gtpo_batch":  # statistics over the whole input: not per group
      continue
    stacked = np.stack([p[label] for p in per_group])
    np.testing.assert_allclose(batched[label], stacked, rtol=1e-6, atol=1e-6, err_msg=label)
    if label in mapped:
      np.testing.assert_allclose(mapped[label], stacked, rtol=1e-6, atol=1e-6, err_msg=label)
  np.testing.assert_allclose(batched["gtpo_batch"], ref_gtpo(rewards, mask, **GTPO["gtpo_batch"]),
                             rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(mapped["gtpo_batch"], np.stack([p["gtpo_batch"] for p in per_group]),
                             rtol=1e-6, atol=1e-6)


def test_equal_rewards_give_zeros_and_everything_is_finite():
  rng = np.random.default_rng(5)
  ids = rng.integers(0, 3, (G, K + 1)).astype(np.int32)
  mask = np.arange(K) < rng.integers(1, K + 1, (G, 1))  # a trajectory of no turns has R = 0
  success = np.zeros(G, bool)
  zero = ALL(as_turns(ids, np.zeros((G, K), np.float32), mask, success), values_like(ids))
  for label, adv in zero.items():
    if label != "cast":
      np.testing.assert_array_equal(adv, 0.0, err_msg=label)
  # The same outcome for everyone, γ = 1: no signal (GiGPO's default γ = 0.95 and GraphGPO's
  # distances can still tell shorter paths apart).
  last = mask & ~np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], -1)
  const = as_turns(ids, np.where(last, 0.7, 0.0).astype(np.float32), mask, success)
  got = ALL(const, values_like(ids))
  for label in ("gagpo_raw", "gtpo", "salt"):
    np.testing.assert_array_equal(got[label], 0.0, err_msg=label)
  assert all(np.all(np.isfinite(v)) for v in got.values())


def test_single_trajectory_groups_are_finite():
  ids = np.array([[4, 5, 4, 6]], np.int32)
  turns = as_turns(ids, np.array([[0.0, 0.0, 1.0]], np.float32), np.ones((1, 3), bool),
                   np.array([True]))
  got = SOME(turns, np.zeros((1, 4), np.float32))
  for label, adv in got.items():
    assert adv.shape == (1, 3) and np.all(np.isfinite(adv)), label
  # GRPO's group of one passes the reward through (μ = 0, σ = 1).
  np.testing.assert_allclose(got["salt"], np.full((1, 3), 1.0 / (1 + EPS)), rtol=1e-6)
  np.testing.assert_array_equal(got["gtpo"], 0.0)  # buckets of one
  np.testing.assert_allclose(got["gigpo"][0], ref_gigpo(ids.tolist(), turns.rewards,
                                                        turns.turn_mask, None)[0], atol=1e-6)


def test_token_wrappers_spread_turn_credit():
  rng = np.random.default_rng(1)
  ids = rng.integers(0, 3, (G, K + 1)).astype(np.int32)
  mask = np.ones((G, K), bool)
  mask[0, 2] = False
  rewards = outcome_rewards(rng, mask, "binary")
  token_turn = np.array([[-1, 0, 0, -1, 1, 1, -1, -1]] * G, np.int32)
  token_turn[1:, 6:] = 2
  tokens_mask = np.ones((G, 8), bool)
  tokens_mask[0, 6:] = False
  rollouts = credit.Rollouts(tokens=np.zeros((G, 8), np.int32), mask=tokens_mask,
                             rewards=episode_returns(rewards, mask))
  turns = Turns(state_ids=ids, rewards=rewards, turn_mask=mask, token_turn=token_turn)
  validate_turns(turns, rollouts)
  values = values_like(ids)
  for name, hp in (("gtpo", {}), ("cast", dict(solver_steps=np.abs(values))),
                   ("cast", dict(values_star=values, **agents.CAST_VALUE_DIFFERENCE))):
    per_turn = np.asarray(agents.AGENT_ESTIMATORS[name](turns, **hp))
    picked = np.take_along_axis(per_turn, np.maximum(token_turn, 0), -1)
    want = np.where((token_turn >= 0) & tokens_mask, picked, 0.0)
    np.testing.assert_allclose(agents.AGENT_TOKEN_ESTIMATORS[name](rollouts, turns, **hp), want,
                               err_msg=name)
  assert set(agents.AGENT_TOKEN_ESTIMATORS) == set(agents.AGENT_ESTIMATORS)
  assert all(fn.__name__ == f"{name}_tokens" for name, fn in agents.AGENT_TOKEN_ESTIMATORS.items())
  np.testing.assert_array_equal(turn_to_tokens(np.ones((G, K)), token_turn), token_turn >= 0)
  with pytest.raises(ValueError, match="token_turn"):
    agents.gigpo_tokens(rollouts, turns.replace(token_turn=None))


def test_bad_input_raises():
  ids = np.zeros((2, 3), np.int32)
  r = np.zeros((2, 2), np.float32)
  m = np.ones((2, 2), bool)
  ok = as_turns(ids, r, m)
  cases = [
    (as_turns(np.zeros((2, 2), np.int32), r, m), "state_ids must be"),
    (as_turns(ids.astype(np.float32), r, m), "integers"),
    (as_turns(ids, np.zeros((2, 3)), m), "rewards must be"),
    (as_turns(ids, np.array([[0, np.nan], [0, 0]], np.float32), m), "finite"),
    (as_turns(ids, r, np.array([[0, 1], [1, 1]], bool)), "run from turn 0"),
    (as_turns(ids, r, m.astype(np.int32)), "boolean"),
    (ok.replace(success=np.ones(3, bool)), "success must be"),
    (ok.replace(token_turn=np.array([[0, 2], [0, 1]], np.int32)), r"in \[-1, K\)"),
    (ok.replace(turn_mask=np.array([[1, 0], [1, 1]], bool),
                token_turn=np.array([[0, 1], [0, 1]], np.int32)), "not taken"),
    (ok.replace(token_turn=np.zeros((3, 4), np.int32)), "token_turn must be"),
    (as_turns(np.full((2, 3), 2**40), r, m), "fit in int32"),
  ]
  for turns, message in cases:
    with pytest.raises(ValueError, match=message):
      validate_turns(turns)
  validate_turns(as_turns(ids, np.array([[0, 1], [0, np.nan]], np.float32),
                          np.array([[1, 1], [1, 0]], bool)))  # NaN on an untaken turn is fine
  with pytest.raises(ValueError, match="masked token"):
    rollouts = credit.Rollouts(tokens=np.zeros((2, 2), np.int32),
                               mask=np.array([[1, 0], [1, 1]], bool), rewards=np.zeros(2))
    validate_turns(ok.replace(token_turn=np.zeros((2, 2), np.int32)), rollouts)
  for fn, hp, message in ((agents.gigpo, dict(mode="std"), "mode"),
                          (agents.gigpo, dict(gamma=1.5), "gamma"),
                          (agents.gagpo, dict(normalize="batch"), "normalize"),
                          (agents.gtpo, dict(normalize="turn"), "normalize"),
                          (agents.graphgpo, dict(edges="all"), "edges"),
                          (agents.graphgpo, dict(omega=0.0), "omega"),
                          (agents.cast, {}, "solver_steps"),
                          (agents.cast, dict(solver_steps=np.zeros((2, 2))), "solver_steps"),
                          (agents.cast, dict(signal="values"), "values_star"),
                          (agents.cast, dict(signal="values", values_star=np.zeros((2, 2))),
                           "values_star"),
                          (agents.cast, dict(signal="value"), "signal"),
                          (agents.cast, dict(normalize="rms"), "normalize"),
                          (agents.cast, dict(alpha=-0.1), "alpha")):
    with pytest.raises(ValueError, match=message):
      fn(ok, **hp)
  with pytest.raises(ValueError, match="state_ids must be"):
    agents.salt(as_turns(np.zeros((2, 2), np.int32), r, m))


def test_registered_agent_estimators_read_rollouts_turns():
  """credit.get(name)(rollouts) == the token wrapper on rollouts.turns; a clear error without turns."""
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 3, (4, 3)).astype(np.int32)
  turns = credit.Turns(state_ids=ids, rewards=rng.random((4, 2)).astype(np.float32),
                       turn_mask=np.ones((4, 2), bool),
                       token_turn=np.tile(np.array([0, 0, -1, 1, 1], np.int32), (4, 1)))
  rollouts = credit.Rollouts(tokens=np.zeros((4, 5), np.int32), mask=turns.token_turn >= 0,
                             rewards=turns.rewards.sum(-1), turns=turns)
  for name in ("gigpo", "gagpo", "salt", "graphgpo", "gtpo"):
    assert credit.needs(name) == ("turns",)
    np.testing.assert_array_equal(credit.get(name)(rollouts),
                                  agents.AGENT_TOKEN_ESTIMATORS[name](rollouts, turns))
    with pytest.raises(ValueError, match="needs rollouts.turns"):
      credit.get(name)(rollouts.replace(turns=None))
