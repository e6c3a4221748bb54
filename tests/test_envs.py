"""Tests for envs/: the Task API, verifiable rewards, and token_tree's exact state values.

XLA compiles are the cost here, so array functions go through a few shared jitted
wrappers (cached per task and shape), test inputs are built with NumPy, and keys
use the "rbg" PRNG, which compiles much faster on CPU than threefry.
"""

import functools
import itertools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs

N = 32
SETTINGS = hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
DEFAULT_TASKS = ["addition", "countdown", "token_tree"]


def _key(seed):
  return jax.random.key(seed, impl="rbg")


_sample = jax.jit(lambda task, key, n: task.sample(key, n), static_argnums=(0, 2))
_demos = jax.jit(lambda task, prompts, info: task.demonstrations(prompts, info), static_argnums=0)
_reward = jax.jit(lambda task, *args: task.reward(*args), static_argnums=0)
_vmap_reward = jax.jit(lambda task, *args: jax.vmap(task.reward)(*args), static_argnums=0)


@functools.lru_cache(maxsize=None)
def _data(name, **kwargs):
  """(task, prompts, info, responses, mask) for N prompts, as NumPy arrays."""
  task = envs.get(name, **kwargs)
  prompts, info = _sample(task, _key(0), N)
  responses, mask = _demos(task, prompts, info)
  return task, *jax.tree.map(np.asarray, (prompts, info, responses, mask))


def _noisy(task, responses, mask, seed=0):
  """Demonstrations with ~10% of tokens resampled and ~1/4 of masks cut short."""
  rng = np.random.default_rng(seed)
  change = rng.random(responses.shape) < 0.1
  responses = np.where(change, rng.integers(0, task.vocab_size, responses.shape), responses)
  length = rng.integers(task.response_len - 1, task.response_len + 3, responses.shape[:-1])
  mask = mask & (np.arange(task.response_len) < length[..., None])
  return np.where(mask, responses, task.pad_id).astype(np.int32), mask


def _reference_read(task, tokens, mask):
  """Python reference of the response convention: the tokens up to and including the first EOS."""
  out = []
  for t, m in zip(tokens.tolist(), mask.tolist()):
    if not m:
      return None
    out.append(t)
    if t == task.eos_id:
      return out
  return None


# --- the Task API, for every task ---------------------------------------------------------------

@pytest.mark.parametrize("name,kwargs", [(n, {}) for n in DEFAULT_TASKS] + [
    ("countdown", {"num_numbers": 4, "max_number": 12})])
def test_shapes_and_demonstrations(name, kwargs):
  task, prompts, info, responses, mask = _data(name, **kwargs)
  assert prompts.shape == (N, task.prompt_len) and prompts.dtype == np.int32
  assert responses.shape == mask.shape == (N, task.response_len) and responses.dtype == np.int32
  assert mask.dtype == np.bool_
  assert all(x.shape[0] == N for x in jax.tree.leaves(info))
  for x in (prompts, responses):
    assert x.min() >= 0 and x.max() < task.vocab_size
  assert not np.any(prompts == task.pad_id)
  assert len(set(task.vocab)) == task.vocab_size and task.pad_id != task.eos_id
  np.testing.assert_array_equal(_reward(task, prompts, responses, mask, info), np.ones(N))
  hash(task)  # usable as a static jit argument


@pytest.mark.parametrize("name", DEFAULT_TASKS)
def test_jit_equals_eager(name):
  task, prompts, info, responses, mask = _data(name)
  noisy, noisy_mask = _noisy(task, responses, mask)
  np.testing.assert_array_equal(task.reward(prompts, noisy, noisy_mask, info),
                                _reward(task, prompts, noisy, noisy_mask, info))
  eager = task.demonstrations(prompts, info)
  jax.tree.map(np.testing.assert_array_equal, eager, (responses, mask))


@pytest.mark.parametrize("name", DEFAULT_TASKS)
def test_reward_vmaps_and_matches_a_loop(name):
  task, prompts, info, responses, mask = _data(name)
  noisy, noisy_mask = _noisy(task, responses, mask, seed=1)
  batched = np.asarray(_reward(task, prompts, noisy, noisy_mask, info))
  assert batched.dtype == np.float32 and 0 < np.mean(batched > 0) < 1  # right and wrong ones
  np.testing.assert_array_equal(_vmap_reward(task, prompts, noisy, noisy_mask, info), batched)
  loop = [_reward(task, prompts[i], noisy[i], noisy_mask[i], jax.tree.map(lambda x: x[i], info))
          for i in range(N)]
  np.testing.assert_array_equal(np.stack(loop), batched)


