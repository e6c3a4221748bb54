"""Tree estimators (SPO, TreeRL, TreePO, Tree-GRPO, Sibling-GRPO, MARS²) against
plain-Python references on random sampled and prefix trees, and their reductions
to outcome-level estimators when nothing is shared."""

import functools

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, settings

import credit
import trees
import reference_tree as ref
from groups import groups, sampled_trees

TREE_ESTIMATORS = {  # name + hparams -> reference(tree) per token (before any batch whitening)
    "spo_tree": lambda t: ref.edge_credit(t),
    "spo_tree/grpo": lambda t: ref.edge_credit(t, normalise=True),
    "spo_tree/leaves": lambda t: ref.edge_credit(t, value="leaves"),
    "spo_tree/grpo/leaves": lambda t: ref.edge_credit(t, value="leaves", normalise=True),
    "sibling_grpo": lambda t: ref.edge_credit(t, baseline="siblings", normalise=True, eps=1e-6),
    "sibling_grpo/leaves": lambda t: ref.edge_credit(t, value="leaves", baseline="siblings",
                                                     normalise=True, eps=1e-6),
    "treerl": ref.treerl,
    "treerl/sqrt": functools.partial(ref.treerl, sqrt_leaves=True),
    "treepo": ref.treepo,
    "tree_grpo": ref.tree_grpo,
    "mars2_shaping": ref.mars2,
}
HPARAMS = {"grpo": dict(mode="grpo"), "leaves": dict(value="leaves"),
           "sqrt": dict(sqrt_leaves=True)}
WHITENED = {"treepo"}  # (spo_chain, which reads the forks: tests/test_spo_chain.py)


SPECS = sorted(TREE_ESTIMATORS)


def estimator(spec):
  name, *opts = spec.split("/")
  hp = {}
  for o in opts:
    hp.update(HPARAMS[o])
  return functools.partial(credit.get(name), **hp)


# Every estimator in one jitted program: compiled once per shape for all 12 specs (12 separate
# programs cost about 3x the compile time; the per-spec checks below are unchanged).
all_estimators = jax.jit(lambda rollouts: {spec: estimator(spec)(rollouts) for spec in SPECS})


def expected(spec, paths, rewards):
  per_group = [TREE_ESTIMATORS[spec](ref.Tree(p, r)) for p, r in zip(paths, rewards)]
  if spec.split("/")[0] in WHITENED:
    per_group = ref.whiten(per_group)
  return per_group


def check(spec, adv, paths, rewards, mask):
  want = expected(spec, paths, rewards)
  adv = np.asarray(adv)
  assert np.all(np.isfinite(adv)) and np.all(adv[~mask] == 0), spec
  for b, group in enumerate(want):
    for g, row in enumerate(group):
      np.testing.assert_allclose(adv[b, g, :len(row)], row, rtol=2e-4, atol=2e-4,
                                 err_msg=f"{spec}: prompt {b}, response {g}")


# Each example is checked against all 12 estimators (formerly one test per spec with 15
# examples each). Examples cost little next to the compiles, so each estimator now sees 40.
@settings(max_examples=40)  # x 12 estimators x 2 tree kinds
@given(sampled_trees())
def test_matches_reference_on_sampled_trees(group):
  tokens, mask, rewards, parent, fork = group
  tree = trees.from_forks(tokens, mask, parent, fork)
  advs = all_estimators(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, tree=tree))
  paths = [ref.sampled_paths(mask[b].sum(-1).tolist(), parent[b].tolist(), fork[b].tolist())
           for b in range(len(tokens))]
  for spec in SPECS:
    check(spec, advs[spec], paths, rewards, mask)


@settings(max_examples=40)  # (3 prompts: the shapes of flat_group and the jit test below)
@given(groups(sizes=(1, 5, 8), lengths=(6,), max_vocab=3, batch=(3,)))
def test_matches_reference_on_prefix_trees(group):
  tokens, mask, rewards = group
  advs = all_estimators(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards))
  paths = [ref.prefix_paths([list(tokens[b, g][mask[b, g]]) for g in range(tokens.shape[1])])
           for b in range(len(tokens))]
  for spec in SPECS:
    check(spec, advs[spec], paths, rewards, mask)


