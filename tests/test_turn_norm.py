"""Turn-level normalisation (credit/turn_norm.py, issue 23): MT-GRPO, MAPO for dialogue and
MemoPilot against plain-Python references, their reductions to GTPO and GRPO, and NaN."""

import collections
import statistics

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
from credit import turn_norm as tn
from credit.turns import Turns, validate_turns
from test_agent_credit import EPS, lengths_of, ref_episode, ref_gtpo, ref_norm
from test_step_graph import turn_groups  # noqa: E402 (tests/ is on sys.path)

G, K = 4, 3


def ref_mt_grpo(rewards, mask, lam, scale=True):
  """Loops over [B, G, K]: turn k's reward normalised over the group's trajectories at turn
  k (a bucket of one or of equal rewards: 0), plus lam x GRPO of the episode return."""
  out = np.zeros(np.shape(mask))
  for b in range(np.shape(mask)[0]):
    n = lengths_of(mask[b])
    at = collections.defaultdict(list)
    for i, nn in enumerate(n):
      for k in range(nn):
        at[k].append(float(rewards[b][i][k]))
    r = ref_episode(rewards[b], mask[b])
    for i, nn in enumerate(n):
      a_out = ref_norm(r[i], r, scale)
      for k in range(nn):
        rows = at[k]
        a_t = 0.0
        if len(rows) > 1 and max(rows) > min(rows):
          mu, sd = statistics.fmean(rows), statistics.stdev(rows)
          a_t = (rewards[b][i][k] - mu) / (sd + EPS) if scale else rewards[b][i][k] - mu
        out[b, i, k] = a_t + lam * a_out
  return out


def as_turns(group):
  ids, rewards, mask, success = group
  return validate_turns(Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success))


# Jitted once per shape and scale_by_std (λ traced): op by op its ~120 primitives compile
# one by one for each shape. Its unjitted calls (values validated on the host): the tests below.
_mt_grpo = jax.jit(tn.mt_grpo, static_argnames="scale_by_std")


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K), (1, K)), batch=(2,)), st.sampled_from([0.0, 0.5, 1.0]),
       st.booleans())
def test_mt_grpo_matches_reference(group, lam, scale):
  got = np.asarray(_mt_grpo(as_turns(group), lam=lam, scale_by_std=scale))
  np.testing.assert_allclose(got, ref_mt_grpo(group[1], group[2], lam, scale), rtol=2e-4,
                             atol=2e-5)


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.sampled_from([0.0, 0.3, 1.0]),
       st.sampled_from([1.0, 0.9]))
def test_mapo_turns_mixes_turn_and_batch_normalisation(group, alpha, gamma):
  _, rewards, mask, _ = group
  got = np.asarray(tn.mapo_turns(as_turns(group), alpha=alpha, gamma=gamma))
  want = (alpha * ref_gtpo(rewards, mask, gamma, "group_turn")
          + (1 - alpha) * ref_gtpo(rewards, mask, gamma, "batch"))
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@settings(max_examples=20, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)))
def test_memopilot_is_group_normalised_turn_returns(group):
  _, rewards, mask, _ = group
  np.testing.assert_allclose(np.asarray(tn.memopilot(as_turns(group))),
                             ref_gtpo(rewards, mask, 1.0, "group"), rtol=2e-4, atol=2e-5)


def test_outcome_only_rewards_give_grpo_before_the_last_turn_and_nan_stays_nan():
  mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], bool)
  last = mask & ~np.concatenate([mask[:, 1:], np.zeros((G, 1), bool)], 1)
  rewards = np.where(last, np.array([[1.0], [0.0], [1.0], [0.0]]), 0.0).astype(np.float32)
  turns = Turns(state_ids=np.arange(G * (K + 1), dtype=np.int32).reshape(G, K + 1),
                rewards=rewards, turn_mask=mask, success=rewards.sum(1) > 0)
  grpo = np.asarray(credit.get("grpo")(credit.Rollouts(np.zeros((G, K), np.int32), mask,
                                                      rewards.sum(1))))
  got = np.asarray(tn.mt_grpo(turns, lam=1.0))
  np.testing.assert_allclose(got[:, 0], grpo[:, 0], atol=1e-6)  # turn 0: no turn reward varies
  with pytest.raises(ValueError, match="rewards"):
    tn.mt_grpo(turns.replace(rewards=np.where(mask, np.nan, 0.0).astype(np.float32)))
  with pytest.raises(ValueError, match="alpha"):
    tn.mapo_turns(turns, alpha=1.5)