@pytest.mark.parametrize("name", DEFAULT_TASKS)
def test_format_errors_score_zero(name):
  task, prompts, info, responses, mask = _data(name)

  def zero(r, m):
    np.testing.assert_array_equal(_reward(task, prompts, r, m, info), 0.0)

  def at(x, pos, value):
    x = x.copy()
    x[:, pos] = value
    return x

  zero(at(responses, -1, task.pad_id), mask)  # no EOS
  zero(responses, at(mask, -1, False))  # EOS masked out
  zero(at(responses, -2, task.eos_id), mask)  # EOS too early
  zero(at(responses, 0, task.pad_id), mask)  # a pad inside the response
  zero(np.full_like(responses, task.eos_id), mask)  # only EOS


# --- addition ------------------------------------------------------------------------------------

def test_addition_against_python():
  task, prompts, info, responses, mask = _data("addition")
  for i in range(N):
    a, b = task.detokenize(prompts[i]).rstrip("=").split("+")
    assert len(a) == len(b) == task.num_digits
    assert task.detokenize(responses[i]) == f"{int(a) + int(b):04d}<eos>"
  # reverse=True: the same digits, least significant first.
  rev = envs.get("addition", reverse=True)
  rev_responses, rev_mask = _demos(rev, prompts, {"answer": rev.answer(prompts)})
  np.testing.assert_array_equal(rev_responses[:, :-1], responses[:, -2::-1])
  np.testing.assert_array_equal(
      _reward(rev, prompts, rev_responses, rev_mask, {"answer": rev.answer(prompts)}), 1.0)


def test_addition_corrupted_digit_scores_zero():
  task, prompts, info, responses, mask = _data("addition")
  rng = np.random.default_rng(0)
  pos = rng.integers(0, task.response_len - 1, N)
  bad = responses.copy()
  bad[np.arange(N), pos] = (bad[np.arange(N), pos] + rng.integers(1, 10, N)) % 10
  np.testing.assert_array_equal(_reward(task, prompts, bad, mask, info), 0.0)


# --- countdown -----------------------------------------------------------------------------------

def _py_fold(words):
  value = int(words[0])
  for op, x in zip(words[1::2], words[2::2]):
    value = {"+": value + int(x), "-": value - int(x), "*": value * int(x)}[op]
  return value


def test_countdown_prompt_and_solution():
  task, prompts, info, responses, mask = _data("countdown")
  k = task.num_numbers
  for i in range(N):
    words = task.detokenize(prompts[i]).split(" ")
    numbers = [int(w) for w in words[:k]]
    assert words[k] == "=" and numbers == sorted(numbers) == info["numbers"][i].tolist()
    assert int(words[k + 1] + "".join(words[k + 2:])) == info["target"][i]
    expr = task.detokenize(responses[i]).split(" ")
    assert expr[-1] == "<eos>" and sorted(int(x) for x in expr[:-1:2]) == numbers
    assert _py_fold(expr[:-1]) == info["target"][i]
  assert len(np.unique(info["target"])) > 5


def test_countdown_corruptions_score_zero():
  task, prompts, info, responses, mask = _data("countdown")
  zero = lambda r, i=info: np.testing.assert_array_equal(_reward(task, prompts, r, mask, i), 0)
  bad = responses.copy()  # a number that is not in the prompt's multiset
  bad[:, 0] = np.where(bad[:, 0] < task.max_number, bad[:, 0] + 1, bad[:, 0] - 1)
  zero(bad)
  zero(responses, dict(info, target=info["target"] + 1))
  bad = responses.copy()  # an op where a number must be
  bad[:, 2] = task.token_id("+")
  zero(bad)
  bad = responses.copy()  # a number repeated instead of another one
  bad[:, 2] = bad[:, 0]
  wrong_multiset = np.sort(bad[:, 0:-1:2], -1) != info["numbers"]
  assert np.all(_reward(task, prompts, bad, mask, info)[np.any(wrong_multiset, -1)] == 0)


def _py_evaluate(task, tokens, mask):
  """Python reference for `Countdown.evaluate`: (well_formed, value)."""
  read = _reference_read(task, tokens, mask)
  if read is None or len(read) != task.response_len:
    return False, 0
  words = [task.vocab[t] for t in read[:-1]]
  if not all(w.isdigit() and 1 <= int(w) <= task.max_number for w in words[0::2]):
    return False, 0
  if not all(o in ("+", "-", "*") for o in words[1::2]):
    return False, 0
  return True, _py_fold(words)


_evaluate = jax.jit(lambda task, r, m: task.evaluate(r, m), static_argnums=0)


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1),
                  config=st.sampled_from([(1, 5), (3, 9), (4, 12)]))
