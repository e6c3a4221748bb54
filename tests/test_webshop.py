"""Tests for envs/webshop.py against a plain-Python reference of one episode.

Compiles dominate, so everything goes through one jitted reset (N episodes) and
one jitted rollout of T = K + 2 turns whose action at each turn comes from a
per-episode source: random tokens, the expert, or "buy the open product". The
reference re-implements the catalogue rules, search, the transitions, the
reward, the observation text and (by dynamic programming over the reachable
states) the shortest distance to reward 1.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import multiturn, webshop
from envs.webshop import CATEGORIES, COLOURS, PRICES, SIZES

ENV = webshop.WebShop()
N, T = 64, ENV.max_turns + 2
RANDOM, EXPERT, BUY_OPEN = 0, 1, 2
# Every well-formed action, as token strings before EOA.
ACTIONS = ([["search", w] for w in CATEGORIES + COLOURS]
           + [["search", a, b] for a in CATEGORIES for b in COLOURS]
           + [["search", b, a] for a in CATEGORIES for b in COLOURS]
           + [["click", f"p{k}"] for k in range(ENV.num_products)]
           + [["choose", s] for s in SIZES]
           + [["buy", f"p{k}"] for k in range(ENV.num_products)])


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _row(tree, *idx):
  return jax.tree.map(lambda x: x[idx], tree)


_reset = jax.jit(ENV.reset, static_argnums=1)
_step = jax.jit(ENV.step)
_distance = jax.jit(ENV.optimal_distance)


@jax.jit
def _rollout(state, actions, masks, source):
  """T turns; actions [T, N, A] where source [T, N] is RANDOM, else the expert's or `buy p<item>`.

  Returns (states [T+1, N, ...], actions, masks, distance [T+1, N], obs, obs_mask, reward, done,
  info), the actions being those taken.
  """

  def body(state, x):
    a, m, src = x
    ea, em = ENV.expert_action(state)
    buy = jnp.stack([jnp.full((N,), ENV.token_id("buy")), webshop.FIRST_PRODUCT + state.item,
                     jnp.full((N,), ENV.eoa_id), jnp.full((N,), ENV.pad_id)], 1)
    a = jnp.where((src == EXPERT)[:, None], ea, jnp.where((src == BUY_OPEN)[:, None], buy, a))
    m = jnp.where((src == EXPERT)[:, None], em,
                  jnp.where((src == BUY_OPEN)[:, None], jnp.arange(4) < 3, m))
    out = ENV.step(state, a, m)
    return out[0], (out[0], a, m, ENV.optimal_distance(state)) + out[1:]

  last, (states, a, m, dist, *rest) = jax.lax.scan(body, state, (actions, masks, source))
  states = jax.tree.map(lambda x, y: jnp.concatenate([x[None], y]), state, states)
  dist = jnp.concatenate([dist, ENV.optimal_distance(last)[None]])
  return (states, a, m, dist, *rest)


def _random_actions(rng, shape, noise=0.08):
  """Well-formed actions int32 [*shape, A] and masks, with token noise and ~10% cut short."""
  tokens = np.full(shape + (ENV.action_len,), ENV.pad_id, np.int32)
  lengths = np.zeros(shape, np.int32)
  for idx in np.ndindex(*shape):
    words = ACTIONS[rng.integers(len(ACTIONS))] + [multiturn.EOA]
    tokens[idx][:len(words)] = ENV.encode(words)
    lengths[idx] = len(words)
  flip = rng.random(tokens.shape) < noise
  tokens = np.where(flip, rng.integers(0, ENV.vocab_size, tokens.shape), tokens).astype(np.int32)
  lengths = np.where(rng.random(shape) < 0.1 * (noise > 0), rng.integers(0, 4, shape), lengths)
  return tokens, np.arange(ENV.action_len) < lengths[..., None]


@functools.lru_cache(maxsize=None)
def _episodes(seed, expert_prob=0.0, buy_prob=0.0, noise=0.08):
  rng = np.random.default_rng(seed)
  state, obs, obs_mask = _reset(jax.random.key(seed), N)
  actions, masks = _random_actions(rng, (T, N), noise)
  u = rng.random((T, N))
  source = np.where(u < expert_prob, EXPERT, np.where(u < expert_prob + buy_prob, BUY_OPEN, RANDOM))
  return _host((state, obs, obs_mask)), _host(_rollout(state, actions, masks, source))


# --- the plain-Python reference -----------------------------------------------------------------


def _catalogue(state, i):
  """Episode i's catalogue and goal as Python values."""
  s = _row(state, i)
  products = [dict(cat=int(s.category[k]), col=int(s.colour[k]), price=int(s.price[k]),
                   sizes=[z for z in range(3) if s.sizes[k, z]]) for k in range(ENV.num_products)]
  return products, tuple(int(x) for x in s.goal), int(s.target)


