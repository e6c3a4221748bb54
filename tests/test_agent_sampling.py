"""The multi-turn agent sampler (experiments.rollouts.agent_sampling) against step-by-step env replays
from Python and a teacher-forced forward pass over the whole trajectory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import credit
from credit.turns import validate_turns
from envs import exact_mdp, sokoban
from experiments.rollouts import agent_sampling as ags
from experiments.models import decoder

MDP = exact_mdp.ExactMDP(max_turns=4)
SOKOBAN = sokoban.Sokoban(height=5, width=5, num_boxes=1, carve_steps=8, reverse_steps=2,
                          num_tries=4, max_turns=3)
KEY = jax.random.key(7)


def tiny_policy(env, obs_ids, action_ids, seed=0, **model):
  """A 1-layer d_model-32 decoder (random params built in NumPy: compiling init_params is
  slow) nudged towards well-formed actions, so that episodes end at different turns:
  after an observation token an action token (or, less often, EOA), after an action
  token EOA. `model`: other `decoder.PolicyConfig` fields. Returns (params, pcfg)."""
  pcfg = decoder.PolicyConfig(**{**dict(vocab_size=env.vocab_size, d_model=32, num_layers=1,
                                        num_heads=2, d_ff=64, max_len=ags.sequence_length(env)),
                                 **model})
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    name = path[-1].key
    if name == "scale":
      return np.ones(x.shape, np.float32)
    return (rng.normal(size=x.shape) * (0.5 if name == "embedding" else 0.18)).astype(np.float32)

  shapes = jax.eval_shape(functools.partial(decoder.init_params, cfg=pcfg), jax.random.key(0))
  params = jax.tree_util.tree_map_with_path(leaf, shapes)
  emb, head = params["embed"]["embedding"], params["head"]["kernel"]
  emb[np.asarray(obs_ids), 0] += 8.0
  emb[np.asarray(action_ids), 1] += 8.0
  head[0, np.asarray(action_ids)] += 0.6
  head[0, env.eoa_id] += 0.3
  head[1, env.eoa_id] += 0.6
  return jax.tree.map(jnp.asarray, params), pcfg


@functools.lru_cache(maxsize=None)
def env_fns(env):
  """env.reset, env.step and env.state_id, each jitted on its own (outside the sampler)."""
  return (jax.jit(env.reset, static_argnums=1), jax.jit(env.step), jax.jit(env.state_id))


@pytest.fixture(scope="module")
def mdp():
  s, a = MDP.num_states, MDP.num_actions
  params, pcfg = tiny_policy(MDP, range(s), range(s, s + a))
  return params, pcfg, ags.sample_episodes(params, pcfg, MDP, KEY, 4, 8, temperature=1.0)


@pytest.fixture(scope="module")
def soko():
  params, pcfg = tiny_policy(SOKOBAN, range(sokoban.FIRST_MOVE),
                             range(sokoban.FIRST_MOVE, sokoban.FIRST_MOVE + 4))
  # Start states from the replay's own (jitted) env.reset: one compile of Sokoban's generator.
  start = env_fns(SOKOBAN)[0](jax.random.fold_in(KEY, 0), 2)
  return params, pcfg, ags.sample_episodes(params, pcfg, SOKOBAN, KEY, 2, 4, temperature=1.0,
                                           start=start)


def replay(env, key, ep):
  """Replays the env step by step from Python with the sampled actions and checks every
  recorded field."""
  reset, step, state_id = env_fns(env)
  ep = jax.tree.map(np.asarray, ep)
  b, g, t = ep.tokens.shape
  k = ep.turn_mask.shape[-1]
  assert t == ags.sequence_length(env, k)
  state, obs, obs_mask = reset(jax.random.fold_in(key, 0), b)
  state, obs, obs_mask = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0), (state, obs, obs_mask))
  flat = lambda x: x.reshape((b * g,) + x.shape[2:])
  obs0, actions, observations = map(flat, ags.split_slots(ep.tokens, env, k))
  mask0, policy, no_obs = map(flat, ags.split_slots(ep.policy_mask, env, k))
  omask0, no_act, omasks = map(flat, ags.split_slots(ep.obs_mask, env, k))
  assert not mask0.any() and not no_obs.any() and not no_act.any()
  np.testing.assert_array_equal(obs0, np.where(obs_mask, obs, env.pad_id))
  np.testing.assert_array_equal(omask0, obs_mask)
  key_name = "goal" if isinstance(env, exact_mdp.ExactMDP) else "solved"
  success = np.zeros(b * g, bool)
  for turn in range(k):
    live = ~np.asarray(state.done)
    np.testing.assert_array_equal(flat(ep.turn_mask)[:, turn], live)
    np.testing.assert_array_equal(flat(ep.state_ids)[:, turn], state_id(state))
    act, pol = actions[:, turn], policy[:, turn]
    # The policy mask is the action up to and including its first EOA, on live turns only.
    is_eoa = act == env.eoa_id
    first = np.where(is_eoa.any(-1), is_eoa.argmax(-1), env.action_len - 1)
    want = (np.arange(env.action_len) <= first[:, None]) & live[:, None]
    np.testing.assert_array_equal(pol, want)
    assert np.all(act[~pol] == env.pad_id)
    state, obs, obs_mask, reward, done, info = step(state, act, pol)
    shown = np.asarray(obs_mask) & live[:, None]
    np.testing.assert_array_equal(omasks[:, turn], shown)
    np.testing.assert_array_equal(observations[:, turn], np.where(shown, obs, env.pad_id))
    np.testing.assert_allclose(flat(ep.turn_rewards)[:, turn], np.where(live, reward, 0.0))
    success |= np.asarray(info[key_name]) & live
  np.testing.assert_array_equal(flat(ep.state_ids)[:, k], state_id(state))
  np.testing.assert_array_equal(flat(ep.done), state.done)
  np.testing.assert_array_equal(flat(ep.success), success)
  tt = flat(ep.token_turn)
  _, _, turn_of = ags.slot_layout(env, k)
  np.testing.assert_array_equal(tt, np.where(flat(ep.policy_mask), turn_of, -1))


def check_logprobs(params, pcfg, ep):
  forced = ags.teacher_forced_logprobs(params, pcfg, ep.tokens)
  mask = np.asarray(ep.policy_mask)
  np.testing.assert_allclose(np.where(mask, forced, 0.0), ep.logprobs, atol=1e-4)
  assert np.all(np.asarray(ep.logprobs)[~mask] == 0.0)
  assert np.all(np.asarray(ep.logprobs)[mask] <= 0.0)


def test_shapes_static_and_deterministic(mdp):
  params, pcfg, ep = mdp
  k, t = MDP.max_turns, ags.sequence_length(MDP)
  assert t == 1 + k * 3
  want = dict(tokens=((4, 8, t), jnp.int32), policy_mask=((4, 8, t), jnp.bool_),
              obs_mask=((4, 8, t), jnp.bool_), token_turn=((4, 8, t), jnp.int32),
              logprobs=((4, 8, t), jnp.float32), turn_rewards=((4, 8, k), jnp.float32),
              turn_mask=((4, 8, k), jnp.bool_), done=((4, 8), jnp.bool_),
              state_ids=((4, 8, k + 1), jnp.int32), success=((4, 8), jnp.bool_),
              parent=((4, 8), jnp.int32), fork_turn=((4, 8), jnp.int32))
  for name, (shape, dtype) in want.items():
    x = getattr(ep, name)
    assert x.shape == shape and x.dtype == dtype, name
  again = ags.sample_episodes(params, pcfg, MDP, KEY, 4, 8, temperature=1.0)
  jax.tree.map(np.testing.assert_array_equal, ep, again)
  size = ags.sample_episodes._cache_size()
  other = ags.sample_episodes(params, pcfg, MDP, jax.random.key(8), 4, 8, temperature=0.7)
  assert ags.sample_episodes._cache_size() == size  # key and temperature are traced
  assert not np.array_equal(other.tokens, ep.tokens)
  # Groups share their start state; every episode ends at the turn limit at the latest.
  ids = np.asarray(ep.state_ids)
  assert np.all(ids[:, :, 0] == ids[:, :1, 0])
  assert np.all(ep.done) and np.all(np.asarray(ep.parent) == -1)
  np.testing.assert_array_equal(ep.lengths, np.asarray(ep.turn_mask).sum(-1))
  with pytest.raises(ValueError, match="max_len"):
    ags.sample_episodes(params, dataclasses.replace(pcfg, max_len=t - 1), MDP, KEY, 1, 1)


def test_mdp_replay_and_coverage(mdp):
  _, _, ep = mdp
  replay(MDP, KEY, ep)
  lengths = np.asarray(ep.lengths)
  policy = np.asarray(ep.policy_mask)
  _, act_mask, _ = ags.split_slots(policy, MDP)
  assert (lengths < MDP.max_turns).any() and (lengths == MDP.max_turns).any()
  assert np.asarray(ep.success).any() and not np.asarray(ep.success).all()
  taken = np.asarray(ep.turn_mask)
  n_tokens = act_mask.sum(-1)[taken]
  assert (n_tokens == 1).any() and (n_tokens == 2).any()  # EOA first, and longer actions


def test_logprobs_match_teacher_forcing(mdp, soko):
  check_logprobs(*mdp)
  check_logprobs(*soko)


def test_sokoban_replay(soko):
  _, _, ep = soko
  replay(SOKOBAN, KEY, ep)
  assert ep.tokens.shape[-1] == 30 + 3 * 32


def test_gigpo_on_rollouts(mdp):
  _, _, ep = mdp
  rollouts = ags.to_rollouts(ep)
  validate_turns(rollouts.turns, rollouts)
  np.testing.assert_allclose(rollouts.rewards, np.asarray(ep.turn_rewards).sum(-1), atol=1e-6)
  adv = np.asarray(credit.get("gigpo")(rollouts))
  assert adv.shape == ep.tokens.shape and np.all(np.isfinite(adv))
  assert np.all(adv[~np.asarray(ep.policy_mask)] == 0.0)
  assert np.any(adv != 0.0)


def test_fork_episodes(mdp):
  params, pcfg, iid = mdp
  n, c, k = 2, 4, 1  # G = 8, as in the i.i.d. fixture (shared compiled checks)
  ep = ags.fork_episodes(params, pcfg, MDP, KEY, 4, n, c, k)
  assert ep.tokens.shape == (4, n * c, ags.sequence_length(MDP))
  parent, fork_turn, _ = ags.fork_layout(n, c, k)
  np.testing.assert_array_equal(ep.parent, np.broadcast_to(parent, (4, n * c)))
  np.testing.assert_array_equal(ep.fork_turn, np.broadcast_to(fork_turn, (4, n * c)))
  # Continuation 0 of chain j is the i.i.d. sampler's trajectory j (the same node id).
  np.testing.assert_array_equal(ep.tokens[:, ::c], iid.tokens[:, :n])
  np.testing.assert_allclose(ep.logprobs[:, ::c], iid.logprobs[:, :n], atol=1e-6)
  # Forks copy their parent's first k turns (and its start state's id) ...
  cut = MDP.obs_len + k * (MDP.action_len + MDP.obs_len)
  src = np.repeat(np.arange(n) * c, c)
  np.testing.assert_array_equal(ep.tokens[:, :, :cut], np.asarray(ep.tokens)[:, src, :cut])
  np.testing.assert_array_equal(ep.state_ids[:, :, :k + 1],
                                np.asarray(ep.state_ids)[:, src, :k + 1])
  # ... then sample their own continuations.
  assert not np.array_equal(ep.tokens[:, :, cut:], np.asarray(ep.tokens)[:, src, cut:])
  replay(MDP, KEY, ep)
  check_logprobs(params, pcfg, ep)
