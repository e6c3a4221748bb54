"""trees.build_step_graph against a plain-Python reference (dicts, loops, BFS)."""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trees
from trees.step_graph import build_group, unique_ids

SHAPES = ((4, 4), (3, 2), (1, 3))  # (G, K): few shapes, each compiles once


@st.composite
def turn_groups(draw, shapes=SHAPES, batch=()):
  """(state_ids [*batch, G, K+1], rewards, turn_mask [*batch, G, K], success [*batch, G]).

  State ids come from a small alphabet of arbitrary int32 values, so states
  repeat across trajectories and turns; lengths are ragged (0 allowed).
  """
  g, k = draw(st.sampled_from(shapes))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  alphabet = rng.integers(-2**31, 2**31 - 1, draw(st.integers(1, 5)))
  shape = tuple(batch) + (g,)
  ids = alphabet[rng.integers(0, len(alphabet), shape + (k + 1,))].astype(np.int32)
  if draw(st.booleans()):
    ids[..., 0] = alphabet[0]  # one start state, as for one task
  lengths = rng.integers(0, k + 1, shape)
  if draw(st.booleans()):
    lengths = np.maximum(lengths, k - 1)
  mask = np.arange(k) < lengths[..., None]
  kind = draw(st.sampled_from(["outcome", "dense", "equal"]))
  if kind == "outcome":  # binary outcome on the last turn
    last = mask & ~np.concatenate([mask[..., 1:], np.zeros_like(mask[..., :1])], -1)
    rewards = np.where(last, rng.integers(0, 2, shape + (1,)), 0).astype(np.float32)
  elif kind == "dense":
    rewards = rng.normal(size=shape + (k,)).astype(np.float32)
  else:
    rewards = np.full(shape + (k,), 0.3, np.float32)
  rewards = np.where(mask, rewards, np.nan).astype(np.float32)  # padding is never read
  success = rng.random(shape) < 0.5
  return ids, rewards, mask, success


def reference_graph(ids, rewards, mask, success, gamma):
  """One group with dicts: nodes by first visit, per-node returns, BFS distances."""
  g, k = mask.shape
  n = [int(mask[i].sum()) for i in range(g)]
  node_of = {}
  for i in range(g):
    for j in range(n[i] + 1):
      node_of.setdefault(int(ids[i, j]), len(node_of))
  node = [[node_of[int(ids[i, j])] if j <= n[i] else -1 for j in range(k + 1)] for i in range(g)]
  returns = np.zeros((g, k))
  for i in range(g):
    acc = 0.0
    for j in reversed(range(n[i])):
      acc = float(rewards[i, j]) + gamma * acc
      returns[i, j] = acc
  visits = collections.defaultdict(list)
  succ = collections.defaultdict(set)
  for i in range(g):
    for j in range(n[i]):
      visits[node[i][j]].append(returns[i, j])
      succ[node[i][j]].add(node[i][j + 1])
  terminal = {node[i][n[i]] for i in range(g)}
  goal = {node[i][n[i]] for i in range(g) if success[i]}
  pred = collections.defaultdict(set)
  for u, vs in succ.items():
    for v in vs:
      pred[v].add(u)
  dist = {v: 0 for v in goal}
  frontier = list(goal)
  while frontier:
    nxt = []
    for v in frontier:
      for u in pred[v]:
        if u not in dist:
          dist[u] = dist[v] + 1
          nxt.append(u)
    frontier = nxt
  return dict(node=node, num_nodes=len(node_of), visits=visits, succ=succ, terminal=terminal,
              goal=goal, dist=dist, returns=returns)


def check_against_reference(graph, ids, rewards, mask, success, gamma):
  ref = reference_graph(ids, rewards, mask, success, gamma)
  g, k = mask.shape
  n = g * (k + 1)
  np.testing.assert_array_equal(graph.node, ref["node"])
  assert int(graph.num_nodes) == ref["num_nodes"]
  np.testing.assert_allclose(graph.returns, ref["returns"], rtol=1e-5, atol=1e-5)
  for v in range(n):
    xs = ref["visits"].get(v, [])
    assert graph.visits[v] == len(xs)
    want = (np.mean(xs), np.std(xs), np.min(xs), np.max(xs)) if xs else (0, 0, 0, 0)
    got = (graph.mean_return[v], graph.std_return[v], graph.min_return[v], graph.max_return[v])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    row = [u in ref["succ"].get(v, ()) for u in range(n)]
    np.testing.assert_array_equal(graph.adjacency[v], row)
    assert bool(graph.terminal[v]) == (v in ref["terminal"])
    assert bool(graph.success[v]) == (v in ref["goal"])
    assert graph.distance_to_success[v] == ref["dist"].get(v, math.inf)


_build = jax.jit(build_group)


