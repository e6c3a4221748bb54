"""trees: prefix trees and node reductions against a plain-Python dict trie."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import reference_trie as ref
import trees
from groups import groups
from trees import lcp as lcp_lib
from trees import prefix_tree


def _python_lcp(a, b):
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def _check_against_reference(tree, tokens, mask, rewards):
  responses = ref.unpad(tokens, mask)
  expect = ref.group_tree(responses, [float(r) for r in rewards])
  vb, va = map(np.asarray, trees.prefix_values(tree, rewards))
  tree = jax.tree.map(np.asarray, tree)  # (indexing jax arrays element by element is slow)
  count = np.asarray(tree.count)
  node = np.asarray(tree.node)
  parent = np.asarray(tree.parent)
  seen = {}
  for g, resp in enumerate(responses):
    n = len(resp)
    np.testing.assert_array_equal(count[g, :n], expect["count"][g])
    np.testing.assert_array_equal(np.asarray(tree.branches)[g, :n], expect["branches"][g])
    np.testing.assert_allclose(vb[g, :n], expect["v_before"][g], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(va[g, :n], expect["v_after"][g], rtol=1e-5, atol=1e-6)
    assert (count[g, n:] == 0).all() and (vb[g, n:] == 0).all() and (va[g, n:] == 0).all()
    assert (node[g, n:] == tree.num_nodes).all()
    for t, key in enumerate(expect["node_key"][g]):
      assert seen.setdefault(key, node[g, t]) == node[g, t]  # same prefix -> same id
      assert parent[g, t] == (0 if t == 0 else node[g, t - 1])
  assert len(set(seen.values())) == len(seen)  # different prefixes -> different ids
  for g, a in enumerate(responses):
    for h, b in enumerate(responses):
      assert tree.lcp[g, h] == _python_lcp(a, b)
  # Per-node arrays: one used slot per trie node, with its count, depth, token, parent.
  used = np.flatnonzero(np.asarray(tree.node_count))
  assert len(used) == expect["num_nodes"]
  by_id = {int(v): k for k, v in seen.items()}
  for v in used[1:]:
    key = by_id[int(v)]
    assert tree.node_depth[v] == len(key) and tree.node_token[v] == key[-1]
    assert tree.node_count[v] == sum(r[:len(key)] == list(key) for r in responses)
    assert tree.node_parent[v] == (0 if len(key) == 1 else seen[key[:-1]])
  assert tree.node_count[0] == len(responses)


@given(groups())
def test_tree_matches_dict_trie(group):
  tokens, mask, rewards = group
  tree = trees.build(tokens, mask)
  _check_against_reference(tree, tokens, mask, rewards)
  exact = trees.build(tokens, mask, method="exact")
  chex.assert_trees_all_equal(tree, exact)


@given(groups(sizes=(6,), lengths=(70,), max_vocab=2))
def test_tree_with_several_hash_blocks(group):
  tokens, mask, rewards = group
  _check_against_reference(trees.build(tokens, mask), tokens, mask, rewards)


def test_hash_collisions_fall_back_to_exact(monkeypatch):
  """An lcp that over-estimates (as a hash collision would) is caught and repaired."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 3, (3, 6, 40)).astype(np.int32)
  tokens[:, 1:3, :20] = tokens[:, :1, :20]
  mask = np.ones(tokens.shape, bool)
  mask[:, 4, 30:] = False
  rewards = rng.random((3, 6)).astype(np.float32)
  honest = trees.build(tokens, mask)

  def colliding(keys, m, block=lcp_lib.BLOCK):
    lengths = jnp.sum(m, axis=-1)
    return jnp.minimum(lengths[:, None], lengths[None, :]).astype(jnp.int32)

  # The over-estimate really fails the exact check ...
  lengths = jnp.asarray(mask.sum(-1), jnp.int32)
  _, _, ok = jax.vmap(prefix_tree._trie_order)(tokens, lengths,
                                               jax.vmap(colliding)(tokens, mask))
  assert not np.all(ok)
  # ... and build repairs it, also under a user's vmap (fresh traces: no cached honest ones).
  monkeypatch.setattr(lcp_lib, "lcp_blocked", colliding)
  jax.clear_caches()
  tree = trees.build(tokens, mask)
  chex.assert_trees_all_equal(tree, honest)
  chex.assert_trees_all_equal(jax.vmap(trees.build)(tokens, mask), honest)
  jax.clear_caches()
  for b in range(3):
    _check_against_reference(jax.tree.map(lambda x: x[b], tree), tokens[b], mask[b], rewards[b])