def test_registered_token_level_on_action_tokens():
  mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], bool)
  rewards = np.where(mask, np.random.default_rng(0).normal(size=(G, K)), 0.0).astype(np.float32)
  token_turn = np.repeat(np.where(mask, np.arange(K), -1), 2, 1)
  token_turn[:, ::2] = -1  # observation tokens
  turns = Turns(state_ids=np.zeros((G, K + 1), np.int32), rewards=rewards, turn_mask=mask,
                success=np.zeros(G, bool), token_turn=token_turn.astype(np.int32))
  tok_mask = np.repeat(mask, 2, 1)
  r = credit.Rollouts(np.zeros((G, 2 * K), np.int32), tok_mask, rewards.sum(1), turns=turns)
  for name, fn in tn.TURN_NORM_ESTIMATORS.items():
    assert credit.needs(name) == ("turns",)
    got = np.asarray(credit.get(name)(r))
    np.testing.assert_allclose(got[:, 1::2], np.asarray(fn(turns)), atol=1e-6)
    assert np.all(got[:, ::2] == 0)


# ~20 s: MT-GRPO's plumbing ('turns') is gigpo's in test_golden's agents_experience; InfoPO's
# and MatchTIR's fields: test_agent_needs.
@pytest.mark.slow
def test_turn_norm_and_expert_trace_family_scripts_run_quick(tmp_path):
  from configs import agents as agents_config
  from configs import turn_norm as turn_norm_config
  from experiments.training import compare, loop
  cfg = agents_config.shrink(turn_norm_config.get_config(), turn_norm_config.get_config())
  cfg.progress = False
  cfg.methods = 'grpo:iid,mt_grpo:iid'  # the family's estimators share the `turns` plumbing
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['grpo:iid', 'mt_grpo:iid']
  rows = loop.read_metrics(tmp_path / 'mt_grpo_iid' / 'seed0' / 'metrics.jsonl')
  assert all(np.isfinite(r['loss']) and 0 <= r['success'] <= 1 for r in rows if 'reward' in r)
  # The expert-trace family (MatchTIR, InfoPO) in the same workdir: its GRPO run is this one.
  from configs import expert_traces as expert_config
  cfg = agents_config.shrink(expert_config.get_config(), expert_config.get_config())
  cfg.progress = False
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['grpo:iid', 'infopo:iid', 'matchtir:iid']
  for m in ('matchtir_iid', 'infopo_iid'):
    rows = loop.read_metrics(tmp_path / m / 'seed0' / 'metrics.jsonl')
    assert all(np.isfinite(r['loss']) for r in rows if 'reward' in r), m


def ref_mr_search(rewards, mask, attempt, alpha, beta, discount):
  """Loops over one group [G, K]: leave-one-out ORM of the returns plus β x the discounted
  sum over later attempts of each attempt's leave-one-out reward."""
  g, k = np.shape(mask)
  n = lengths_of(mask)
  ret = [float(np.sum(rewards[i][:n[i]], dtype=np.float64)) for i in range(g)]
  loo = lambda x, i, rows: x[i] - np.mean([x[j] for j in rows if j != i]) if len(rows) > 1 else 0.0
  orm = [loo(ret, i, range(g)) for i in range(g)]
  r = {(i, s): sum(float(rewards[i][t]) for t in range(n[i]) if attempt[i][t] == s)
       for i in range(g) for s in set(attempt[i][:n[i]])}
  step = {}
  for (i, s) in r:
    rows = [j for j in range(g) if (j, s) in r]
    step[i, s] = r[i, s] - np.mean([r[j, s] for j in rows if j != i]) if len(rows) > 1 else 0.0
  out = np.zeros((g, k))
  for i in range(g):
    for t in range(n[i]):
      s = attempt[i][t]
      cum = sum(discount ** (u - s) * step[i, u] for (j, u) in step if j == i and u >= s)
      out[i, t] = alpha * orm[i] + beta * cum
  return out