def _results(products, query):
  cat, col = query
  hits = [k for k, p in enumerate(products)
          if (cat is None or p["cat"] == cat) and (col is None or p["col"] == col)]
  return hits[:ENV.page_size]


def _score(product, chosen, goal):
  cat, col, size, bound = goal
  return (int(product["cat"] == cat) + int(product["col"] == col) + int(chosen == size)
          + int(product["price"] < bound)) / 4


def _ref_step(products, goal, st, tokens, mask):
  """One step on st = (page, query, item, chosen): (st, reward, bought, valid)."""
  words = [ENV.vocab[t] if m else None for t, m in zip(tokens, mask)]
  if multiturn.EOA not in words or None in words[:words.index(multiturn.EOA)] or \
      words[0] == multiturn.EOA:
    return st, 0.0, False, False
  verb, *args = words[:words.index(multiturn.EOA)]
  page, query, item, chosen = st
  pid = lambda w: int(w[1:]) if w.startswith("p") and w[1:].isdigit() else None
  if verb == "search" and 1 <= len(args) <= 2:
    cats = [CATEGORIES.index(w) for w in args if w in CATEGORIES]
    cols = [COLOURS.index(w) for w in args if w in COLOURS]
    if len(cats) <= 1 and len(cols) <= 1 and len(cats) + len(cols) == len(args):
      return ("results", (cats[0] if cats else None, cols[0] if cols else None), None, None), \
          0.0, False, True
  if len(args) != 1:
    return st, 0.0, False, False
  arg = args[0]
  if verb == "click" and page == "results" and pid(arg) in _results(products, query):
    return ("product", None, pid(arg), None), 0.0, False, True
  if verb == "choose" and page == "product" and arg in SIZES and \
      SIZES.index(arg) in products[item]["sizes"]:
    return (page, None, item, SIZES.index(arg)), 0.0, False, True
  if verb == "buy" and page == "product" and pid(arg) == item:
    return st, _score(products[item], chosen, goal), True, True
  return st, 0.0, False, False


def _ref_text(products, goal, st, invalid):
  page, query, item, chosen = st
  cat, col, size, bound = goal
  text = "invalid action . " if invalid else ""
  text += f"i want a {COLOURS[col]} {CATEGORIES[cat]} size {SIZES[size]} under {PRICES[bound]} . "
  if page == "start":
    return text + "search for a product ."
  if page == "results":
    words = ([COLOURS[query[1]]] if query[1] is not None else []) + (
        [CATEGORIES[query[0]]] if query[0] is not None else [])
    hits = [f"p{k}" for k in _results(products, query)] or ["none"]
    return text + " ".join(["results", "for"] + words + [":"] + hits + ["."])
  p = products[item]
  text += (f"p{item} {COLOURS[p['col']]} {CATEGORIES[p['cat']]} price {PRICES[p['price']]} "
           f"sizes {' '.join(SIZES[z] for z in p['sizes'])} .")
  return text + (f" chosen {SIZES[chosen]} ." if chosen is not None else "")


