"""The long-horizon household variant (envs/household_long.py, issue 23): one sub-task is
household's task, the expert solves every episode with distances that count down, reward
only when every sub-task holds, and BEACON's family script runs on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs.household import Household
from envs.household_long import HouseholdLong
from experiments.rollouts import agent_sampling as ags

KEY = jax.random.key(0)


def test_one_sub_task_observes_and_acts_as_household():
  long, house = HouseholdLong(num_goals=1, max_turns=8), Household(max_turns=8)
  state = long.reset(KEY, 16)[0]
  flat = state.replace(goal_obj=state.goal_obj[:, 0], goal_rec=state.goal_rec[:, 0],
                       goal_clean=state.goal_clean[:, 0])
  for _ in range(7):
    for a, b in ((long.observe(state), house.observe(flat)),
                 (long.milestones(state)[:, :3], house.milestones(flat)),  # [:, 3]: solved again
                 (long.expert_action(state), house.expert_action(flat)),
                 (long.optimal_distance(state), house.optimal_distance(flat))):
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    act = long.expert_action(state)
    state = long.step(state, *act)[0]
    flat = house.step(flat, *act)[0]


def test_expert_solves_all_sub_tasks_and_its_distances_count_down():
  env = HouseholdLong(num_goals=3, max_turns=30)
  start = env.reset(jax.random.fold_in(KEY, 0), 128)[0]  # expert_episodes' starts
  d0 = np.asarray(env.optimal_distance(start))
  assert list(d0) == [len(env.expert_plan(start, i)) for i in range(128)]
  assert d0.min() >= 3 * 4 - 2 and d0.max() <= 18  # 4-6 turns a sub-task (hall start: +0)
  ep = ags.expert_episodes(env, KEY, 128)
  assert bool(jnp.all(ep.success))
  np.testing.assert_array_equal(np.asarray(ep.lengths)[:, 0], d0)
  d = np.asarray(ep.distances)[:, 0]
  for k in range(env.max_turns):
    np.testing.assert_array_equal(d[:, k], np.maximum(d0 - k, 0))
  m = np.asarray(ep.milestones)  # [B, G, K+1, 3 x 3 + 1]
  assert m.shape[-1] == 10 and m[:, 0, -1, -1].all() and not m[:, 0, 0, -1].any()


def test_reward_only_when_every_sub_task_holds():
  env = HouseholdLong(num_goals=2, max_turns=12)
  state = env.reset(KEY, 64)[0]
  for _ in range(12):
    state, _, _, reward, done, info = env.step(state, *env.expert_action(state))
    solved = np.asarray(info["solved"])
    first = np.asarray(info["milestones"])[:, 2]  # sub-task 0 holds
    np.testing.assert_array_equal(np.asarray(reward), solved.astype(np.float32))
    assert not np.any(solved & ~first)
  assert np.all(np.asarray(state.done))
  with pytest.raises(ValueError, match="num_goals"):
    envs.get_env("household_long", num_goals=5)
  with pytest.raises(ValueError, match="max_turns"):
    envs.get_env("household_long", num_goals=3, max_turns=12)


@pytest.mark.slow  # ~40-80 s: 12-turn episodes; BEACON's household run is in the agents test
def test_beacon_family_script_runs_quick_on_the_long_variant(tmp_path):
  from configs import agents as agents_config
  from configs import milestones as milestones_config
  from experiments.training import compare, loop
  long = milestones_config.get_config('long')
  cfg = agents_config.shrink(long, long)
  cfg.progress = False
  cfg.task.kwargs = {'num_goals': 2, 'max_turns': 12}
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['beacon:iid', 'grpo:iid']
  rows = loop.read_metrics(tmp_path / 'beacon_iid' / 'seed0' / 'metrics.jsonl')
  assert all(np.isfinite(r['loss']) for r in rows if 'reward' in r)


def test_long_configs_build_and_check():
  from configs import milestones
  from experiments.training import loop
  for variant, goals, turns in (('long', 2, 20), ('long3', 3, 30), ('long_warm', 2, 20)):
    c = milestones.get_config(variant)
    assert c.sft.steps == (450 if variant == 'long_warm' else 150)
    loop.check_config(c)
    assert dict(c.task.kwargs) == {'num_goals': goals, 'max_turns': turns}
    assert c.model.attn_chunk == 128 and c.methods == 'grpo:iid,beacon:iid'
  with pytest.raises(ValueError, match='long3'):
    milestones.get_config('long4')
