"""Bad input gets a ValueError that names the problem, not a TypeError from deep inside
numpy / jax, and not a silent wrong answer (trees.from_forks, trees.build, credit.validate)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import credit
import trees

TOKENS = np.array([[1, 2, 3, 4], [1, 2, 5, 6], [1, 9, 9, 9]], np.int32)
MASK = np.ones((3, 4), bool)


# ---------------------------------------------------------------------------
# trees.from_forks


def test_fork_claiming_more_shared_tokens_names_response_parent_and_position():
  # Response 1 forks from 0 claiming 3 copied tokens; they share only [1, 2].
  with pytest.raises(ValueError) as info:
    trees.from_forks(TOKENS, MASK, [-1, 0, 0], [0, 3, 1])
  message = str(info.value)
  assert "response 1" in message and "response 0" in message
  assert "first differ at position 2" in message
  assert "tokens[1, 2] = 5 != tokens[0, 2] = 3" in message


def test_fork_mismatch_in_a_batch_names_the_group():
  tokens, mask = np.stack([TOKENS, TOKENS]), np.stack([MASK, MASK])
  parent = np.array([[-1, 0, 0], [-1, 0, 0]])
  with pytest.raises(ValueError, match=re.escape("tokens[1, 2, 1] = 9 != tokens[1, 0, 1] = 2")):
    trees.from_forks(tokens, mask, parent, np.array([[0, 2, 1], [0, 2, 2]]))


def test_jax_inputs_are_checked_like_numpy_ones():
  with pytest.raises(ValueError, match="first differ at position 2"):
    trees.from_forks(jnp.asarray(TOKENS), jnp.asarray(MASK), jnp.array([-1, 0, 0]),
                     jnp.array([0, 3, 1]))


@pytest.mark.parametrize("parent,fork,mask,message", [
    ([-1, 0, 0], [0, 3, 1], np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool),
     "its parent has only 2 tokens"),
    ([-1, 0, 0], [0, 2, 1], np.array([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]], bool),
     "the response itself has only 1 tokens"),
    ([-1, 0, 0], [0, 5, 1], MASK, re.escape("fork must be in [0, L] = [0, 4]; got fork[1] = 5")),
    ([-1, 0, 0], [0, -1, 1], MASK, re.escape("got fork[1] = -1")),
    ([-1, 0, 0], [2, 2, 1], MASK, re.escape("its fork must be 0; got fork[0] = 2")),
    ([-1, 3, 0], [0, 2, 1], MASK, re.escape("got parent[1] = 3 for response 1")),
    ([-1, 1, 0], [0, 2, 1], MASK, re.escape("got parent[1] = 1")),   # itself
    ([-1, 2, 0], [0, 1, 1], MASK, re.escape("got parent[1] = 2")),   # a later response
    ([-1, -2, 0], [0, 2, 1], MASK, re.escape("got parent[1] = -2")),
    # 2**32 would wrap to 0 (a valid parent) in the cast to int32.
    (np.array([-1, 2**32, 0]), [0, 2, 1], MASK, re.escape("got parent[1] = 4294967296")),
    ([-1, 0, 0], [0, 2.5, 1], MASK, "fork must be integers; got dtype float64"),
    ([-1, 0.0, 0], [0, 2, 1], MASK, "parent must be integers; got dtype float64"),
    (np.zeros(3, bool), [0, 2, 1], MASK, "parent must be integers; got dtype bool"),
    ([-1, 0, 0], np.array(["0", "2", "1"]), MASK, "fork must be integers"),
    ([-1, 0, 0], None, MASK, "fork must be integers; got dtype object"),
    ([-1, 0, 0], [0, 2, 1], np.ones((3, 4), np.int32), "mask must be boolean"),
    ([-1, 0], [0, 2], MASK, "must be \\[..., G\\]"),
])
def test_from_forks_bad_input(parent, fork, mask, message):
  with pytest.raises(ValueError, match=message):
    trees.from_forks(TOKENS, mask, parent, fork)


def test_from_forks_bad_tokens():
  with pytest.raises(ValueError, match="tokens must be integers"):
    trees.from_forks(TOKENS.astype(str), MASK, [-1, 0, 0], [0, 2, 1])
  with pytest.raises(ValueError, match="tokens must be integers; got dtype float"):
    trees.from_forks(TOKENS.astype(np.float32), MASK, [-1, 0, 0], [0, 2, 1])


def test_from_forks_accepts_a_consistent_tree_and_skips_value_checks_under_jit():
  good = trees.from_forks(TOKENS, MASK, [-1, 0, 0], [0, 2, 1])
  assert int(good.node_count[0]) == 3
  # Under jit the values are abstract: nothing is checked (as in trees.build).
  bad = jax.jit(lambda p, f: trees.from_forks(TOKENS, MASK, p, f).node_count)(
      jnp.array([-1, 0, 0]), jnp.array([0, 3, 1]))
  assert bad.shape == (1 + 3 * 4,)


# ---------------------------------------------------------------------------
# trees.build


@pytest.mark.parametrize("tokens,mask,message", [
    (TOKENS.astype(str), MASK, "tokens must be integers; got dtype <U"),
    (np.array([[2**40, 1], [0, 1]]), np.ones((2, 2), bool),
     re.escape("tokens must fit in int32; got tokens[0, 0] = 1099511627776")),  # would wrap to 0
    (TOKENS, None, "mask must be boolean; got dtype object"),
    (TOKENS, MASK.astype(int).tolist(), "mask must be boolean; got dtype int"),
    (TOKENS, MASK.astype(str), "mask must be boolean"),
])
def test_build_bad_input(tokens, mask, message):
  with pytest.raises(ValueError, match=message):
    trees.build(tokens, mask)


def test_build_accepts_lists_and_uint32():
  assert trees.build(TOKENS.tolist(), MASK.tolist()).node_count.shape == (13,)
  big = np.full((2, 3), 2**31 + 5, np.uint32)  # uint32 -> int32 is one-to-one
  assert int(trees.build(big, np.ones((2, 3), bool)).node_count[0]) == 2


# ---------------------------------------------------------------------------
# credit.validate: leaks of numpy/jax errors through the rollout validator.


def _rollouts(**change):
  fields = dict(tokens=TOKENS, mask=MASK, rewards=np.array([1.0, 0.0, 1.0], np.float32))
  return credit.Rollouts(**{**fields, **change})


@pytest.mark.parametrize("rewards", [
    np.array([1, 0, 1], np.int32),
    np.array([1.0, 0.0, 1.0], np.float16),
    jnp.array([1.0, 0.0, 1.0]),
])
def test_validate_accepts_real_rewards(rewards):
  credit.validate(_rollouts(rewards=rewards))


def test_validate_accepts_bfloat16_rewards():
  # np.issubdtype(bfloat16, np.number) is False: a real float type is rejected.
  credit.validate(_rollouts(rewards=jnp.array([1.0, 0.0, 1.0], jnp.bfloat16)))


def test_validate_rejects_non_finite_bfloat16_rewards_as_non_finite():
  with pytest.raises(ValueError, match="finite"):
    credit.validate(_rollouts(rewards=jnp.array([1.0, jnp.nan, 1.0], jnp.bfloat16)))


def test_validate_accepts_boolean_rewards():
  # Pass/fail verifiers return booleans; every estimator casts rewards to float32.
  credit.validate(_rollouts(rewards=np.array([True, False, True])))


@pytest.mark.parametrize("value", [np.zeros((3, 4), str), np.full((3, 4), None, object)],
                         ids=["str", "object"])
def test_validate_per_token_field_of_wrong_dtype_is_a_value_error(value):
  # Today: TypeError: ufunc 'isfinite' not supported for the input types ...
  with pytest.raises(ValueError, match="logprobs must be real"):
    credit.validate(_rollouts(logprobs=value))


@pytest.mark.parametrize("value", [np.zeros((3, 4), complex), np.zeros((3, 4), bool)],
                         ids=["complex", "bool"])
def test_validate_rejects_non_real_per_token_fields(value):
  with pytest.raises(ValueError, match="logprobs must be real"):
    credit.validate(_rollouts(logprobs=value))


def test_validate_accepts_bfloat16_logprobs():
  credit.validate(_rollouts(logprobs=jnp.zeros((3, 4), jnp.bfloat16)))


def test_validate_string_tokens_is_a_value_error():
  # Today: TypeError from jnp.asarray before check_tokens_and_mask runs.
  with pytest.raises(ValueError, match="tokens must be integers"):
    credit.validate(_rollouts(tokens=TOKENS.astype(str)))


def test_validate_64_bit_tokens_outside_int32():
  # Today: jnp.asarray wraps 2**40 to 0 (a UserWarning) and validate accepts.
  tokens = TOKENS.astype(np.int64)
  tokens[0, 0] = 2**40
  with pytest.raises(ValueError, match="int32"):
    credit.validate(_rollouts(tokens=tokens))


def test_validate_tree_of_another_shape():
  # Today accepted; the estimator then fails with "Incompatible shapes for broadcasting".
  tree = trees.build(TOKENS[:2], MASK[:2])
  with pytest.raises(ValueError, match="tree"):
    credit.validate(_rollouts(tree=tree))


def test_validate_under_jit_checks_shapes_only():
  # Today: TracerArrayConversionError from np.asarray(rewards). Like check_tokens_and_mask,
  # value checks should be skipped when the values are abstract.
  fn = jax.jit(lambda r: credit.validate(_rollouts(rewards=r)).rewards)
  np.testing.assert_array_equal(fn(jnp.ones(3)), np.ones(3))


def test_validate_rewards_that_overflow_float32():
  # Finite in float64, but every estimator computes in float32: 1e300 becomes inf.
  with pytest.raises(ValueError, match="finite"):
    credit.validate(_rollouts(rewards=np.array([1e300, 0.0, 1.0])))
