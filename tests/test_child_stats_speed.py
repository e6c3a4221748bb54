"""Per-level child statistics (`trees.level_stats`, used by SPO-tree,
Sibling-GRPO and MARS²) against the node-level `tree_values` / `child_stats`
and against plain-Python references for hparam modes the other tests skip."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings

import credit
import trees
import reference_tree as ref
from groups import groups, sampled_trees


def _close(got, want, msg):
  """np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5) on scalars; np.isclose (the
  test assert_allclose applies) first, so that passing checks skip its slow reporting."""
  if not np.isclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=msg())


def _check_level_stats(tree, rewards, value, ddof, stats):
  """Every token's node read from the level tables equals the node arrays."""
  v, cs, ls = jax.tree.map(np.asarray, stats)
  t = jax.tree.map(np.asarray, tree)
  for b in range(t.mask.shape[0]):
    for g in range(t.mask.shape[1]):
      n = int(t.mask[b, g].sum())
      at = lambda what: lambda: f"{value}, ddof {ddof}: {what} at {b, g, pos}"
      for pos in range(n):
        j, node = t.level[b, pos], t.node[b, g, pos]
        deepest = pos == n - 1 or t.level[b, pos + 1] != j  # the run's node the table is about
        for field in ("count", "sum", "mean", "std") if deepest else ():
          _close(getattr(ls, field)[b, g, j], getattr(cs, field)[b, node], at(field))
        _close(ls.value[b, g, j], v[b, node], at("value"))
        # The segment through pos starts at its last branch; its parent is s_b there.
        starts = [s for s in range(pos + 1) if t.branches[b, g, s]]
        if not starts:
          assert ls.parent[b, g, j] == -1, at("parent")()
          continue
        s = starts[-1]
        _close(ls.value[b, g, ls.start[b, g, j]], v[b, t.node[b, g, s]], at("start value"))
        _close(ls.value[b, g, ls.parent[b, g, j]], v[b, t.parent[b, g, s]], at("parent value"))
      # Level 0 is the whole group: the root's value (and the root itself if it branches).
      pos = 0
      _close(ls.value[b, g, 0], v[b, 0], at("root value"))
      if cs.count[b, 0] > 1:
        np.testing.assert_array_equal(ls.count[b, g, 0], cs.count[b, 0], err_msg=at("root count")())


@functools.partial(jax.jit, static_argnums=2)
def _all_stats(tree, rewards, variants):
  """(tree_values, child_stats, level_stats) per (value, ddof) variant, all in one program:
  one compile per shape instead of one per function, variant and shape."""
  out = []
  for value, ddof in variants:
    v = trees.tree_values(tree, rewards, value)
    out.append((v, trees.child_stats(tree, v, rewards, ddof=ddof),
                trees.level_stats(tree, rewards, value, ddof=ddof)))
  return out


def _check_all_level_stats(tree, rewards, variants):
  for (value, ddof), stats in zip(variants, _all_stats(tree, rewards, variants)):
    _check_level_stats(tree, rewards, value, ddof, stats)


# Each example is checked in every variant (formerly one test per variant, 20 examples each).
@settings(max_examples=15, deadline=None)
@given(groups(sizes=(1, 3, 6, 16), lengths=(1, 7), batch=(2,)))
def test_level_stats_equal_node_stats_on_prefix_trees(group):
  tokens, mask, rewards = group
  _check_all_level_stats(trees.build(tokens, mask), rewards,
                         (("children", 0), ("children", 1), ("leaves", 1)))


@settings(max_examples=15, deadline=None)
@given(sampled_trees())
def test_level_stats_equal_node_stats_on_sampled_trees(group):
  tokens, mask, rewards, parent, fork = group
  _check_all_level_stats(trees.from_forks(tokens, mask, parent, fork), rewards,
                         (("children", 1), ("leaves", 1)))