def _ref_distances(products, goal):
  """Shortest number of turns to reward 1 from every reachable (page, query, item, chosen)."""
  tokens = [ENV.pad_action(a + [multiturn.EOA]) for a in ACTIONS]
  start = ("start", None, None, None)
  edges, todo = {}, [start]
  while todo:
    st = todo.pop()
    if st in edges:
      continue
    edges[st] = []
    for a, m in tokens:
      nxt, reward, bought, valid = _ref_step(products, goal, st, a, m)
      if bought and reward == 1.0:
        edges[st].append("solved")
      elif valid and not bought:
        edges[st].append(nxt)
        todo.append(nxt)
  dist = {st: np.inf for st in edges} | {"solved": 0}
  for _ in range(6):  # every reachable state is within 4 turns of reward 1
    dist |= {st: min([dist[s] + 1 for s in succ] + [dist[st]]) for st, succ in edges.items()}
  return dist


@functools.lru_cache(maxsize=None)
def _distances(seed, i):
  return _ref_distances(*_catalogue(_episodes(seed)[0][0], i)[:2])


def _ref_state(state, t, i):
  s = _row(state, t, i)
  page = ("start", "results", "product")[int(s.page)]
  query = tuple(int(q) if q >= 0 else None for q in s.query)
  none = lambda x: int(x) if x >= 0 else None
  return (page, query if page == "results" else None, none(s.item), none(s.chosen))


# --- tests --------------------------------------------------------------------------------------


def test_catalogues_have_one_matching_product():
  state, obs, obs_mask = _episodes(0)[0]
  shared = 0
  for i in range(N):
    products, goal, target = _catalogue(state, i)
    cat, col, size, bound = goal
    matches = [k for k, p in enumerate(products) if p["cat"] == cat and p["col"] == col
               and size in p["sizes"] and p["price"] < bound]
    assert matches == [target] and 1 <= bound <= 3 and all(p["sizes"] for p in products)
    assert target in _results(products, (cat, col))  # the expert's search finds it
    shared += sum(p["cat"] == cat and p["col"] == col for p in products) - 1
    assert ENV.detokenize(obs[i]) == _ref_text(products, goal, ("start",) + (None,) * 3, False)
  assert shared >= N // 4  # near misses: the category and colour but not the size or price
  assert len({_catalogue(state, i)[1] for i in range(N)}) > N // 2


def test_reset_is_deterministic_and_shapes():
  state, obs, obs_mask = _reset(jax.random.key(0), N)
  again = _reset(jax.random.key(0), N)
  chex.assert_trees_all_equal((state, obs, obs_mask), again)
  other = _host(_reset(jax.random.key(1), N))
  assert not np.array_equal(np.asarray(state.category), other[0].category)
  chex.assert_shape([obs, obs_mask], (N, ENV.obs_len))
  chex.assert_type([obs, state.category, state.target, state.page], np.int32)
  chex.assert_shape([state.category, state.colour, state.price], (N, ENV.num_products))
  assert state.sizes.shape == (N, ENV.num_products, 3) and state.sizes.dtype == bool
  assert ENV.vocab_size < 64 and len(set(ENV.vocab)) == ENV.vocab_size
  assert (ENV.obs_len, ENV.action_len, ENV.max_turns) == (26, 4, 6)
  assert np.all(np.where(obs_mask, True, obs == ENV.pad_id))