@given(groups(sizes=(1, 5), lengths=(6,), batch=(2, 3)))
def test_batched_build_equals_loop_and_jit(group):
  tokens, mask, rewards = group
  tree = jax.jit(trees.build)(tokens, mask)
  chex.assert_shape(tree.node, tokens.shape)
  chex.assert_shape(tree.node_count, (2, 3, 1 + tokens.shape[-2] * tokens.shape[-1]))
  values = jax.jit(trees.prefix_values)(tree, rewards)
  np_tree, values = jax.tree.map(np.asarray, (tree, values))  # numpy slices: no indexing ops
  for i in range(2):
    for j in range(3):
      one = trees.build(tokens[i, j], mask[i, j])
      chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i, j], np_tree), one)
      chex.assert_trees_all_close(tuple(v[i, j] for v in values),
                                  trees.prefix_values(one, rewards[i, j]))
  vmapped = jax.vmap(jax.vmap(trees.build))(tokens, mask)
  chex.assert_trees_all_equal(vmapped, tree)


@given(groups(sizes=(1, 8), lengths=(8,)))
def test_permuting_responses_permutes_outputs(group):
  tokens, mask, rewards = group
  perm = np.random.default_rng(len(tokens)).permutation(len(tokens))
  tree, permuted = trees.build(tokens, mask), trees.build(tokens[perm], mask[perm])
  for name in ("count", "branches", "mask"):
    np.testing.assert_array_equal(getattr(permuted, name), getattr(tree, name)[perm])
  np.testing.assert_array_equal(permuted.lcp, tree.lcp[perm][:, perm])
  for a, b in zip(trees.prefix_values(permuted, rewards[perm]), trees.prefix_values(tree, rewards)):
    np.testing.assert_allclose(a, b[perm], rtol=1e-6, atol=1e-7)


def _python_node_reduce(tree, tokens, mask, x, op):
  """{node id: op over its responses or tokens} from the keys, in plain Python."""
  groups_ = {}
  responses = ref.unpad(tokens, mask)
  node = np.asarray(tree.node)
  for g, resp in enumerate(responses):
    if x.ndim == 1:
      groups_.setdefault(0, []).append(x[g])
    for t in range(len(resp)):
      groups_.setdefault(int(node[g, t]), []).append(x[g] if x.ndim == 1 else x[g, t])
  return {k: op(np.array(v, np.float64)) for k, v in groups_.items()}


@pytest.mark.parametrize("name,op", [
    ("node_sum", np.sum), ("node_mean", np.mean), ("node_count", len), ("node_max", np.max),
    ("node_min", np.min), ("node_std", np.std)])
@pytest.mark.parametrize("per_token", [False, True])
@given(group=groups(sizes=(1, 8), lengths=(8,)))
def test_node_reductions(name, op, per_token, group):
  tokens, mask, rewards = group
  tree = trees.build(tokens, mask)
  x = (np.random.default_rng(1).normal(size=tokens.shape).astype(np.float32) if per_token
       else rewards)
  got = np.asarray(jax.jit(getattr(trees, name))(tree, x))
  chex.assert_shape(got, (tree.num_nodes,))
  expect = _python_node_reduce(tree, tokens, mask, x, op)
  for v in range(tree.num_nodes):
    np.testing.assert_allclose(got[v], expect.get(v, 0.0), rtol=1e-5, atol=1e-5)