def mars2_ref(tree, value="children", gamma=0.5, lam=0.5, eps=1e-6):
  """`reference_tree.mars2` with a choice of node values."""
  R, shaped = tree.rewards, []
  V = tree.mean_children if value == "children" else tree.mean_leaves
  for g in range(len(R)):
    split = [n for n in tree.nodes(g) if tree.num_children(n) >= 2]
    p = split[-1] if split else ref.ROOT
    sibs = tree.child_values(p, V)
    others = (sum(sibs) - R[g]) / (len(sibs) - 1) if len(sibs) > 1 else V(p)
    shaped.append(R[g] + gamma * ref.snap(R[g] - ((1 - lam) * V(p) + lam * others), R))
  adv = ref.grpo(shaped, eps)
  return [[adv[g]] * len(path) for g, path in enumerate(tree.paths)]


CASES = {  # (name, hparams) -> (reference per group, whitened over the batch)
    ("spo_tree", ()): (ref.edge_credit, False),
    ("spo_tree", (("mode", "grpo"), ("value", "leaves"))): (
        functools.partial(ref.edge_credit, value="leaves", normalise=True), False),
    ("sibling_grpo", (("value", "leaves"),)): (functools.partial(
        ref.edge_credit, value="leaves", baseline="siblings", normalise=True, eps=1e-6), False),
    ("mars2_shaping", (("value", "leaves"),)): (functools.partial(mars2_ref, value="leaves"),
                                                False),
    ("mars2_shaping", (("gamma", 0.3), ("lam", 0.8))): (
        functools.partial(mars2_ref, gamma=0.3, lam=0.8), False),
}


SORTED_CASES = sorted(CASES, key=str)
# Every case in one jitted program: one compile per shape for all 5 (instead of 5).
_all_cases = jax.jit(lambda rollouts: [functools.partial(credit.get(name), **dict(hp))(rollouts)
                                       for name, hp in SORTED_CASES])


def _check(case, adv, paths, rewards, mask):
  reference, whitened = CASES[case]
  want = [reference(ref.Tree(p, r)) for p, r in zip(paths, rewards)]
  if whitened:
    want = ref.whiten(want)
  adv = np.asarray(adv)
  assert np.all(np.isfinite(adv)) and np.all(adv[~mask] == 0), case
  for b, group in enumerate(want):
    for g, row in enumerate(group):
      np.testing.assert_allclose(adv[b, g, :len(row)], row, rtol=2e-4, atol=2e-4,
                                 err_msg=f"{case}: prompt {b}, response {g}")


# Each example is checked in every case (formerly one test per case, 10 examples each).
@settings(max_examples=15, deadline=None)
@given(groups(sizes=(2, 16), lengths=(9,), max_vocab=3, batch=(2,)))
def test_modes_match_reference_on_prefix_trees(group):
  tokens, mask, rewards = group
  advs = _all_cases(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards))
  paths = [ref.prefix_paths([list(tokens[b, g][mask[b, g]]) for g in range(tokens.shape[1])])
           for b in range(len(tokens))]
  for case, adv in zip(SORTED_CASES, advs):
    _check(case, adv, paths, rewards, mask)


@settings(max_examples=15, deadline=None)
@given(sampled_trees())
def test_modes_match_reference_on_sampled_trees(group):
  tokens, mask, rewards, parent, fork = group
  tree = trees.from_forks(tokens, mask, parent, fork)
  advs = _all_cases(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, tree=tree))
  paths = [ref.sampled_paths(mask[b].sum(-1).tolist(), parent[b].tolist(), fork[b].tolist())
           for b in range(len(tokens))]
  for case, adv in zip(SORTED_CASES, advs):
    _check(case, adv, paths, rewards, mask)


def test_level_stats_rejects_unknown_values():
  tree = trees.build(np.zeros((1, 2, 3), np.int32), np.ones((1, 2, 3), bool))
  with pytest.raises(ValueError):
    trees.level_stats(tree, np.zeros((1, 2), np.float32), "max")