@pytest.mark.parametrize("seed,expert_prob,buy_prob", [(1, 0.0, 0.0), (2, 0.6, 0.15)])
def test_steps_match_python_reference(seed, expert_prob, buy_prob):
  state, _, _ = _episodes(seed)[0]
  states, actions, masks, dist, obs, obs_mask, reward, done, info = _episodes(
      seed, expert_prob, buy_prob)[1]
  chex.assert_shape([reward, done, info["invalid"], info["solved"], dist[1:]], (T, N))
  chex.assert_type([reward, done], [np.float32, np.bool_])
  partial = 0
  for i in range(N):
    products, goal, _ = _catalogue(state, i)
    st, ended = ("start", None, None, None), False
    distances = _distances(seed, i)
    for t in range(T):
      assert _ref_state(states, t, i) == st
      assert dist[t, i] == (0 if ended else distances[st])
      if ended:
        assert reward[t, i] == 0 and done[t, i] and not any(v[t, i] for v in info.values())
        assert ENV.detokenize(obs[t, i]) == ENV.detokenize(obs[t - 1, i])
        continue
      new, r, bought, valid = _ref_step(products, goal, st, actions[t, i], masks[t, i])
      ended = bought or t + 1 >= ENV.max_turns
      assert (reward[t, i], done[t, i], info["invalid"][t, i]) == (r, ended, not valid)
      assert info["bought"][t, i] == bought and info["solved"][t, i] == (r == 1.0)
      assert ENV.detokenize(obs[t, i]) == _ref_text(products, goal, new, not valid)
      assert states.turn[t + 1, i] == t + 1
      partial += 0 < r < 1
      st = new
  assert np.any(info["invalid"]) and np.any(~info["invalid"] & ~done)
  if buy_prob:  # the expert and "buy the open product" reach purchases of every quality
    assert partial > 0 and np.any(info["solved"])


def test_expert_solves_every_episode_in_four_turns():
  states, actions, masks, dist, obs, _, reward, done, info = _episodes(3, 1.0)[1]
  steps = np.arange(T)[:, None]
  assert np.array_equal(reward, np.broadcast_to(steps == 3, (T, N)).astype(np.float32))
  assert np.all(info["solved"][3]) and not np.any(info["invalid"])
  assert np.array_equal(np.argmax(done, 0), np.full(N, 3))
  assert np.array_equal(dist[:5], np.broadcast_to(np.arange(4, -1, -1)[:, None], (5, N)))
  assert np.all(dist[5:] == 0)
  text = [ENV.detokenize(np.where(masks[t, 0], actions[t, 0], ENV.pad_id)) for t in range(4)]
  g, target = states.goal[0, 0], states.target[0, 0]
  assert text == [f"search {COLOURS[g[1]]} {CATEGORIES[g[0]]} <eoa>", f"click p{target} <eoa>",
                  f"choose {SIZES[g[2]]} <eoa>", f"buy p{target} <eoa>"]
  answer, answer_mask = _host(ENV.answer(_row(states, 0)))
  assert np.array_equal(answer, actions[3]) and np.array_equal(answer_mask, masks[3])


def test_buy_rewards_and_distances_on_every_product_page():
  state = _episodes(1)[0][0]
  a, m = ENV.pad_action(["buy", "p0", multiturn.EOA])
  checked = 0
  for k in range(ENV.num_products):
    a[1] = webshop.FIRST_PRODUCT + k
    for z in (-1, 0, 1, 2):
      s = state.replace(page=np.full(N, webshop.PRODUCT, np.int32), item=np.full(N, k, np.int32),
                        chosen=np.full(N, z, np.int32))
      _, _, _, reward, done, info = _host(_step(s, np.tile(a, (N, 1)), np.tile(m, (N, 1))))
      dist = np.asarray(_distance(s))
      for i in range(N):
        products, goal, _ = _catalogue(state, i)
        chosen = None if z < 0 else z
        assert reward[i] == _score(products[k], chosen, goal) and done[i] and info["bought"][i]
        ref = _distances(1, i).get(("product", None, k, chosen))  # None: unreachable
        assert ref is None or dist[i] == ref
        checked += ref is not None
  assert checked > N * ENV.num_products


def test_random_policy_rarely_solves():
  *_, reward, done, info = _episodes(4, noise=0.0)[1]
  assert np.all(done[ENV.max_turns - 1])
  assert info["solved"].sum() <= N // 16 and reward.sum(0).max() <= 1.0


def test_answer_is_buy_target():
  state = _episodes(0)[0][0]
  actions, mask = _host(ENV.answer(state))
  chex.assert_shape([actions, mask], (N, ENV.action_len))
  for i in range(N):
    assert ENV.detokenize(np.where(mask[i], actions[i], ENV.pad_id)) == \
        f"buy p{state.target[i]} {multiturn.EOA}"