@given(groups(sizes=(1, 8), lengths=(8,)))
def test_prefix_values_equal_node_means_gathered(group):
  tokens, mask, rewards = group
  tree = trees.build(tokens, mask)
  means = trees.node_mean(tree, rewards)
  vb, va = trees.prefix_values(tree, rewards)
  np.testing.assert_allclose(trees.to_tokens(tree, means, before=True), vb, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(trees.to_tokens(tree, means), va, rtol=1e-5, atol=1e-6)


@given(groups(sizes=(10,), lengths=(6,)))
def test_sibling_stats(group):
  tokens, mask, rewards = group
  tree = trees.build(tokens, mask)
  values = np.asarray(trees.node_mean(tree, rewards))
  stats = jax.tree.map(np.asarray, trees.sibling_stats(tree, values))
  children = {}
  node_parent = np.asarray(tree.node_parent)
  for v in np.flatnonzero(np.asarray(tree.node_count))[1:]:
    children.setdefault(int(node_parent[v]), []).append(v)
  for kids in children.values():
    sib = values[kids]
    for v in kids:
      assert stats.count[v] == len(kids)
      np.testing.assert_allclose(stats.mean[v], sib.mean(), rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(stats.std[v], sib.std(), rtol=1e-4, atol=1e-5)
      loo = (sib.sum() - values[v]) / (len(kids) - 1) if len(kids) > 1 else 0.0
      np.testing.assert_allclose(stats.loo_mean[v], loo, rtol=1e-5, atol=1e-5)
  assert stats.count[0] == 0


def test_no_sharing_gives_a_bundle_of_chains():
  tokens = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)
  tree = trees.build(tokens, np.ones((3, 3), bool))
  np.testing.assert_array_equal(tree.count, np.ones((3, 3)))
  np.testing.assert_array_equal(tree.branches, [[True, False, False]] * 3)


def test_degenerate_groups():
  # One response, zero-length responses, identical responses: finite, documented values.
  tokens = np.array([[5, 6, 0], [5, 6, 0], [0, 0, 0]], np.int32)
  mask = np.array([[1, 1, 0], [1, 1, 0], [0, 0, 0]], bool)
  tree = trees.build(tokens, mask)
  vb, va = trees.prefix_values(tree, np.array([1.0, 0.0, 0.5], np.float32))
  np.testing.assert_allclose(vb[0, :2], [0.5, 0.5])
  np.testing.assert_allclose(va[0, :2], [0.5, 0.5])
  assert tree.node_count[0] == 3 and (tree.count[2] == 0).all()
  np.testing.assert_array_equal(tree.branches[0], [True, False, False])
  single = trees.build(np.array([[3, 4]]), np.array([[True, False]]))
  np.testing.assert_allclose(trees.prefix_values(single, np.array([2.0]))[1], [[2.0, 0.0]])


@pytest.mark.parametrize("tokens,mask,message", [
    (np.zeros((3,), np.int32), np.ones((3,), bool), r"\[\.\.\., G, L\]"),
    (np.zeros((2, 3), np.int32), np.ones((2, 4), bool), "same shape"),
    (np.zeros((2, 3), np.float32), np.ones((2, 3), bool), "integers"),
    (np.zeros((2, 3), np.int32), np.ones((2, 3), np.int32), "boolean"),
    (np.zeros((0, 3), np.int32), np.ones((0, 3), bool), "empty group"),
    (np.zeros((2, 0), np.int32), np.ones((2, 0), bool), "token axis"),
    (np.zeros((2, 3), np.int32), np.array([[1, 0, 1], [1, 1, 1]], bool), "holes"),
])
def test_bad_input_raises(tokens, mask, message):
  with pytest.raises(ValueError, match=message):
    trees.build(tokens, mask)


def test_mask_with_holes_under_jit_is_cut_at_the_hole():
  tokens = np.array([[1, 2, 3]], np.int32)
  tree = jax.jit(trees.build)(tokens, np.array([[True, False, True]]))
  np.testing.assert_array_equal(tree.mask, [[True, False, False]])
