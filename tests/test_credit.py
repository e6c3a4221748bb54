"""credit: estimators against plain-Python references, identities, and input checks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import credit
import reference_trie as ref
import trees
from groups import groups


def _rollouts(tokens, mask, rewards, **extra):
  return credit.Rollouts(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask),
                         rewards=jnp.asarray(rewards), **extra)


@given(groups())
def test_tempo_matches_dict_trie(group):
  tokens, mask, rewards = group
  for scale in (True, False):
    adv = np.asarray(credit.get("tempo")(_rollouts(tokens, mask, rewards), scale_by_std=scale))
    expect = ref.tempo_advantages(ref.unpad(tokens, mask), [float(r) for r in rewards],
                                  scale_by_std=scale)
    for g, row in enumerate(expect):
      np.testing.assert_allclose(adv[g, :len(row)], row, rtol=2e-4, atol=2e-4)
      assert (adv[g, len(row):] == 0).all()


@given(groups())
def test_tempo_equals_grpo_where_nothing_branches(group):
  tokens, mask, rewards = group
  r = _rollouts(tokens, mask, rewards)
  tempo, grpo = credit.get("tempo")(r), credit.get("grpo")(r)
  branches = np.asarray(trees.build(tokens, mask).branches)
  np.testing.assert_array_equal(np.asarray(tempo)[~branches], np.asarray(grpo)[~branches])


@given(groups())
def test_td_terms_telescope(group):
  tokens, mask, rewards = group
  tree = trees.build(tokens, mask)
  vb, va = map(np.asarray, trees.prefix_values(tree, rewards))
  lengths = mask.sum(-1)
  mean = rewards.mean()
  for g, n in enumerate(lengths):
    if n == 0:
      continue
    np.testing.assert_allclose((va - vb)[g].sum(), va[g, n - 1] - mean, atol=1e-5)
    # V at the end is g's reward unless other responses extend g with other rewards.
    extends = [h for h in range(len(lengths)) if tree.lcp[g, h] == n]
    if all(rewards[h] == rewards[g] for h in extends):
      np.testing.assert_allclose((va - vb)[g].sum(), rewards[g] - mean, atol=1e-5)


def test_tempo_on_eos_terminated_group_telescopes_to_r_minus_mu():
  tokens = np.array([[1, 2, 9, 0], [1, 3, 4, 9], [1, 2, 9, 0], [5, 9, 0, 0]], np.int32)
  mask = tokens != 0
  rewards = np.array([1.0, 0.0, 1.0, 0.5], np.float32)
  adv = credit.get("tempo")(_rollouts(tokens, mask, rewards), scale_by_std=False)
  grpo = credit.get("dr_grpo")(_rollouts(tokens, mask, rewards))
  np.testing.assert_allclose(np.sum(adv - grpo, axis=-1), rewards - rewards.mean(), atol=1e-6)


@given(groups(sizes=(1, 3, 6)))
def test_outcome_estimators_match_formulas(group):
  tokens, mask, rewards = group
  r = _rollouts(tokens, mask, rewards)
  g = len(rewards)
  if g == 1:
    mean, std = 0.0, 1.0
  else:
    mean, std = rewards.mean(), rewards.std(ddof=1)
  same = g > 1 and rewards.max() == rewards.min()
  expect = {
      "grpo": np.zeros(g) if same else (rewards - mean) / (std + 1e-6),
      "dr_grpo": np.zeros(g) if same else rewards - mean,
      "rloo": (np.zeros(g) if g == 1 or same else
               rewards - (rewards.sum() - rewards) / (g - 1)),
  }
  for name, per_response in expect.items():
    adv = np.asarray(credit.get(name)(r))
    np.testing.assert_allclose(adv, np.where(mask, per_response[:, None], 0.0),
                               rtol=1e-5, atol=1e-5)
    chex.assert_type(adv, np.float32)


def test_reinforce_pp_baseline_whitens_over_the_batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 5, (3, 4, 6)).astype(np.int32)
  mask = np.arange(6) < rng.integers(1, 7, (3, 4))[..., None]
  rewards = rng.random((3, 4)).astype(np.float32)
  adv = np.asarray(credit.get("reinforce_pp_baseline")(_rollouts(tokens, mask, rewards)))
  centred = np.broadcast_to((rewards - rewards.mean(-1, keepdims=True))[..., None], mask.shape)
  vals = centred[mask]
  np.testing.assert_allclose(adv[mask], (vals - vals.mean()) / (vals.std() + 1e-8), rtol=1e-4,
                             atol=1e-5)
  assert (adv[~mask] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "tempo"])
def test_degenerate_groups_are_finite_and_documented(name):
  fn = credit.get(name)
  tokens = np.array([[[4, 5, 6], [4, 5, 6], [4, 7, 0], [0, 0, 0]]], np.int32)
  mask = np.array([[[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0]]], bool)
  # All rewards equal -> exactly 0 everywhere.
  adv = fn(_rollouts(tokens, mask, np.full((1, 4), 0.7, np.float32)))
  assert (np.asarray(adv) == 0).all()
  # Identical responses get identical advantages; zero-length responses get none.
  adv = np.asarray(fn(_rollouts(tokens, mask, np.array([[1.0, 0.0, 1.0, 0.0]], np.float32))))
  assert np.isfinite(adv).all() and (adv[0, 3] == 0).all() and (adv[0, 2, 2] == 0)
  # One response per group.
  one = np.asarray(fn(_rollouts(tokens[:, :1], mask[:, :1], np.array([[0.25]], np.float32))))
  assert np.isfinite(one).all()
  if name in ("grpo", "tempo"):
    np.testing.assert_allclose(one, 0.25 / (1 + 1e-6), rtol=1e-6)  # mu = 0, sigma = 1
  if name in ("rloo", "reinforce_pp_baseline"):
    np.testing.assert_allclose(one, 0.0)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline", "tempo"])
def test_jit_vmap_and_permutation(name):
  # Groups of [6, 5], a shape the hypothesis tests above ran eagerly: the looped calls reuse
  # those programs.
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 2, (3, 6, 5)).astype(np.int32)
  mask = np.arange(5) < rng.integers(0, 6, (3, 6))[..., None]
  rewards = rng.random((3, 6)).astype(np.float32)
  fn = credit.get(name)
  r = _rollouts(tokens, mask, rewards)
  eager = fn(r)
  chex.assert_trees_all_close(jax.jit(fn)(r), eager, atol=1e-6)
  if name != "reinforce_pp_baseline":  # it whitens over the whole batch
    looped = jnp.stack([fn(_rollouts(tokens[i], mask[i], rewards[i])) for i in range(3)])
    # vmap under jit: the same batching rules as an eager vmap, one compile.
    chex.assert_trees_all_close(jax.jit(jax.vmap(fn))(r), eager, looped, atol=1e-6)
  perm = rng.permutation(6)
  permuted = fn(_rollouts(tokens[:, perm], mask[:, perm], rewards[:, perm]))
  chex.assert_trees_all_close(permuted, eager[:, perm], atol=1e-5)


def test_tempo_uses_an_explicit_tree():
  # Two siblings that sampled the same token stay separate nodes in the sampled tree.
  tokens = np.array([[1, 2, 3], [1, 2, 4], [1, 2, 4]], np.int32)
  mask = np.ones((3, 3), bool)
  rewards = np.array([1.0, 0.0, 1.0], np.float32)
  tree = trees.from_forks(tokens, mask, np.array([-1, 0, 0]), np.array([0, 2, 2]))
  sampled = np.asarray(credit.get("tempo")(_rollouts(tokens, mask, rewards, tree=tree),
                                           scale_by_std=False))
  mean = rewards.mean()
  np.testing.assert_allclose(sampled[:, 2], rewards - mean + rewards - 2 / 3, atol=1e-6)
  merged = np.asarray(credit.get("tempo")(_rollouts(tokens, mask, rewards), scale_by_std=False))
  np.testing.assert_allclose(merged[1:, 2], rewards[1:] - mean + 0.5 - 2 / 3, atol=1e-6)


def test_from_forks_without_coincidences_equals_the_token_tree():
  tokens = np.array([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8, 9], [3, 3, 3, 3]], np.int32)
  mask = np.ones((4, 4), bool)
  sampled = trees.from_forks(tokens, mask, np.array([-1, 0, 0, -1]), np.array([0, 2, 1, 0]))
  chex.assert_trees_all_equal(sampled, trees.build(tokens, mask))


def test_returns_gae_and_td_lambda_by_hand():
  r = np.array([[1.0, 0.0, 2.0, 5.0]], np.float32)
  v = np.array([[0.5, 1.0, 1.5, 9.0]], np.float32)
  m = np.array([[True, True, True, False]])
  g, lam = 0.5, 0.5
  np.testing.assert_allclose(credit.discounted_returns(r, m, g), [[1.5, 1.0, 2.0, 0.0]])
  # deltas: 1 + .5*1 - .5 = 1; 0 + .5*1.5 - 1 = -.25; 2 + 0 - 1.5 = .5
  gae = [[1 + 0.25 * (-0.25 + 0.25 * 0.5), -0.25 + 0.25 * 0.5, 0.5, 0.0]]
  np.testing.assert_allclose(credit.gae_advantages(r, v, m, g, lam), gae, atol=1e-6)
  np.testing.assert_allclose(credit.td_lambda_returns(r, v, m, g, lam),
                             np.array(gae) + np.where(m, v, 0), atol=1e-6)


@given(groups(sizes=(3,), lengths=(7,)))
def test_returns_match_python_loops(group):
  tokens, mask, rewards = group
  rng = np.random.default_rng(int(tokens.sum()))
  token_rewards = rng.normal(size=tokens.shape).astype(np.float32)
  values = rng.normal(size=tokens.shape).astype(np.float32)
  gamma, lam = 0.9, 0.7
  r = _rollouts(tokens, mask, rewards, token_rewards=token_rewards, values=values)
  ret, adv = credit.get("returns")(r, gamma=gamma), credit.get("gae")(r, gamma=gamma, lam=lam)
  for g in range(len(tokens)):
    n = int(mask[g].sum())
    rew = [float(token_rewards[g, t]) for t in range(n)]
    if n:
      rew[-1] += float(rewards[g])
    acc, gae_acc = 0.0, 0.0
    for t in reversed(range(n)):
      acc = rew[t] + gamma * acc
      next_v = values[g, t + 1] if t + 1 < n else 0.0
      gae_acc = rew[t] + gamma * next_v - values[g, t] + gamma * lam * gae_acc
      np.testing.assert_allclose(ret[g, t], acc, rtol=1e-4, atol=1e-4)
      np.testing.assert_allclose(adv[g, t], gae_acc, rtol=1e-4, atol=1e-4)
    assert (np.asarray(ret)[g, n:] == 0).all() and (np.asarray(adv)[g, n:] == 0).all()


def test_kl_estimators():
  lp = np.array([[-1.0, -2.0, -0.5]], np.float32)
  ref_lp = np.array([[-1.5, -1.0, -0.5]], np.float32)
  m = np.array([[True, True, False]])
  x = np.array([0.5, -1.0])
  np.testing.assert_allclose(credit.kl_k1(lp, ref_lp, m)[0, :2], x)
  np.testing.assert_allclose(credit.kl_k2(lp, ref_lp, m)[0, :2], x**2 / 2)
  np.testing.assert_allclose(credit.kl_k3(lp, ref_lp, m)[0, :2], np.exp(-x) + x - 1, rtol=1e-6)
  for est in ("k1", "k2", "k3"):
    assert credit.kl_penalty(lp, ref_lp, m, est)[0, 2] == 0
  with pytest.raises(ValueError, match="k1"):
    credit.kl_penalty(lp, ref_lp, m, "k4")


def test_reinforce_pp_folds_kl_into_rewards():
  tokens = np.ones((2, 2, 3), np.int32)
  mask = np.ones((2, 2, 3), bool)
  rewards = np.array([[1.0, 0.0], [0.0, 0.0]], np.float32)
  lp = np.full((2, 2, 3), -1.0, np.float32)
  no_kl = credit.get("reinforce_pp")(_rollouts(tokens, mask, rewards))
  same = credit.get("reinforce_pp")(_rollouts(tokens, mask, rewards, logprobs=lp,
                                               ref_logprobs=lp))
  np.testing.assert_allclose(no_kl, same, atol=1e-6)
  shifted = credit.get("reinforce_pp")(_rollouts(tokens, mask, rewards, logprobs=lp,
                                                  ref_logprobs=lp - 1.0), kl_coef=0.1)
  assert not np.allclose(shifted, no_kl)


def test_registry():
  assert {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "tempo"} <= set(credit.names())
  with pytest.raises(ValueError, match="valid names: .*grpo"):
    credit.get("nope")
  with pytest.raises(ValueError, match="already registered"):
    credit.register("grpo")(lambda r: r)


def _valid():
  return dict(tokens=np.ones((2, 3, 4), np.int32), mask=np.ones((2, 3, 4), bool),
              rewards=np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("change,message", [
    (dict(rewards=np.zeros((2, 4), np.float32)), "rewards must be"),
    (dict(rewards=np.array([[0, np.nan, 0], [0, 0, 0]], np.float32)), "finite"),
    (dict(rewards=np.array([[0, np.inf, 0], [0, 0, 0]], np.float32)), "finite"),
    (dict(tokens=np.ones((2, 3, 4), np.float32)), "integers"),
    (dict(mask=np.ones((2, 3, 4), np.int32)), "boolean"),
    (dict(mask=np.ones((2, 3, 5), bool)), "same shape"),
    (dict(tokens=np.ones((2, 0, 4), np.int32), mask=np.ones((2, 0, 4), bool),
          rewards=np.zeros((2, 0), np.float32)), "empty group"),
    (dict(mask=np.array([[[1, 0, 1, 1]] * 3] * 2, bool)), "holes"),
    (dict(logprobs=np.ones((2, 3, 5), np.float32)), "logprobs must have"),
    (dict(values=np.full((2, 3, 4), np.nan, np.float32)), "non-finite"),
    (dict(entropy=np.full((2, 3, 4), np.inf, np.float32)), "entropy has non-finite"),
    (dict(saliency=np.full((2, 3, 4), np.nan, np.float32)), "saliency has non-finite"),
    (dict(context_logprobs=np.zeros((2, 3), np.float32)), "context_logprobs must have"),
    (dict(prompt_logprobs=np.zeros((3, 5), np.float32)), r"prompt_logprobs must be \[..., P\]"),
    (dict(prompt_logprobs=np.array([[0, np.nan], [0, -1]], np.float32)),
     r"prompt_logprobs\[0, 1\] is not finite"),
    (dict(prompt_logprobs=np.array([[0, np.nan], [0, -1]], np.float32),
          prompt_mask=np.array([[0, 1], [0, 1]], bool)), "on a scored prompt token"),
    (dict(prompt_logprobs=np.zeros((2, 2), np.float32), prompt_mask=np.ones((2, 2), np.int32)),
     "prompt_mask must be boolean"),
    (dict(prompt_mask=np.ones((2, 2), bool)), "without prompt_logprobs"),
    (dict(parent=np.full((2, 3), -1)), "parent and fork come together"),
    (dict(parent=np.full((2, 3), -1.0), fork=np.zeros((2, 3))), "parent must be integers"),
    (dict(parent=np.array([[-1, 1, 0], [-1, -1, -1]]), fork=np.zeros((2, 3), int)),
     "earlier response"),
    (dict(parent=np.array([[-1, 0, 0], [-1, -1, -1]]), fork=np.array([[0, 5, 0], [0, 0, 0]])),
     r"fork must be in \[0, L\]"),
])
def test_validate_names_the_problem(change, message):
  with pytest.raises(ValueError, match=message):
    credit.validate(credit.Rollouts(**{**_valid(), **change}))


def test_validate_accepts_good_rollouts():
  r = credit.Rollouts(**_valid())
  assert credit.validate(r) is r
  # Non-finite values off the masks are padding, not errors.
  plp = np.array([[0, -1.0, np.nan], [0, -2.0, -0.5]], np.float32)
  r = r.replace(prompt_logprobs=plp, prompt_mask=np.array([[0, 1, 0], [0, 1, 1]], bool),
                entropy=np.where(np.arange(4) < 3, 1.0, np.nan).astype(np.float32)
                * np.ones((2, 3, 1), np.float32),
                mask=np.broadcast_to(np.arange(4) < 3, (2, 3, 4)))
  assert credit.validate(r) is r


class EstimatorVariantsTest(chex.TestCase):
  """jit and no-jit give the same advantages, with the documented shapes and dtype."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_variants(self):
    rng = np.random.default_rng(7)  # test_jit_vmap_and_permutation's shape: programs reused
    tokens = rng.integers(0, 3, (3, 6, 5)).astype(np.int32)
    mask = np.arange(5) < rng.integers(0, 6, (3, 6))[..., None]
    rewards = rng.random((3, 6)).astype(np.float32)
    r = _rollouts(tokens, mask, rewards)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "tempo", "returns"):
      fn = self.variant(credit.get(name))
      adv = fn(r)
      chex.assert_shape(adv, tokens.shape)
      chex.assert_type(adv, jnp.float32)
      chex.assert_tree_all_finite(adv)
      chex.assert_trees_all_close(adv, jax.jit(credit.get(name))(r), atol=1e-6)
      assert (np.asarray(adv)[~mask] == 0).all()