def test_countdown_evaluator_against_python(seed, config):
  task = envs.get("countdown", num_numbers=config[0], max_number=config[1])
  n, r = 64, task.response_len
  rng = np.random.default_rng(seed)
  # Well-formed expressions with some tokens resampled and some masks cut: valid and invalid ones.
  nums = rng.integers(1, task.max_number + 1, (n, r))
  ops = rng.integers(task.token_id("+"), task.token_id("*") + 1, (n, r))
  tokens = np.where(np.arange(r) % 2 == 0, nums, ops)
  tokens[:, -1] = task.eos_id
  noise = rng.integers(0, task.vocab_size, (n, r))
  tokens = np.where(rng.random((n, r)) < 0.05, noise, tokens).astype(np.int32)
  mask = np.arange(r) < rng.integers(r - 1, r + 4, (n, 1))
  ok, value = _evaluate(task, tokens, mask)
  ref = [_py_evaluate(task, tokens[i], mask[i]) for i in range(n)]
  np.testing.assert_array_equal(ok, [a for a, _ in ref])
  np.testing.assert_array_equal(value, [b for _, b in ref])


# --- token_tree ----------------------------------------------------------------------------------

def test_token_tree_decisive_tokens():
  task, prompts, info, responses, mask = _data("token_tree")
  np.testing.assert_array_equal(prompts != task.token_id("?"), info["decisive"])
  assert np.all(info["decisive"].sum(-1) == task.num_decisive)
  rows = np.arange(N)
  bad = responses.copy()
  pos = np.argmax(info["decisive"], axis=-1)  # the first decisive position
  bad[rows, pos] = (bad[rows, pos] + 1) % task.num_symbols
  np.testing.assert_array_equal(_reward(task, prompts, bad, mask, info), 0.0)
  ok = responses.copy()
  pos = np.argmin(info["decisive"], axis=-1)  # a non-decisive position does not matter
  ok[rows, pos] = (ok[rows, pos] + 1) % task.num_symbols
  np.testing.assert_array_equal(_reward(task, prompts, ok, mask, info), 1.0)


def _random_info(task, n, rng):
  """A token_tree `info` drawn with NumPy (no PRNG compile)."""
  d = task.depth
  decisive = np.argsort(rng.random((n, d)), -1).argsort(-1) < task.num_decisive
  return {"key": rng.integers(0, task.num_symbols, (n, d)).astype(np.int32),
          "decisive": decisive,
          "key_prob": rng.uniform(0.05, 0.95, (n, d)).astype(np.float32)}


def _brute_force(task, one):
  """All K^D responses to one prompt, their probabilities, rewards, and V(s_t) by enumeration."""
  k, d = task.num_symbols, task.depth
  seqs = np.array(list(itertools.product(range(k), repeat=d)), np.int32).reshape(-1, d)
  q = one["key_prob"].astype(np.float64)
  probs = np.where(seqs == one["key"], q, (1 - q) / (k - 1)).prod(1)
  hits = (seqs == one["key"])[:, one["decisive"]]
  rewards = hits.mean(1) if task.graded else hits.all(1).astype(np.float64)
  values = np.zeros((len(seqs), d + 2))
  for t in range(d + 1):
    same = (seqs[:, None, :t] == seqs[None, :, :t]).all(-1)  # [S, S]: same first t tokens
    values[:, t] = (same * probs * rewards).sum(1) / (same * probs).sum(1)
  values[:, -1] = rewards
  responses = np.concatenate([seqs, np.full((len(seqs), 1), task.eos_id, np.int32)], axis=1)
  return responses, probs, rewards, values


@functools.partial(jax.jit, static_argnums=0)
def _exact(task, info, responses):
  """state_values, policy_log_probs, and reward of responses [n, G, R]."""
  group_info = jax.tree.map(lambda x: x[:, None], info)  # [n, 1, D]: broadcasts over G
  rewards = task.reward(None, responses, jnp.ones(responses.shape, bool), group_info)
  return task.state_values(info, responses), task.policy_log_probs(info, responses), rewards


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1), config=st.sampled_from(
    [(2, 1, 1, False), (2, 4, 2, False), (3, 3, 3, False), (3, 3, 2, True), (2, 4, 4, True)]))