@settings(max_examples=30, deadline=None)
@given(turn_groups(), st.sampled_from([1.0, 0.9]))
def test_matches_reference(group, gamma):
  ids, rewards, mask, success = group
  graph = jax.tree.map(np.asarray, _build(ids, rewards, mask, success, gamma))
  check_against_reference(graph, ids, rewards, mask, success, gamma)


_build_batch = jax.jit(trees.build_step_graph)


@settings(max_examples=10, deadline=None)
@given(turn_groups(shapes=((3, 3),), batch=(2, 3)))
def test_leading_dims_are_independent_groups(group):
  ids, rewards, mask, success = group
  graph = jax.tree.map(np.asarray, _build_batch(ids, rewards, mask, success, 0.95))
  assert graph.node.shape == (2, 3, 3, 4) and graph.adjacency.shape == (2, 3, 12, 12)
  for b in np.ndindex(2, 3):
    one = jax.tree.map(lambda x: x[b], graph)
    check_against_reference(one, ids[b], rewards[b], mask[b], success[b], 0.95)


def chain_example():
  """Three trajectories over states 10 -> 11 -> ... ; only trajectory 0 succeeds."""
  ids = np.array([[10, 11, 12, 13, 14, 99],
                  [10, 11, 20, 21, 21, 21],
                  [10, 30, 31, 12, 13, 14]], np.int32)
  rewards = np.array([[0, 0, 0, 0, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  return ids, rewards, mask


def test_chain_distances_and_merged_states():
  ids, rewards, mask = chain_example()
  graph = trees.build_step_graph(ids, rewards, mask)  # success: return > 0
  node = np.asarray(graph.node)
  assert node[2, 3] == node[0, 2] and node[2, 4] == node[0, 3]  # 12 and 13 shared
  d = np.asarray(graph.distance_to_success)
  assert d[node[0, 5]] == 0 and d[node[0, 0]] == 5 and d[node[2, 0]] == 5
  assert d[node[2, 1]] == 5 and d[node[2, 5]] == 1  # 30 -> 31 -> 12 -> 13 -> 14 -> 99
  assert np.isinf(d[node[1, 3]])  # trajectory 1's end never reaches success
  assert np.all(np.isinf(d[int(graph.num_nodes):]))
  assert int(graph.visits[node[0, 0]]) == 3 and int(graph.visits[node[0, 2]]) == 2
  assert node[1, 4] == -1 and node[1, 3] >= 0  # after the end: no node


def test_jit_and_vmap_of_one_group_and_gather_nodes():
  ids, rewards, mask = chain_example()
  eager = trees.build_step_graph(ids, rewards, mask, gamma=0.9)  # jitted, vmapped inside
  one = jax.jit(build_group)(ids, rewards, mask, None, 0.9)
  jax.tree.map(np.testing.assert_array_equal, eager, one)
  mapped = jax.jit(jax.vmap(trees.build_step_graph, in_axes=(0, 0, 0, None, None)))(
      ids[None], rewards[None], mask[None], None, 0.9)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[0], b), mapped, eager)
  per_slot = trees.gather_nodes(eager.mean_return, eager.node)
  want = np.where(eager.node >= 0, np.asarray(eager.mean_return)[np.maximum(eager.node, 0)], 0)
  np.testing.assert_array_equal(per_slot, want)


def test_single_trajectory_and_empty_trajectories():
  ids = np.array([[5, 5, 6]], np.int32)  # G = 1, a self-loop then a step
  graph = trees.build_step_graph(ids, np.array([[0.0, 1.0]], np.float32), np.ones((1, 2), bool))
  assert int(graph.num_nodes) == 2 and int(graph.visits[0]) == 2
  assert bool(graph.adjacency[0, 0]) and bool(graph.adjacency[0, 1])
  np.testing.assert_allclose(graph.mean_return[0], 1.0)  # returns 1 (γ = 1) at both visits
  empty = trees.build_step_graph(np.zeros((2, 3), np.int32), np.zeros((2, 2), np.float32),
                                 np.zeros((2, 2), bool))
  assert int(empty.num_nodes) == 1 and int(empty.visits.sum()) == 0
  assert bool(empty.terminal[0]) and not bool(empty.success[0])
  assert np.all(np.isfinite(empty.mean_return)) and np.all(np.isfinite(empty.std_return))


def test_unique_ids_on_key_pairs():
  a = jnp.array([3, 1, 3, 1, 3, 7])
  b = jnp.array([0, 0, 0, 2, 0, 0])
  valid = jnp.array([True, True, True, True, False, True])
  ids, first, count = unique_ids((a, b), valid)
  np.testing.assert_array_equal(ids, [0, 1, 0, 2, -1, 3])
  np.testing.assert_array_equal(first, [True, True, False, True, False, True])
  assert int(count) == 4


def test_bad_shapes_raise():
  with pytest.raises(ValueError, match="state_ids must be"):
    trees.build_step_graph(np.zeros(3, np.int32), np.zeros(2), np.ones(2, bool))
