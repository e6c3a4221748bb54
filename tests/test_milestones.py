"""Milestone credit (credit.milestones.beacon, issue 23) against a plain-Python reference, its
outcome counterpart, and the milestones the household sampler reports."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import credit
from credit import milestones as ms
from credit.turns import Turns, validate_turns
from test_agent_credit import grpo_per_turn, ref_grpo
from test_step_graph import turn_groups  # noqa: E402 (tests/ is on sys.path)

G, K = 4, 3


def ref_beacon(rewards, mask, milestones, gamma, omega, scale=True):
  """Loops over one group [G, K]: segments closed by key turns, γ^(κ − t) shaping, mean per
  segment index over the group's turns, plus GRPO of the returns."""
  g, k = np.shape(mask)
  shaped, seg = {}, {}
  for i in range(g):
    n = int(sum(mask[i]))
    keys = [t for t in range(n) if milestones[i][t] > 0]
    for t in range(n):
      closing = [c for c in keys if c >= t]
      shaped[i, t] = gamma ** (closing[0] - t) if closing else 0.0
      seg[i, t] = sum(1 for c in keys if c < t)
  episode = ref_grpo(rewards, mask, scale)
  out = np.zeros((g, k))
  for (i, t), r in shaped.items():
    same = [shaped[key] for key in shaped if seg[key] == seg[i, t]]
    a_seg = r - np.mean(same) if len(same) > 1 else 0.0
    out[i, t] = episode[i] + omega * a_seg
  return out


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([(0.9, 1.0), (0.5, 0.3), (1.0, 2.0)]))
def test_beacon_matches_reference(group, seed, hp):
  ids, rewards, mask, success = group
  m = np.where(mask, np.random.default_rng(seed).integers(0, 3, mask.shape) * (
      np.random.default_rng(seed + 1).random(mask.shape) < 0.4), 0).astype(np.int32)
  turns = validate_turns(Turns(state_ids=ids, rewards=rewards, turn_mask=mask,
                               success=success, milestones=m))
  got = np.asarray(ms.beacon(turns, gamma=hp[0], omega=hp[1]))
  for b in range(2):
    np.testing.assert_allclose(got[b], ref_beacon(rewards[b], mask[b], m[b], *hp), rtol=2e-4,
                               atol=2e-5)


def test_without_milestones_beacon_is_grpo_on_every_turn():
  rng = np.random.default_rng(0)
  mask = np.arange(K) < rng.integers(1, K + 1, (G, 1))
  rewards = np.where(mask & ~np.roll(mask, -1, 1), rng.integers(0, 2, (G, 1)), 0.0)
  rewards = rewards.astype(np.float32)
  turns = Turns(state_ids=np.zeros((G, K + 1), np.int32), rewards=rewards, turn_mask=mask,
                milestones=np.zeros((G, K), np.int32))
  np.testing.assert_allclose(ms.beacon(turns), grpo_per_turn(rewards, mask), atol=1e-6)
  with pytest.raises(ValueError, match="milestones"):
    ms.beacon(turns.replace(milestones=None))
  with pytest.raises(ValueError, match=">= 0"):
    ms.beacon(turns.replace(milestones=-np.ones((G, K), np.int32)))
  with pytest.raises(ValueError, match="gamma"):
    ms.beacon(turns, gamma=1.5)
  assert credit.needs("beacon") == ("turns", "milestones")


def test_household_reports_the_milestones_each_turn_achieves():
  """Expert household episodes: every milestone the start state lacks is achieved exactly
  once, the last on the solving turn; `credit.get('beacon')` reads them through the loop's
  Turns."""
  from envs import household
  from experiments.rollouts import agent_sampling as ags
  env = household.Household(max_turns=8)
  ep = ags.expert_episodes(env, jax.random.key(0), 32)
  assert ep.milestones.shape == ep.state_ids.shape + (3,)
  turns_m = np.asarray(ags.milestone_turns(ep, env))
  start = np.asarray(ep.milestones)[:, :, 0]  # [B, G, M] of s_0
  np.testing.assert_array_equal(turns_m.sum(-1), (~start).sum(-1))
  last = np.asarray(ep.lengths) - 1
  assert np.all(np.take_along_axis(turns_m, last[..., None], -1)[..., 0] >= 1)  # solved
  turns = Turns(ep.state_ids, ep.turn_rewards, ep.turn_mask, token_turn=ep.token_turn,
                success=ep.success, milestones=turns_m)
  rollouts = credit.Rollouts(tokens=ep.tokens, mask=ep.policy_mask | ep.obs_mask,
                             rewards=ep.returns, policy_mask=ep.policy_mask, turns=turns)
  adv = np.asarray(credit.get("beacon")(rollouts))
  assert adv.shape == ep.tokens.shape and np.all(np.isfinite(adv))
  assert np.all(adv[~np.asarray(ep.policy_mask)] == 0)