def test_token_tree_values_equal_brute_force(seed, config):
  k, d, m, graded = config
  task = envs.get("token_tree", num_symbols=k, depth=d, num_decisive=m, graded=graded)
  info = _random_info(task, 3, np.random.default_rng(seed))
  cases = [_brute_force(task, jax.tree.map(lambda x: x[i], info)) for i in range(3)]
  responses = np.stack([c[0] for c in cases])
  values, log_probs, rewards = _exact(task, info, responses)
  for i, (_, probs, reward, value) in enumerate(cases):
    np.testing.assert_allclose(values[i], value, atol=1e-5)
    np.testing.assert_allclose(np.exp(np.asarray(log_probs[i], np.float64).sum(-1)), probs,
                               rtol=1e-4)
    np.testing.assert_allclose(rewards[i], reward, atol=1e-6)
    assert abs(probs.sum() - 1) < 1e-9


@functools.partial(jax.jit, static_argnums=(0, 3))
def _monte_carlo(task, key, info, g):
  responses, mask = task.sample_policy(key, info, g)
  values, _, rewards = _exact(task, info, responses)
  return responses, mask, values, rewards


def test_token_tree_monte_carlo():
  task, prompts, info, *_ = _data("token_tree")
  n, g = 8, 4096
  info = jax.tree.map(lambda x: x[:n], info)
  responses, mask, values, rewards = jax.tree.map(np.asarray, _monte_carlo(task, _key(1), info, g))
  assert responses.shape == mask.shape == (n, g, task.response_len) and mask.all()
  assert values.shape == (n, g, task.response_len + 1)
  np.testing.assert_array_equal(values[..., -1], rewards)  # V(s_R) is the reward
  v0 = values[:, 0, 0]
  np.testing.assert_array_equal(values[..., 0], np.broadcast_to(v0[:, None], (n, g)))
  assert np.all(np.abs(rewards.mean(1) - v0) < 4 * np.sqrt(v0 * (1 - v0) / g) + 1e-3)
  # V(s_t) is the policy's mean of V(s_{t+1}): true advantages average to ~0 at each position,
  # and are 0 at non-decisive positions.
  adv = values[..., 1:] - values[..., :-1]
  assert np.all(np.abs(adv.mean(1)) < 0.05)
  assert np.all(np.abs(adv[..., :-1] * ~info["decisive"][:, None]) < 1e-6)
  freq = np.mean(responses[..., :-1] == info["key"][:, None], axis=1)
  np.testing.assert_allclose(freq, info["key_prob"], atol=0.04)


def test_token_tree_values_off_policy():
  task = envs.get("token_tree", num_symbols=3, depth=4, num_decisive=2)
  info = _random_info(task, 1, np.random.default_rng(0))
  key = np.append(info["key"][0], task.eos_id)
  bad = np.stack([key, key, key])[None]
  bad[0, 0, 1] = task.token_id("?")  # a non-symbol at position 1: worth 0 from then on
  bad[0, 1, -2] = task.eos_id  # EOS too early: the response scores 0
  bad[0, 2, -1] = task.pad_id  # no EOS: scores 0
  values, _, rewards = _exact(task, info, bad)
  values = np.asarray(values[0])
  assert values[0, 1] > 0 and np.all(values[0, 2:] == 0)
  np.testing.assert_array_equal(values[1:, -1], 0.0)
  np.testing.assert_array_equal(rewards[0], 0.0)


# --- registry and host helpers -------------------------------------------------------------------

def test_registry():
  assert envs.names() == ("addition", "countdown", "countdown_steps", "scratch_add", "token_tree")
  assert envs.get("addition").vocab_size == 14
  assert envs.get("addition", num_digits=5).prompt_len == 12
  assert isinstance(envs.get("token_tree"), envs.Task)
  assert envs.get("countdown") == envs.get("countdown")  # equal and hashable: jit-cache friendly
  with pytest.raises(ValueError, match="addition, countdown, countdown_steps, scratch_add, token_tree"):
    envs.get("sudoku")
  with pytest.raises(ValueError, match="num_digits"):
    envs.get("addition", digits=3)
  with pytest.raises(ValueError, match="num_decisive"):
    envs.get("token_tree", num_decisive=10, depth=4)
  with pytest.raises(ValueError, match="num_digits"):
    envs.get("addition", num_digits=0)
  with pytest.raises(ValueError, match="overflow"):
    envs.get("countdown", num_numbers=12, max_number=9)


def test_detokenize():
  task = envs.get("addition", num_digits=2)
  ids = [task.token_id(c) for c in "12+34="] + [task.pad_id, 1]
  assert task.detokenize(ids) == "12+34="
  assert task.detokenize([0, 4, 6, task.eos_id]) == "046<eos>"
  assert envs.get("countdown", max_number=12).detokenize([12, 13, 3]) == "12 + 3"
  with pytest.raises(ValueError):
    task.detokenize([[1, 2]])
