"""Tests for the multi-turn environments: envs/multiturn.py, sokoban.py, exact_mdp.py, household.py.

Compiles dominate, so every environment goes through a few jitted functions
cached per environment and shape (one reset size N, one rollout length T).
Sokoban's dynamics are checked against a plain-Python reference, its rooms and
values against the BFS solver; the exact MDP's closed-form values against
Monte-Carlo returns; household's expert plans against the rewards and milestones.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs import exact_mdp, household, multiturn, sokoban

N = 32
SETTINGS = hypothesis.settings(max_examples=4, deadline=None, derandomize=True)
SOKOBAN = sokoban.Sokoban(step_penalty=0.05)
MDP = exact_mdp.ExactMDP(step_reward_scale=0.1)
HOUSE = household.Household()
ENVS = {"sokoban": SOKOBAN, "exact_mdp": MDP, "household": HOUSE}
ACTION_IDS = {  # the action tokens before EOA
    "sokoban": [[i] for i in range(sokoban.FIRST_MOVE, sokoban.FIRST_MOVE + 4)],
    "exact_mdp": [[i] for i in range(MDP.num_states, MDP.num_states + MDP.num_actions)],
    "household": [[HOUSE.token_id(v), HOUSE.token_id(a)] for v in household.VERBS
                  for a in household.RECEPTACLES + household.OBJECTS],
}


def _key(seed):
  return jax.random.key(seed)  # threefry: "rbg" draws differ under vmap


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _row(tree, *idx):
  return jax.tree.map(lambda x: x[idx], tree)


_reset = jax.jit(lambda env, key, n: env.reset(key, n), static_argnums=(0, 2))
_step = jax.jit(lambda env, *args: env.step(*args), static_argnums=0)
_ids = jax.jit(lambda env, state, with_turn: env.state_id(state, with_turn), static_argnums=(0, 2))


@functools.partial(jax.jit, static_argnums=0)
def _rollout(env, state, actions, masks):
  """Steps through actions [T, n, A]: (states [T+1, n, ...], obs, obs_mask, reward, done, info)."""

  def body(state, x):
    out = env.step(state, *x)
    return out[0], (out[0],) + out[1:]

  last, (states, *rest) = jax.lax.scan(body, state, (actions, masks))
  states = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), state, states)
  return (states, *rest)


def _random_actions(name, rng, shape):
  """Actions int32 [*shape, A], masks: mostly valid, ~15% random tokens, ~10% cut short."""
  env = ENVS[name]
  ids = np.asarray(ACTION_IDS[name])
  tokens = np.full(shape + (env.action_len,), env.pad_id, np.int32)
  tokens[..., :ids.shape[1]] = ids[rng.integers(0, len(ids), shape)]
  tokens[..., ids.shape[1]] = env.eoa_id
  noise = rng.random(tokens.shape) < 0.08
  tokens = np.where(noise, rng.integers(0, env.vocab_size, tokens.shape), tokens).astype(np.int32)
  length = np.where(rng.random(shape) < 0.1, rng.integers(0, env.action_len, shape),
                    env.action_len)
  return tokens, np.arange(env.action_len) < length[..., None]


@functools.lru_cache(maxsize=None)
def _episodes(name, seed):
  """A random-action rollout of N episodes over K + 2 turns, as NumPy arrays."""
  env = ENVS[name]
  state, obs, obs_mask = _reset(env, _key(seed), N)
  actions, masks = _random_actions(name, np.random.default_rng(seed), (env.max_turns + 2, N))
  out = _rollout(env, state, actions, masks)
  return _host((obs, obs_mask)), actions, masks, _host(out)


# --- the interface, for every environment -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENVS))
def test_shapes_and_vocab(name):
  env = ENVS[name]
  (obs, obs_mask), actions, _, (states, obs_t, mask_t, reward, done, info) = _episodes(name, 0)
  t = env.max_turns + 2
  assert obs.shape == obs_mask.shape == (N, env.obs_len) and obs.dtype == np.int32
  assert obs_t.shape == mask_t.shape == (t, N, env.obs_len)
  assert reward.shape == (t, N) and reward.dtype == np.float32 and done.dtype == np.bool_
  assert all(v.shape[:2] == (t, N) for v in info.values()) and "invalid" in info
  assert len(set(env.vocab)) == env.vocab_size and env.vocab[env.eoa_id] == multiturn.EOA
  assert np.all((obs >= 0) & (obs < env.vocab_size))
  # Observation masks are a prefix, pad after it.
  for o, m in ((obs, obs_mask), (obs_t, mask_t)):
    assert np.all(m[..., :-1] >= m[..., 1:]) and np.all(np.where(m, True, o == env.pad_id))
  assert isinstance(env.detokenize(obs[0]), str)
  # The turn limit: every episode is done after K turns.
  assert np.all(done[env.max_turns - 1]) and np.all(states.turn <= env.max_turns)


@pytest.mark.parametrize("name", sorted(ENVS))
def test_done_is_absorbing_and_invalid_is_noop(name):
  env = ENVS[name]
  _, _, _, (states, obs, obs_mask, reward, done, info) = _episodes(name, 1)
  arrays = lambda s: [np.asarray(a) for a in env._state_arrays(s)] + [s.turn, s.done]
  before, after = _row(states, slice(0, -1)), _row(states, slice(1, None))
  was_done = before.done
  assert np.any(was_done) and np.any(~was_done)
  for a, b in zip(arrays(before), arrays(after)):  # done: the same state
    assert np.array_equal(a[was_done], b[was_done])
  assert np.all(reward[was_done] == 0) and np.all(done[was_done])
  assert all(np.all(v[was_done] == 0) for v in info.values())
  assert not np.any(was_done[0])  # so obs[t - 1] is the observation of before[t]
  assert np.array_equal(obs[1:][was_done[1:]], obs[:-1][was_done[1:]])
  assert np.array_equal(done, after.done) and np.all(after.turn == before.turn + ~was_done)
  # Invalid actions on live episodes change nothing but the turn.
  bad = info["invalid"] & ~was_done
  assert np.any(bad)
  for a, b in zip(arrays(before)[:-2], arrays(after)[:-2]):
    assert np.array_equal(a[bad], b[bad])


@pytest.mark.parametrize("name", ["exact_mdp", "sokoban"])  # (household: ~10 s of compiles)
def test_jit_matches_eager(name):
  env = ENVS[name]
  state, _, _ = _reset(env, _key(2), N)
  actions, masks = _random_actions(name, np.random.default_rng(2), (N,))
  jitted = _host(_step(env, state, actions, masks))
  eager = _host(env.step(state, actions, masks))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)))


@pytest.mark.parametrize("name", ["exact_mdp", "sokoban"])  # (household: ~10 s of compiles)
def test_vmap(name):
  env = ENVS[name]
  keys = jax.random.split(_key(3), 2)
  actions, masks = _random_actions(name, np.random.default_rng(3), (2, N))

  @jax.jit
  @jax.vmap
  def reset_and_step(key, actions, masks):  # [2, N, ...] per leaf
    state, obs, obs_mask = env.reset(key, N)
    return (state, obs, obs_mask), env.step(state, actions, masks)

  batched = _host(reset_and_step(keys, actions, masks))
  for i in range(2):
    reset = _host(_reset(env, keys[i], N))
    one = (reset, _host(_step(env, reset[0], actions[i], masks[i])))
    assert all(np.array_equal(a[i], b) for a, b in zip(jax.tree.leaves(batched),
                                                        jax.tree.leaves(one)))


@pytest.mark.parametrize("name", sorted(ENVS))
@pytest.mark.parametrize("with_turn", [False, True])
def test_state_ids_equal_iff_states_equal(name, with_turn):
  env = ENVS[name]
  states = jax.tree.map(lambda *x: np.concatenate(x), *[_episodes(name, s)[3][0] for s in (0, 1)])
  flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), states)
  ids = np.asarray(_ids(env, flat, with_turn))
  arrays = [np.asarray(a) for a in env._state_arrays(flat)] + [flat.done]
  if with_turn:
    arrays.append(flat.turn)
  keys = [b"".join(a[i].tobytes() for a in arrays) for i in range(len(ids))]
  _, inverse = np.unique(np.array(keys, dtype=object), return_inverse=True)
  _, id_inverse = np.unique(ids, return_inverse=True)
  assert ids.dtype == np.int32 and len(set(keys)) >= 6
  same_state = inverse[:, None] == inverse[None]
  assert np.array_equal(same_state, id_inverse[:, None] == id_inverse[None])


def test_hash_arrays_depends_on_every_word():
  rng = np.random.default_rng(0)
  base = rng.integers(-2**31, 2**31, (1, 20), dtype=np.int64).astype(np.int32)
  rows = np.repeat(base, 41, axis=0)
  for j in range(20):
    rows[1 + 2 * j, j] += 1
    rows[2 + 2 * j, j] ^= np.int32(-2**31)
  ids = np.asarray(multiturn.hash_arrays([rows]))
  assert len(set(ids.tolist())) == 41
  assert np.array_equal(ids, np.asarray(multiturn.hash_arrays([rows[:, :10], rows[:, 10:]])))


# --- Sokoban ------------------------------------------------------------------------------------


def _ref_render(walls, targets, boxes, player):
  """Python reference of the observation text."""
  lines = []
  for r in range(walls.shape[0]):
    line = ""
    for c in range(walls.shape[1]):
      t = targets[r, c]
      if walls[r, c]:
        line += "#"
      elif (r, c) == tuple(player):
        line += "+" if t else "@"
      elif boxes[r, c]:
        line += "*" if t else "$"
      else:
        line += "." if t else " "
    lines.append(line + "\n")
  return "".join(lines)


def _ref_step(env, room, tokens, mask):
  """Plain-Python Sokoban step on a dict room: (room, reward, done, invalid)."""
  room = dict(room, boxes=room["boxes"].copy(), player=list(room["player"]))
  if room["done"]:
    return room, 0.0, True, False
  move = None
  if mask[0] and mask[1] and tokens[1] == env.eoa_id and env.vocab[tokens[0]] in sokoban.MOVES:
    move = sokoban.MOVES.index(env.vocab[tokens[0]])
  if move is not None:
    dr, dc = {0: (-1, 0), 1: (1, 0), 2: (0, -1), 3: (0, 1)}[move]
    r, c = room["player"]
    q, s = (r + dr, c + dc), (r + 2 * dr, c + 2 * dc)
    if not room["walls"][q]:
      if not room["boxes"][q]:
        room["player"] = list(q)
      elif not room["walls"][s] and not room["boxes"][s]:
        room["boxes"][q], room["boxes"][s] = False, True
        room["player"] = list(q)
  solved = bool(np.array_equal(room["boxes"], room["targets"]))
  room["turn"] += 1
  room["done"] = solved or room["turn"] >= env.max_turns
  return room, float(solved) - env.step_penalty, room["done"], move is None


def test_sokoban_rooms_are_solvable_in_time():
  env = SOKOBAN
  for seed in range(3):
    state, obs, _ = _host(_reset(env, _key(10 + seed), N))
    d = sokoban.distances(state)
    assert np.all((d >= 1) & (d <= env.reverse_steps)), d  # solvable, not solved, in time
    assert np.all(state.walls[:, [0, -1]]) and np.all(state.walls[:, :, [0, -1]])
    assert np.all(state.boxes.sum((1, 2)) == env.num_boxes)
    assert np.all(state.targets.sum((1, 2)) == env.num_boxes)
    assert not np.any(state.boxes & state.walls) and not np.any(state.targets & state.walls)
    for i in range(N):
      r, c = state.player[i]
      assert not state.walls[i, r, c] and not state.boxes[i, r, c]
      assert env.detokenize(obs[i]) == _ref_render(state.walls[i], state.targets[i],
                                                   state.boxes[i], state.player[i])
  assert len({env.detokenize(o) for o in obs}) > N // 2  # rooms differ


@hypothesis.given(seed=st.integers(0, 2**16))
@SETTINGS
def test_sokoban_step_matches_python_reference(seed):
  env = SOKOBAN
  state, _, _ = _host(_reset(env, _key(20), N))  # one room set; the actions vary
  actions, masks = _random_actions("sokoban", np.random.default_rng(seed), (env.max_turns + 2, N))
  states, obs, _, reward, done, info = _host(_rollout(env, state, actions, masks))
  for i in range(N):
    room = {"walls": state.walls[i], "targets": state.targets[i], "boxes": state.boxes[i].copy(),
            "player": list(state.player[i]), "turn": 0, "done": False}
    for t in range(actions.shape[0]):
      was_done = room["done"]
      room, r, dn, invalid = _ref_step(env, room, actions[t, i], masks[t, i])
      assert np.array_equal(states.boxes[t + 1, i], room["boxes"])
      assert list(states.player[t + 1, i]) == room["player"]
      assert np.isclose(reward[t, i], r) and done[t, i] == dn
      assert states.turn[t + 1, i] == room["turn"]
      assert info["invalid"][t, i] == (invalid and not was_done)
      assert env.detokenize(obs[t, i]) == _ref_render(room["walls"], room["targets"],
                                                      room["boxes"], room["player"])


def test_sokoban_optimal_plans_and_values():
  env, gamma = SOKOBAN, 0.9
  state, _, _ = _host(_reset(env, _key(30), N))
  d = sokoban.distances(state)
  t = env.max_turns + 2
  moves = np.random.default_rng(0).integers(0, 4, (t, N))
  for i in range(N):
    plan = sokoban.optimal_actions(state, i)
    assert len(plan) == d[i]
    moves[:len(plan), i] = plan
  tokens, masks = env.move_tokens(moves)
  states, _, _, reward, done, info = _host(_rollout(env, state, tokens, masks))
  steps = np.arange(t)[:, None]
  solved_at = np.argmax(info["solved"], axis=0)
  assert np.all(info["solved"].any(0)) and np.array_equal(solved_at, d - 1)
  assert np.allclose(reward[steps < d], -env.step_penalty + (steps == d - 1)[steps < d])
  # Bellman optimality: equality along optimal plans, <= for any action.
  v = np.stack([sokoban.optimal_values(env, _row(states, k), gamma) for k in range(t + 1)])
  backup = reward + gamma * v[1:]
  assert np.allclose(v[:-1][steps < d], backup[steps < d])
  assert np.isclose(v[0], gamma**(d - 1) - env.step_penalty * (1 - gamma**d) / (1 - gamma)).all()
  rand_tokens, rand_masks = env.move_tokens(np.random.default_rng(1).integers(0, 4, (t, N)))
  states, _, _, reward, _, _ = _host(_rollout(env, state, rand_tokens, rand_masks))
  v = np.stack([sokoban.optimal_values(env, _row(states, k), gamma) for k in range(t + 1)])
  assert np.all(v[:-1] >= reward + gamma * v[1:] - 1e-9)
  assert np.all(v[-1] == 0)  # all done after K turns


def test_sokoban_validates():
  with pytest.raises(ValueError, match="max_turns"):
    sokoban.Sokoban(reverse_steps=20, max_turns=16)
  with pytest.raises(ValueError, match="num_boxes"):
    sokoban.Sokoban(width=4, num_boxes=3)


# --- the exact MDP ------------------------------------------------------------------------------


def test_exact_mdp_values_are_consistent():
  env = MDP
  p, r = env.tables
  assert np.allclose(p.sum(-1), 1) and np.all(p >= 0)
  logits = np.random.default_rng(0).normal(size=(env.num_states, env.num_actions))
  vals = _host(jax.jit(env.values, static_argnums=1)(logits, 0.9))
  assert vals.v.shape == (env.max_turns + 1, env.num_states)
  assert vals.q.shape == vals.adv.shape == (env.max_turns, env.num_states, env.num_actions)
  assert np.allclose((vals.policy * vals.adv).sum(-1), 0, atol=1e-6)
  assert np.all(vals.v[-1] == 0) and np.all(vals.v[:, env.terminal] == 0)
  # A plain NumPy backward induction.
  pi = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  v = np.zeros(env.num_states)
  for t in reversed(range(env.max_turns)):
    q = (p * (r + 0.9 * np.where(env.terminal, 0, v))).sum(-1) * ~env.terminal[:, None]
    v = (pi * q).sum(-1)
    assert np.allclose(vals.q[t], q, atol=1e-5) and np.allclose(vals.v[t], v, atol=1e-5)
  # sample_actions draws from π: 20000 draws in state 1.
  state = exact_mdp.MDPState(s=np.ones(20000, np.int32), turn=np.zeros(20000, np.int32),
                             done=np.zeros(20000, bool), rng=np.zeros(20000, np.uint32))
  tokens, mask, a = _host(jax.jit(env.sample_actions)(_key(5), logits, state))
  assert np.all(tokens[:, 0] == a + env.num_states) and np.all(tokens[:, 1] == env.eoa_id)
  assert np.allclose(np.bincount(a, minlength=env.num_actions) / 20000, pi[1], atol=0.015)


def test_exact_mdp_closed_form_matches_monte_carlo():
  env, gamma, n = MDP, 0.9, 20000
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(env.num_states, env.num_actions)))
  vals = _host(env.values(logits, gamma))

  @jax.jit
  def episodes(key):
    k0, k1 = jax.random.split(key)
    state, _, _ = env.reset(k0, n)

    log_pi = jnp.log(env.values(logits).policy)  # [K, S, A]
    gumbel = jax.random.gumbel(k1, (env.max_turns, n, env.num_actions))

    def body(state, x):
      log_pi, g = x
      a = jnp.argmax(log_pi[state.s] + g, axis=-1)  # a ~ π(. | s), Gumbel-max
      nxt, _, _, reward, _, _ = env.step(state, *env.action_tokens(a))
      return nxt, (state.s, state.done, a, reward)

    return jax.lax.scan(body, state, (log_pi, gumbel))[1]

  s, was_done, a, reward = _host(episodes(_key(4)))
  returns, acc = np.zeros_like(reward), np.zeros(n)
  for t in reversed(range(env.max_turns)):
    acc = reward[t] + gamma * acc
    returns[t] = acc
  checked = 0
  for t in range(env.max_turns):
    for i in range(env.num_live):
      live = (s[t] == i) & ~was_done[t]
      if t == 0:  # V at the start, over all first actions
        se = returns[0][live].std() / np.sqrt(live.sum())
        assert abs(returns[0][live].mean() - vals.v[0, i]) < 4.5 * se + 1e-3
      for j in range(env.num_actions):
        sel = live & (a[t] == j)
        if sel.sum() >= 200:
          se = returns[t][sel].std() / np.sqrt(sel.sum())
          assert abs(returns[t][sel].mean() - vals.q[t, i, j]) < 4.5 * se + 1e-3, (t, i, j)
          adv = env.step_advantages(vals, s[t][sel], a[t][sel], np.full(sel.sum(), t))
          assert np.allclose(adv, vals.q[t, i, j] - vals.v[t, i])
          checked += 1
  assert checked >= 2 * env.num_live * env.num_actions


# --- household ----------------------------------------------------------------------------------


def test_household_expert_plans_solve():
  env = HOUSE
  state, obs, obs_mask = _host(_reset(env, _key(40), N))
  t = env.max_turns + 2
  tokens = np.full((t, N, env.action_len), env.pad_id, np.int32)
  tokens[..., 0], tokens[..., 1] = env.token_id("go"), env.token_id("hall")
  tokens[..., 2] = env.eoa_id
  lengths = []
  for i in range(N):
    plan = env.expert_plan(state, i)
    lengths.append(len(plan))
    for k, action in enumerate(plan):
      tokens[k, i] = env.pad_action(action + [multiturn.EOA])[0]
  lengths = np.array(lengths)
  assert np.all((lengths >= 4) & (lengths <= 6))
  assert {4, 6} <= set(lengths.tolist())  # without and with cleaning (5: Y is the sink)
  states, obs_t, _, reward, done, info = _host(_rollout(env, state, tokens, tokens != env.pad_id))
  steps = np.arange(t)[:, None]
  assert np.array_equal(reward, (steps == lengths - 1).astype(np.float32))
  assert np.array_equal(np.argmax(done, 0), lengths - 1) and not np.any(info["invalid"])
  m = info["milestones"]
  assert np.all(m[:-1] <= m[1:] + (steps[:-1, :, None] >= lengths[:, None] - 1))  # monotone
  assert np.all(m[lengths - 1, np.arange(N)])
  text = env.detokenize(np.where(obs_mask[0], obs[0], env.pad_id))
  goal = f"{household.OBJECTS[state.goal_obj[0]]} in {household.RECEPTACLES[state.goal_rec[0]]}"
  assert text.startswith("task : put ") and goal in text and "you are at hall" in text
  bad = env.pad_action(["take", "hall", multiturn.EOA])
  _, obs_bad, mask_bad, _, _, info = _host(_step(env, state, np.tile(bad[0], (N, 1)),
                                                 np.tile(bad[1], (N, 1))))
  assert np.all(info["invalid"])
  assert env.detokenize(np.where(mask_bad[0], obs_bad[0], env.pad_id)).startswith(
      "nothing happens . task")


def test_environments_by_name():
  import envs
  assert envs.env_names() == ("exact_mdp", "household", "household_long", "household_retry",
                             "sokoban", "webshop")
  assert envs.get_env("sokoban", height=5) == envs.Sokoban(height=5)
  with pytest.raises(ValueError, match="unknown environment 'maze'; valid names: exact_mdp"):
    envs.get_env("maze")
  with pytest.raises(ValueError, match="unknown argument.*rooms.*valid arguments"):
    envs.get_env("household", rooms=3)