@pytest.mark.parametrize("n", [7, 10, 1000, 100_000])
@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, -2.1])
def test_masked_whiten_gives_exact_zeros_for_equal_values(n, value):
  """Equal values that float32 cannot represent: rounding of the mean used to
  give O(1) outputs (0.7 on 7 tokens -> 0.86)."""
  mask = np.arange(n + 3) < n
  x = np.where(mask, np.float32(value), 5.0).astype(np.float32)
  for eps in (1e-8, 0.0):
    np.testing.assert_array_equal(np.asarray(credit.groups.masked_whiten(x, mask, eps)), 0.0)
    np.testing.assert_array_equal(np.asarray(credit.groups.whiten_nonzero(x, mask, eps)), 0.0)
  x = np.random.default_rng(n).normal(size=n + 3).astype(np.float32) + value
  want = np.where(mask, (x - x[mask].mean()) / (x[mask].std() + 1e-8), 0.0)
  np.testing.assert_allclose(np.asarray(credit.groups.masked_whiten(x, mask)), want,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_is_zero_when_all_returns_are_equal(gamma):
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 4, (3, 5, 7)).astype(np.int32)
  mask = np.ones((3, 5, 7), bool) if gamma != 1.0 else np.arange(7) < rng.integers(
      1, 8, (3, 5, 1))
  adv = credit.get("reinforce_pp")(_rollouts(tokens, mask, np.full((3, 5), 0.7, np.float32)),
                                   gamma=gamma)
  if gamma == 1.0:  # every return-to-go is R = 0.7
    np.testing.assert_array_equal(np.asarray(adv), 0.0)
  else:  # returns differ along a response: whitened, finite, mean 0
    assert np.all(np.isfinite(adv)) and abs(float(np.asarray(adv)[mask].mean())) < 1e-5
