"""Turn-level normalisation (credit/turn_norm.py, issue 23): MT-GRPO, MAPO for dialogue and
MemoPilot against plain-Python references, their reductions to GTPO and GRPO, and NaN."""

import collections
import statistics

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


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K), (1, K)), batch=(2,)), st.sampled_from([0.0, 0.5, 1.0]),
       st.booleans())
def test_mt_grpo_matches_reference(group, lam, scale):
  got = np.asarray(tn.mt_grpo(as_turns(group), lam=lam, scale_by_std=scale))
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