def test_state_ids_ignore_feedback_and_turn():
  states = _episodes(1)[1][0]
  flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), states)
  ids = np.asarray(jax.jit(ENV.state_id)(flat))
  keys = [b"".join(np.asarray(a)[j].tobytes() for a in ENV._state_arrays(flat) + [flat.done])
          for j in range(len(ids))]
  _, inverse = np.unique(np.array(keys, dtype=object), return_inverse=True)
  _, id_inverse = np.unique(ids, return_inverse=True)
  assert np.array_equal(inverse[:, None] == inverse[None], id_inverse[:, None] == id_inverse[None])
  assert len(set(keys)) > N


def test_vmap_matches_jit():
  keys = jax.random.split(jax.random.key(5), 2)
  actions, masks = _random_actions(np.random.default_rng(5), (2, N))

  @jax.jit
  @jax.vmap
  def reset_and_step(key, actions, masks):  # [2, N, ...] per leaf
    state, obs, obs_mask = ENV.reset(key, N)
    return (state, obs, obs_mask), ENV.step(state, actions, masks)

  batched = _host(reset_and_step(keys, actions, masks))
  for g in range(2):
    reset = _host(_reset(keys[g], N))
    chex.assert_trees_all_equal(_row(batched, g), (reset, _host(_step(reset[0], actions[g],
                                                                      masks[g]))))


def test_render_hand_constructed():
  rows = np.arange(N) % 3  # start (after an invalid action), results, a product page
  s = webshop.WebShopState(
      category=np.tile(np.array([0, 0, 1, 2, 3, 0, 1, 2], np.int32), (N, 1)),
      colour=np.tile(np.array([0, 1, 0, 0, 0, 0, 2, 3], np.int32), (N, 1)),
      price=np.tile(np.array([0, 1, 2, 3, 0, 3, 1, 1], np.int32), (N, 1)),
      sizes=np.tile(np.array([1, 0, 1], bool), (N, 8, 1)), target=np.zeros(N, np.int32),
      goal=np.tile(np.array([0, 0, 2, 2], np.int32), (N, 1)), page=rows.astype(np.int32),
      query=np.where(rows[:, None] == 1, [[3, 1]], -1).astype(np.int32),
      item=np.where(rows == 2, 5, -1).astype(np.int32),
      chosen=np.where(rows == 2, 2, -1).astype(np.int32),
      invalid=rows == 0, turn=np.zeros(N, np.int32), done=np.zeros(N, bool))
  want = "i want a red shirt size large under 30 . "
  assert ENV.render(s, 0) == "invalid action . " + want + "search for a product ."
  obs, _ = _host(jax.jit(ENV.observe)(s))
  assert ENV.detokenize(obs[1]) == want + "results for blue lamp : none ."
  assert ENV.detokenize(obs[2]) == want + "p5 red shirt price 40 sizes small large . chosen large ."
  obs, _ = _host(jax.jit(ENV.observe)(s.replace(query=np.where(s.query == 3, -1, s.query))))
  assert ENV.detokenize(obs[1]) == want + "results for blue : p1 ."
  a, m = ENV.pad_action(["buy", "p5", multiturn.EOA])
  _, _, _, reward, done, info = _host(_step(s, np.tile(a, (N, 1)), np.tile(m, (N, 1))))
  assert reward[2] == 0.75 and done[2] and not info["solved"][2]  # 40 is not under 30
  assert np.all(info["invalid"][:2]) and np.all(reward[:2] == 0)


def test_registry_and_validation():
  assert "webshop" in envs.env_names()
  assert envs.get_env("webshop", num_products=6) == envs.WebShop(num_products=6)
  with pytest.raises(ValueError, match="unknown argument.*colours.*valid arguments"):
    envs.get_env("webshop", colours=3)
  with pytest.raises(ValueError, match="max_turns"):
    webshop.WebShop(max_turns=3)
  with pytest.raises(ValueError, match="page_size"):
    webshop.WebShop(num_products=4, page_size=5)