@settings(max_examples=20, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([(1.0, 1.0, 1.0), (0.5, 2.0, 0.9), (1.0, 0.0, 1.0)]))
def test_mr_search_matches_reference(group, seed, hp):
  ids, rewards, mask, success = group
  ends = np.where(mask, np.random.default_rng(seed).random(mask.shape) < 0.4, 0).astype(np.int32)
  attempt = np.where(mask, np.cumsum(ends, -1) - ends, 0)  # counted by the ends before each turn
  turns = Turns(ids, rewards, mask, success=success, attempts=attempt.astype(np.int32))
  got = np.asarray(tn.mr_search(turns, alpha=hp[0], beta=hp[1], discount=hp[2]))
  for b in range(2):
    np.testing.assert_allclose(got[b], ref_mr_search(rewards[b], mask[b], attempt[b], *hp),
                               rtol=2e-4, atol=2e-4)


def test_mr_search_with_one_attempt_is_leave_one_out_grpo_and_refuses_bad_attempts():
  rng = np.random.default_rng(1)
  mask = np.arange(K) < rng.integers(1, K + 1, (G, 1))
  rewards = np.where(mask, rng.integers(0, 2, (G, K)), 0).astype(np.float32)
  turns = Turns(np.zeros((G, K + 1), np.int32), rewards, mask,
                attempts=np.zeros((G, K), np.int32))
  r = rewards.sum(-1)
  loo = r - (r.sum() - r) / (G - 1)
  np.testing.assert_allclose(tn.mr_search(turns, beta=0.0), np.where(mask, loo[:, None], 0.0),
                             atol=1e-6)
  np.testing.assert_allclose(tn.mr_search(turns), np.where(mask, 2 * loo[:, None], 0.0), atol=1e-6)
  with pytest.raises(ValueError, match="attempts"):
    tn.mr_search(turns.replace(attempts=None))
  with pytest.raises(ValueError, match="non-decreasing"):
    tn.mr_search(turns.replace(turn_mask=np.ones((G, K), bool),
                               attempts=np.array([[1, 0, 0]] * G, np.int32)))
  assert credit.needs("mr_search") == ("turns", "attempts")
  # The loop refuses attempt credit on an environment without retries (household's milestones
  # are sub-goals, not attempt ends).
  import types
  from envs.household import Household
  from experiments.rollouts import agent_rollouts
  fake = types.SimpleNamespace(env=Household(), num_turns=K)
  samples = types.SimpleNamespace(turns=turns, episodes=None)
  with pytest.raises(ValueError, match="household_retry"):
    agent_rollouts.AgentProblem.turns(fake, None, None, samples, needs=("turns", "attempts"))


