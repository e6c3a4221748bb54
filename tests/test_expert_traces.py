"""Expert-trace credit (issue 23): the one-to-one matching of actions against the expert's
trace (experiments/rollouts/agent_sampling.py) and MatchTIR (credit/expert_traces.py)
against plain-Python references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
from credit import expert_traces as et
from credit.turns import Turns, validate_turns
from envs.household import Household
from experiments.rollouts import agent_sampling as ags
from test_agent_credit import ref_returns
from test_step_graph import turn_groups  # noqa: E402 (tests/ is on sys.path)

B, G, K, A = 3, 4, 5, 2


def ref_match(acts, mask, ref, ref_mask):
  out = np.zeros(mask.shape, bool)
  for b in range(acts.shape[0]):
    for g in range(acts.shape[1]):
      pool = [tuple(ref[b, 0, j]) for j in range(ref.shape[2]) if ref_mask[b, 0, j]]
      for k in range(acts.shape[2]):
        a = tuple(acts[b, g, k])
        if mask[b, g, k] and a in pool:
          pool.remove(a)
          out[b, g, k] = True
  return out


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_matching_is_one_to_one_and_maximal(seed):
  rng = np.random.default_rng(seed)
  acts = rng.integers(0, 3, (B, G, K, A)).astype(np.int32)
  ref = rng.integers(0, 3, (B, 1, K, A)).astype(np.int32)
  mask = np.arange(K) < rng.integers(0, K + 1, (B, G, 1))
  ref_mask = np.arange(K) < rng.integers(0, K + 1, (B, 1, 1))
  got = np.asarray(ags.match_actions(acts, mask, ref, ref_mask))
  np.testing.assert_array_equal(got, ref_match(acts, mask, ref, ref_mask))


def test_the_expert_matches_its_own_trace_every_turn():
  env = Household(max_turns=8)
  ep = ags.expert_episodes(env, jax.random.key(0), 16)
  got = np.asarray(ags.expert_matches(ep, ep, env))
  np.testing.assert_array_equal(got, np.asarray(ep.turn_mask))
  # A trajectory that repeats a move matches it once.
  _, acts, _ = ags.split_slots(ep.tokens, env)
  twice = acts.at[:, :, 1].set(acts[:, :, 0])
  got = np.asarray(ags.match_actions(twice, ep.turn_mask, acts, ep.turn_mask))
  assert not got[:, 0, 1].any() and got[:, 0, 0].all()


def ref_matchtir(rewards, mask, matches, omega, gamma):
  r = np.where(mask, matches, 0.0)
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    ret = ref_returns(r[b], mask[b], gamma)
    vals = [ret[i][k] for i in range(G) for k in range(int(mask[b, i].sum()))]
    episode = np.array([sum(rewards[b, i, :int(mask[b, i].sum())]) for i in range(G)])
    a_traj = (np.zeros(G) if episode.max() == episode.min()
              else (episode - episode.mean()) / (episode.std(ddof=1) + 1e-6))
    for i in range(G):
      for k in range(int(mask[b, i].sum())):
        a_turn = 0.0
        if len(vals) > 1 and max(vals) > min(vals):
          a_turn = (ret[i][k] - np.mean(vals)) / (np.std(vals, ddof=1) + 1e-6)
        out[b, i, k] = a_traj[i] + omega * a_turn
  return out


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([(1.0, 1.0), (0.5, 0.9), (0.0, 1.0)]))
def test_matchtir_matches_reference(group, seed, hp):
  ids, rewards, mask, success = group
  matches = (np.random.default_rng(seed).random(mask.shape) < 0.5) & mask
  turns = validate_turns(Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success,
                               expert_matches=matches))
  got = np.asarray(et.matchtir(turns, omega=hp[0], gamma=hp[1]))
  want = ref_matchtir(np.where(mask, rewards, 0.0), mask, matches, *hp)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_matchtir_needs_matches_and_checks_them():
  mask = np.ones((G, K), bool)
  turns = Turns(state_ids=np.zeros((G, K + 1), np.int32), rewards=np.zeros((G, K), np.float32),
                turn_mask=mask)
  with pytest.raises(ValueError, match="expert_matches"):
    et.matchtir(turns)
  with pytest.raises(ValueError, match="expert_matches must be boolean"):
    et.matchtir(turns.replace(expert_matches=np.zeros((G, K), np.int32)))
  assert credit.needs("matchtir") == ("turns", "expert_matches")


# ------------------------------------------------------------------ InfoPO


def test_info_gains_equal_teacher_forcing_with_the_feedback_masked():
  from experiments.models import decoder
  env = Household(max_turns=6)
  pcfg = decoder.PolicyConfig(vocab_size=env.vocab_size, d_model=16, num_layers=1, num_heads=2,
                              d_ff=32, max_len=ags.sequence_length(env))
  params = decoder.init_params(jax.random.PRNGKey(2), pcfg)
  ep = ags.sample_episodes(params, pcfg, env, jax.random.key(4), 2, 2)
  got = np.asarray(ags.info_gains(params, pcfg, env, ep.tokens, ep.policy_mask, env.pad_id))
  action_pos, obs_pos, _ = ags.slot_layout(env)
  tokens, pm = np.asarray(ep.tokens), np.asarray(ep.policy_mask)
  lp = jax.jit(lambda x: decoder.token_logprobs(params, pcfg, x[:, :1], x[:, 1:])[0])
  for b in range(2):
    for g in range(2):
      base = np.asarray(lp(jnp.asarray(tokens[b, g][None])))[0]
      for k in range(env.max_turns):
        if k + 1 == env.max_turns or not pm[b, g, action_pos[k + 1]].any():
          assert got[b, g, k] == 0.0
          continue
        x = tokens[b, g].copy()
        x[obs_pos[k]] = env.pad_id
        masked = np.asarray(lp(jnp.asarray(x[None])))[0]
        on = action_pos[k + 1][pm[b, g, action_pos[k + 1]]]
        np.testing.assert_allclose(got[b, g, k], np.mean(base[on - 1] - masked[on - 1]),
                                   rtol=1e-4, atol=1e-5)
  assert np.any(got != 0)


def ref_infopo(rewards, mask, gains, beta, gamma):
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    ret = ref_returns(np.where(mask[b], gains[b], 0.0), mask[b], gamma)
    vals = [ret[i][k] for i in range(G) for k in range(int(mask[b, i].sum()))]
    episode = np.array([sum(rewards[b, i, :int(mask[b, i].sum())]) for i in range(G)])
    flat = episode.max() == episode.min()
    a_out = np.zeros(G) if flat else (episode - episode.mean()) / (episode.std(ddof=1) + 1e-6)
    for i in range(G):
      for k in range(int(mask[b, i].sum())):
        a_info = 0.0
        if len(vals) > 1 and max(vals) > min(vals):
          a_info = (ret[i][k] - np.mean(vals)) / (np.std(vals, ddof=1) + 1e-6)
        out[b, i, k] = a_out[i] + (1.0 if flat else beta) * a_info
  return out


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([(0.5, 1.0), (0.0, 0.9), (1.0, 1.0)]))
def test_infopo_matches_reference(group, seed, hp):
  ids, rewards, mask, success = group
  gains = np.where(mask, np.random.default_rng(seed).normal(size=mask.shape), 0.0)
  turns = validate_turns(Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success,
                               info_gains=gains.astype(np.float32)))
  got = np.asarray(et.infopo(turns, beta=hp[0], gamma=hp[1]))
  np.testing.assert_allclose(got, ref_infopo(np.where(mask, rewards, 0.0), mask, gains, *hp),
                             rtol=2e-4, atol=2e-5)


def test_infopo_refuses_missing_or_non_finite_gains():
  mask = np.ones((G, K), bool)
  turns = Turns(state_ids=np.zeros((G, K + 1), np.int32), rewards=np.zeros((G, K), np.float32),
                turn_mask=mask)
  with pytest.raises(ValueError, match="info_gains"):
    et.infopo(turns)
  bad = np.zeros((G, K), np.float32)
  bad[1, 2] = np.nan
  with pytest.raises(ValueError, match=r"info_gains\[1, 2\]"):
    et.infopo(turns.replace(info_gains=bad))