def flat_group(seed=0, g=5, l=6, batch=3):
  """Groups whose responses all differ at their first token: nothing is shared."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 4, (batch, g, l)).astype(np.int32)
  tokens[..., 0] = np.arange(g)
  mask = np.arange(l) < rng.integers(1, l + 1, (batch, g, 1))
  rewards = rng.integers(0, 3, (batch, g)).astype(np.float32) / 2
  rewards[0] = 0.5  # one group with all-equal rewards
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards)


def flat_mars2(r, gamma=0.5, lam=0.5):
  others = (r.sum(-1, keepdims=True) - r) / (r.shape[-1] - 1)
  return r + gamma * (r - ((1 - lam) * r.mean(-1, keepdims=True) + lam * others))


REDUCTIONS = [  # tree estimator == its outcome-level counterpart when nothing is shared
    ("spo_tree", {}, lambda r: credit.get("dr_grpo")(r)),
    ("spo_tree", dict(mode="grpo"), lambda r: credit.get("grpo")(r, eps=1e-8)),
    ("sibling_grpo", {}, lambda r: credit.get("grpo")(r)),
    ("treerl", {}, lambda r: 2 * credit.get("rloo")(r)),
    ("treerl", dict(sqrt_leaves=True), lambda r: 2 * credit.get("rloo")(r)),
    ("treerl", dict(variant="code"), lambda r: 2 * credit.get("rloo")(r)),
    ("treepo", {}, lambda r: credit.get("reinforce_pp_baseline")(r)),
    ("tree_grpo", {}, lambda r: credit.get("grpo")(r)),
    ("mars2_shaping", {}, lambda r: credit.get("grpo")(r.replace(rewards=flat_mars2(r.rewards)))),
]


@pytest.mark.parametrize("name,hp,outcome", REDUCTIONS, ids=[f"{n}{h}" for n, h, _ in REDUCTIONS])
@pytest.mark.parametrize("explicit", [False, True])
def test_reduces_to_outcome_counterpart_without_shared_prefixes(name, hp, outcome, explicit):
  rollouts = flat_group()
  if explicit:  # every response a root chain of the sampled tree
    shape = rollouts.rewards.shape
    rollouts = rollouts.replace(tree=trees.from_forks(
        rollouts.tokens, rollouts.mask, np.full(shape, -1), np.zeros(shape, np.int32)))
  adv = credit.get(name)(rollouts, **hp)
  np.testing.assert_allclose(adv, outcome(rollouts), rtol=1e-5, atol=1e-6)
  if name not in WHITENED:  # (whitening over the batch shifts every group)
    assert np.all(np.asarray(adv)[0] == 0)  # all-equal rewards: exactly 0


@pytest.mark.parametrize("name", ["spo_tree", "sibling_grpo", "treerl", "treepo",
                                  "tree_grpo", "mars2_shaping"])
def test_jit_vmap_and_degenerate_groups(name):
  # Shapes [3, 5, 6] and [3, 1, 6]: the eager call reuses the programs that the reductions test
  # compiled (flat_group's shape), the jitted ones `all_estimators`' of the prefix-tree test.
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 2, (3, 5, 6)).astype(np.int32)
  mask = np.arange(6) < np.array([[6, 0, 3, 6, 6]] * 3)[..., None]  # one empty response
  rewards = (rng.random((3, 5)) < 0.5).astype(np.float32)
  rewards[1] = 1.0
  tokens[2] = tokens[2, :1]  # identical responses
  rollouts = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards)
  fn = credit.get(name)
  adv = fn(rollouts)
  chex.assert_shape(adv, (3, 5, 6))
  chex.assert_tree_all_finite(adv)
  np.testing.assert_allclose(all_estimators(rollouts)[name], adv, atol=1e-6)  # jitted
  if name not in WHITENED:  # per-group estimators: vmap over prompts = batched call
    # vmap under jit: the same batching rules as an eager vmap (the estimators' only
    # concrete-value branches are input checks), one compile instead of op-by-op ones.
    np.testing.assert_allclose(jax.jit(jax.vmap(fn))(rollouts), adv, atol=1e-6)
    assert np.all(np.asarray(adv)[1] == 0)  # all-equal rewards
  # A group of one, jitted (eagerly each op would compile for the new shape; trees.build's
  # eager input checks on one response are in test_trees.test_degenerate_groups).
  one = credit.Rollouts(tokens=tokens[:, :1], mask=mask[:, :1], rewards=rewards[:, :1])
  chex.assert_tree_all_finite(all_estimators(one)[name])


def test_child_mean_values_equal_leaf_means_on_a_full_tree():
  # A fixed (3, 2) tree with 2-token segments: every node at a depth has as many children.
  from experiments.rollouts.sampling import fixed_tree
  parent, fork, _ = fixed_tree((3, 2), 2)
  rng = np.random.default_rng(0)
  tokens = np.zeros((6, 5), np.int32)
  mask = np.ones((6, 5), bool)
  tree = trees.from_forks(tokens, mask, parent, fork)
  rewards = rng.random(6).astype(np.float32)
  np.testing.assert_allclose(trees.child_mean_values(tree, rewards),
                             trees.node_mean(tree, rewards), rtol=1e-6)
  # An unbalanced tree: the root's children are a 5-leaf subtree and one leaf (6 responses,
  # as above: the same shapes, no new compiles).
  tree = trees.from_forks(tokens, mask, np.array([-1, 0, 0, 0, 0, -1]),
                          np.array([0, 1, 1, 1, 1, 0]))
  r = np.array([1.0, 0.0, 0.0, 0.0, 0.0, 1.0], np.float32)
  v = trees.child_mean_values(tree, r)
  assert np.isclose(v[0], (1 / 5 + 1) / 2) and np.isclose(trees.node_mean(tree, r)[0], 1 / 3)


def test_spo_loss_masks():
  rollouts = flat_group()
  adv = credit.get("spo_tree")(rollouts)
  np.testing.assert_array_equal(credit.loss_mask("spo_tree", rollouts, adv), rollouts.mask)
  kept = credit.loss_mask("spo_tree", rollouts, adv, drop_zero=True)
  np.testing.assert_array_equal(kept, rollouts.mask & (np.asarray(adv) != 0))
  logprobs = np.log(np.where(np.arange(6) % 2 == 0, 0.95, 0.5) * np.ones(rollouts.tokens.shape))
  forks = dict(parent=np.tile([-1, -1, 0, 0, 1], (3, 1)), fork=np.tile([0, 0, 1, 3, 2], (3, 1)))
  chain = rollouts.replace(logprobs=logprobs.astype(np.float32), **forks)
  adv = credit.get("spo_chain")(chain)
  kept = credit.loss_mask("spo_chain", chain, adv)
  chains = (forks["parent"] < 0)[..., None]
  np.testing.assert_array_equal(kept, rollouts.mask & (np.arange(6) % 2 == 1) & chains)
  assert np.all(np.asarray(adv)[~kept] == 0)
  flat = np.asarray(adv)[kept]
  assert abs(flat.mean()) < 1e-5 and abs(flat.std() - 1) < 1e-3  # whitened over kept tokens
  assert credit.loss_mask("grpo", rollouts, adv) is rollouts.mask


def test_bad_hyperparameters_raise():
  rollouts = flat_group()
  with pytest.raises(ValueError, match="mode"):
    credit.get("spo_tree")(rollouts, mode="ppo")
  with pytest.raises(ValueError, match="kind"):
    credit.get("sibling_grpo")(rollouts, value="max")