def test_household_retry_restarts_a_failed_attempt_with_the_failure_in_context():
  import jax
  import jax.numpy as jnp
  import envs
  from experiments.rollouts import agent_sampling as ags
  env = envs.get_env("household_retry", attempts=2, max_turns=12)
  # Reset, step and milestones jitted, as the loop's sampler runs them (op by op they
  # compile over a hundred small programs).
  step, milestones = jax.jit(env.step), jax.jit(env.milestones)
  state, _, _ = jax.jit(env.reset, static_argnums=1)(jax.random.key(0), 2)
  start = state
  wait = [jnp.asarray(np.repeat(x[None], 2, 0)) for x in env.pad_action(["go", "hall", "<eoa>"])]
  for t in range(6):  # the first attempt runs out of turns: the house is reset, "retry" shown
    assert not np.asarray(milestones(state)).any()
    state, obs, mask, reward, done, info = step(state, *wait)
  assert np.all(np.asarray(info["attempt_end"])) and not np.asarray(done).any()
  assert np.all(np.asarray(state.attempt) == 1) and np.all(np.asarray(state.retry))
  assert np.all(np.asarray(obs[:, 0]) == env.token_id("retry"))
  assert env.render(state, 0) == "retry " + env.render(start, 0)
  np.testing.assert_array_equal(milestones(state), [[True, False]] * 2)
  for f in ("loc", "holding", "obj_loc", "clean", "goal_obj"):
    np.testing.assert_array_equal(getattr(state, f), getattr(start, f))
  assert env.state_id(state)[0] != env.state_id(start)[0]  # the attempt is part of the state
  # The expert solves the first attempt; its solving turn ends attempt 0 (and the episode).
  ep = ags.expert_episodes(env, jax.random.key(1), 8)
  assert np.all(np.asarray(ep.success)) and np.all(np.asarray(ep.lengths) <= 6)
  ends = np.asarray(ags.milestone_turns(ep, env))
  np.testing.assert_array_equal(ends.sum(-1), 1)
  with pytest.raises(ValueError, match="max_turns"):
    envs.get_env("household_retry", attempts=2, max_turns=10)


def test_mr_search_trains_on_household_retry_through_the_loop(tmp_path):
  """From a random start (no warm start: every attempt fails and is retried) the loop fills the
  attempts mr_search reads (it raises without them); with no success in the
  batch every reward, so every advantage and the policy loss, is 0. The estimator's numbers:
  the reference tests above; with successes: the family run below (slow)."""
  import jax
  from configs import agents as agents_config
  from configs import turn_norm as turn_norm_config
  from experiments.models import decoder
  from experiments.training import loop
  cfg = agents_config.shrink(turn_norm_config.get_config('retry'),
                             turn_norm_config.get_config('retry'))
  cfg.progress, cfg.quick = False, False
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 1, 1, 1
  params0 = decoder.init_params(jax.random.PRNGKey(0), loop.build_problem(cfg).pcfg)
  loop.train(cfg, str(tmp_path), params0, method='mr_search:iid')
  rows = [r for r in loop.read_metrics(tmp_path / 'metrics.jsonl') if 'reward' in r]
  assert len(rows) == 1 and np.isfinite(rows[0]['loss'])
  assert rows[0]['turns'] == 12 and rows[0]['success'] == 0  # both attempts, all failed
  assert rows[0]['loss'] == 0 and rows[0]['frac_groups_with_signal'] == 0


@pytest.mark.slow  # ~60 s; mr_search's loop path: the test above
def test_retry_family_script_runs_quick(tmp_path):
  from configs import agents as agents_config
  from configs import turn_norm as turn_norm_config
  from experiments.training import compare, loop
  cfg = agents_config.shrink(turn_norm_config.get_config('retry'),
                             turn_norm_config.get_config('retry'))
  cfg.progress = False
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 1, 1, 1
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['grpo:iid', 'mr_search:iid']
  rows = [r for r in loop.read_metrics(tmp_path / 'mr_search_iid' / 'seed0' / 'metrics.jsonl')
          if 'reward' in r]
  assert rows and all(np.isfinite(r['loss']) for r in rows)
  assert all(7 <= r['turns'] <= 12 for r in rows)  # an unsolved first attempt is retried


def test_confidence_config_builds_and_checks():
  # TAURA and CoPO train through the agent loop in tests/test_agent_loop.py (taura) and
  # share its plumbing (copo_turns reads the sampling log-probs every loop keeps).
  from configs import turn_norm as turn_norm_config
  from experiments.training import loop
  cfg = turn_norm_config.get_config('confidence')
  loop.check_config(cfg)
  assert cfg.methods == 'grpo:iid,taura:iid,copo_turns:iid' and cfg.seeds == (0, 1, 2, 3, 4)
  with pytest.raises(ValueError, match='confidence'):
    turn_norm_config.get_config('confidences')
