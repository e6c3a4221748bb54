"""Tests for the chain-of-thought tasks envs/scratchpad_addition.py and envs/countdown_steps.py.

Rewards and process rewards are checked against plain-Python verifiers that parse the
detokenized text. As in test_envs.py, array functions go through a few shared jitted
wrappers (cached per task and shape), inputs are NumPy, keys use the "rbg" PRNG, and
hand-written cases are padded into that same [N, R] batch (their info tiled to N).
"""

import functools
import re

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

import envs

N = 1000  # one batch shape for every compiled call
SETTINGS = hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
TASKS = [("scratch_add", ()), ("countdown_steps", ()),
         ("scratch_add", (("num_digits", 3), ("num_operands", 3))),
         ("countdown_steps", (("num_numbers", 4), ("use_all", True)))]


def _key(seed):
  return jax.random.key(seed, impl="rbg")


_sample = jax.jit(lambda task, key: task.sample(key, N), static_argnums=0)
_demos = jax.jit(lambda task, info: task.demonstrations(None, info), static_argnums=0)
_reward = jax.jit(lambda task, *args: task.reward(None, *args), static_argnums=0)
_vmap_reward = jax.jit(lambda task, *args: jax.vmap(task.reward, (None, 0, 0, 0))(None, *args),
                       static_argnums=0)
_process = jax.jit(lambda task, *args: (task.reward(None, *args), task.token_rewards(None, *args),
                                        task.step_ends(None, *args)), static_argnums=0)


@functools.lru_cache(maxsize=None)
def _data(name, kwargs=()):
  """(task, prompts, info, responses, mask) for N prompts, as NumPy arrays."""
  task = envs.get(name, **dict(kwargs))
  prompts, info = _sample(task, _key(0))
  responses, mask = _demos(task, info)
  return task, *jax.tree.map(np.asarray, (prompts, info, responses, mask))


def _encode(task, texts):
  """Texts ("4+8=12,...<eos>", at most R tokens) as (responses int32 [n, R], mask [n, R])."""
  r = task.response_len
  responses, mask = np.full((len(texts), r), task.pad_id, np.int32), np.zeros((len(texts), r), bool)
  for i, text in enumerate(texts):
    ids = [task.token_id(c) for c in re.findall(r"<eos>|<pad>|.", text)]
    responses[i, :len(ids)], mask[i, :len(ids)] = ids, True
  return responses, mask


def _cases(task, info, texts):
  """Texts and a one-prompt info, padded to the shared batch: (responses, mask, info) [N, ...]."""
  responses, mask = _encode(task, list(texts) + [""] * (N - len(texts)))
  return responses, mask, jax.tree.map(lambda x: np.repeat(x, N, axis=0), info)


def _text(task, responses, mask):
  """The detokenized response as read: masked-out tokens become pads (detokenize stops there)."""
  return task.detokenize(np.where(mask, responses, task.pad_id))


# --- plain-Python reference verifiers -------------------------------------------------------------

def _split(text):
  """(parts, has_eos, closers): the text before its first <eos> split at ',', and the positions
  of each part's closing ',' (or the EOS, for the last part when has_eos)."""
  has_eos = "<eos>" in text
  body = text.split("<eos>")[0]
  parts = body.split(",")
  closers = list(np.cumsum([len(p) + 1 for p in parts]) - 1)
  return parts, has_eos, closers


def _py_scratch(task, operands, text):
  """(reward, {position: credit}) of a scratch_add response text for operands [K, D]."""
  d, k = task.num_digits, task.num_operands
  values = [int("".join(map(str, row))) for row in operands]
  carry, columns = 0, []
  for i in range(d):
    digits = [v // 10**i % 10 for v in values]
    total = sum(digits) + carry
    columns.append((digits + [carry], total))
    carry = total // 10
  parts, has_eos, closers = _split(text)
  steps = parts[:-1]

  def valid(step, column):
    expected, total = column
    if not re.fullmatch(r"[0-9](\+[0-9])*=[0-9]{1,2}", step):
      return False
    lhs, rhs = step.split("=")
    terms = [int(x) for x in lhs.split("+")]
    if len(terms) > k + 1 or int(rhs) != total:
      return False
    nonzero = lambda xs: sorted(x for x in xs if x)
    return nonzero(terms) == nonzero(expected) and terms.count(0) <= expected.count(0)

  credit, prefix = {}, True
  for i, step in enumerate(steps[:d]):
    prefix = prefix and valid(step, columns[i])
    if prefix:
      credit[closers[i]] = 1 / (d + 1)
  answer = parts[-1]
  correct = (has_eos and len(steps) == d and prefix and bool(re.fullmatch(rf"[0-9]{{1,{d + 1}}}",
             answer)) and int(answer) == sum(values))
  if correct:
    credit[closers[-1]] = 1 / (d + 1)
  return float(correct), credit


def _py_countdown(task, numbers, target, text):
  """(reward, {position: credit}) of a countdown_steps response text."""
  k, v = task.num_numbers, task.max_digits
  parts, has_eos, closers = _split(text)
  num = rf"(0|[1-9][0-9]{{0,{v - 1}}})"
  pool, prefix, results, credit = list(numbers), True, [], {}
  s = len(parts) if has_eos and len(parts) <= k - 1 else 0
  for j, step in enumerate(parts[:k - 1]):
    m = re.fullmatch(rf"{num}([-+*/]){num}={num}", step)
    if prefix and m:
      a, op, b, r = int(m[1]), m[2], int(m[3]), int(m[4])
      exact = {"+": a + b == r, "-": a - b == r, "*": a * b == r,
               "/": b > 0 and a % b == 0 and a // b == r}[op]
      available = a in pool and (pool.remove(a) or b in pool)
      if available:
        pool.remove(b)
      prefix = exact and available
      pool.append(r)
      results.append(r)
    else:
      prefix = False
    comma_closed = j < len(parts) - 1
    if prefix and comma_closed and j < k - 2:
      credit[closers[j]] = 1 / (k - 1)
  correct = s >= 1 and prefix and len(results) == s and results[-1] == target
  correct = correct and (s == k - 1 or not task.use_all)
  if correct:
    credit[closers[s - 1]] = 1 - (s - 1) / (k - 1)
  return float(correct), credit


def _py_check(task, info, i, text):
  if task.name == "scratch_add":
    return _py_scratch(task, info["operands"][i], text)
  return _py_countdown(task, info["numbers"][i].tolist(), int(info["target"][i]), text)


def _assert_matches_python(task, info, responses, mask):
  rewards, token_rewards, step_ends = map(np.asarray, _process(task, responses, mask, info))
  for i in range(len(responses)):
    text = _text(task, responses[i], mask[i])
    reward, credit = _py_check(task, info, i, text)
    expected = np.zeros(task.response_len, np.float32)
    for pos, c in credit.items():
      expected[pos] = c
    assert rewards[i] == reward, text
    np.testing.assert_allclose(token_rewards[i], expected, atol=1e-6, err_msg=text)
    assert np.all(step_ends[i][expected != 0]), text
  return rewards


# --- the Task API ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kwargs", TASKS)
def test_shapes_and_demonstrations(name, kwargs):
  task, prompts, info, responses, mask = _data(name, kwargs)
  assert prompts.shape == (N, task.prompt_len) and prompts.dtype == np.int32
  assert responses.shape == mask.shape == (N, task.response_len) and responses.dtype == np.int32
  assert all(x.shape[0] == N for x in jax.tree.leaves(info))
  assert prompts.min() >= 0 and prompts.max() < task.vocab_size
  assert not np.any(prompts == task.pad_id)
  assert len(set(task.vocab)) == task.vocab_size <= 18
  lengths = mask.sum(-1)
  np.testing.assert_array_equal(mask, np.arange(task.response_len) < lengths[:, None])  # one run
  rows = np.arange(N)
  assert np.all(responses[rows, lengths - 1] == task.eos_id)
  assert np.all(np.where(mask, True, responses == task.pad_id))
  assert np.sum(responses == task.eos_id) == N
  rewards, token_rewards, step_ends = _process(task, responses, mask, info)
  np.testing.assert_array_equal(rewards, np.ones(N))
  if not kwargs:
    np.testing.assert_array_equal(_vmap_reward(task, responses, mask, info), np.ones(N))
  np.testing.assert_allclose(np.sum(token_rewards, -1), 1.0, atol=1e-6)
  steps = task.num_digits + 1 if name == "scratch_add" else task.num_numbers - 1
  np.testing.assert_array_equal(np.sum(step_ends, -1), steps)
  np.testing.assert_array_equal(step_ends, token_rewards > 0)
  hash(task)


@pytest.mark.parametrize("name", ["scratch_add", "countdown_steps"])
def test_any_leading_batch_dims(name):
  task, prompts, info, responses, mask = _data(name)
  shaped = jax.tree.map(lambda x: x.reshape((2, N // 2) + x.shape[1:]), (responses, mask, info))
  np.testing.assert_array_equal(_reward(task, *shaped), np.ones((2, N // 2)))
  one = jax.tree.map(lambda x: x[0], (responses, mask, info))
  reward, token_rewards, step_ends = _process(task, *one)
  assert reward.shape == () and reward == 1.0
  assert token_rewards.shape == step_ends.shape == mask.shape[1:]


@pytest.mark.parametrize("name", ["scratch_add", "countdown_steps"])
def test_demonstration_lengths_and_diversity(name):
  task, prompts, info, responses, mask = _data(name)
  lengths = mask.sum(-1)
  assert 20 <= lengths.min() and lengths.max() <= task.response_len <= 120
  assert len(np.unique(lengths)) >= 8  # variable length
  texts = {_text(task, responses[i], mask[i]) for i in range(N)}
  assert len(texts) > 0.99 * N


def test_registry_and_detokenize():
  assert {"scratch_add", "countdown_steps"} <= set(envs.names())
  task, prompts, info, responses, mask = _data("scratch_add")
  assert task.vocab_size == 15 and task.prompt_len == 12 and task.response_len == 52
  assert re.fullmatch(r"[0-9]{5}\+[0-9]{5}=", task.detokenize(prompts[0]))
  step = r"[0-9](\+[0-9])*=[0-9]{1,2}"
  assert re.fullmatch(rf"({step},){{5}}[0-9]{{1,6}}<eos>", task.detokenize(responses[0]))
  task, prompts, info, responses, mask = _data("countdown_steps")
  assert task.vocab_size == 18 and task.prompt_len == 19 and task.response_len == 60
  assert re.fullmatch(r"([0-9]{2},){4}[0-9]{2}=[0-9]{4}", task.detokenize(prompts[0]))
  step = r"[0-9]+[-+*/][0-9]+=[0-9]+"
  assert re.fullmatch(rf"({step},){{3}}{step}<eos>", task.detokenize(responses[0]))
  with pytest.raises(ValueError, match="num_digits"):
    envs.get("scratch_add", num_digits=9)
  with pytest.raises(ValueError, match="max_digits"):
    envs.get("countdown_steps", max_number=100, max_digits=2)


@pytest.mark.parametrize("name", ["scratch_add", "countdown_steps"])
def test_tokens_after_eos_ignored_and_truncation_scores_zero(name):
  task, prompts, info, responses, mask = _data(name)
  rng = np.random.default_rng(0)
  r = task.response_len
  lengths = mask.sum(-1)
  _, base_tr, _ = _process(task, responses, mask, info)
  noise = rng.integers(0, task.vocab_size, responses.shape)
  junk = np.where(mask, responses, noise).astype(np.int32)
  full = np.ones_like(mask)
  rewards, tr, _ = _process(task, junk, full, info)
  np.testing.assert_array_equal(rewards, 1.0)
  np.testing.assert_array_equal(tr, base_tr)

  def zero(resp, m):
    rewards, tr, _ = _process(task, resp.astype(np.int32), m, info)
    np.testing.assert_array_equal(rewards, 0.0)
    assert np.all(np.sum(tr, -1) < 1 - 1e-6)

  eos_pos = np.arange(r) == (lengths - 1)[:, None]
  zero(np.where(eos_pos, task.pad_id, responses), mask & ~eos_pos)  # EOS dropped
  zero(responses, mask & ~eos_pos)  # EOS masked out
  zero(junk, full & ~eos_pos)  # no EOS, junk follows
  half = np.arange(r) < (lengths // 2)[:, None]
  zero(np.where(half, responses, task.pad_id), half)  # cut in the middle
  early = np.where(np.arange(r) == (lengths - 3)[:, None], task.eos_id, responses)
  zero(early, mask)  # EOS two tokens early


# --- scratch_add ----------------------------------------------------------------------------------

def _scratch_info(task, *values):
  d = task.num_digits
  operands = np.array([[int(c) for c in f"{v:0{d}d}"] for v in values], np.int32)[None]
  style = np.zeros((1, d + 1, 2 * task.num_operands + 3), np.float32)
  return {"operands": operands, "style": style}


def test_scratch_add_hand_written():
  task = envs.get("scratch_add")  # 00734 + 02958 = 03692
  info = _scratch_info(task, 734, 2958)
  cases = {  # text: (reward, steps credited)
      "4+8=12,3+5+1=09,7+9+0=16,0+2+1=03,0+0+0=00,03692<eos>": (1, 6),
      "8+4=12,1+5+3=9,9+7=16,2+1=3,0=0,3692<eos>": (1, 6),  # reordered terms, zeros left out
      "4+8+0=12,5+3+1=9,0+7+9=16,1+2+0=3,0+0=0,003692<eos>": (1, 6),
      "4+8=12,3+5+1=09,7+9=16,0+2+1=03,0+0=0,3692<eos>1+1=": (1, 6),  # junk after EOS
      "4+8=12,3+5=8,7+9=16,0+2+1=03,0+0=0,3692<eos>": (0, 1),  # carry dropped, answer right
      "4+8=02,3+5=08,7+9=16,0+2+1=3,0+0=0,2692<eos>": (0, 0),  # wrong carry-out, consistent
      "4+8=12,3+5+1=09,7+9=16,0+2=2,0+0=0,2692<eos>": (0, 3),  # carry lost late
      "4+8=12,3+5+1=09,7+9=16,0+2+1=03,0+0=0,3693<eos>": (0, 5),  # wrong answer
      "4+8=12,3+5+1=09,7+9=16,0+2+1=03,0+0=0,0003692<eos>": (0, 5),  # answer too long
      "4+8=12,3+5+1=09,7+9=16,0+2+1=03,0+0+0+0=0,3692<eos>": (0, 4),  # too many terms
      "4+8=12,3+5+1=09,7+9=16,0+2+1=03,0+0=0,3692": (0, 5),  # no EOS
      "4+8=12,3+5+1=09,7+9=16,0+2+1=03,0+0=0<eos>": (0, 4),  # no answer (4 commas)
      "4+8=12,3+5+1=09,7+9=16,0+2+1=03,0+0=0,,3692<eos>": (0, 5),  # extra comma
      "4+8=12,3+5+1=009,7+9=16,0+2+1=03,0+0=0,3692<eos>": (0, 1),  # 3-digit total
      "4+8=12,3+5+1+0=09,7+9=16,0+2+1=03,0+0=0,3692<eos>": (0, 1),  # 4 terms (K+1 = 3)
      "4+9=13,3+5+1=09,7+9=16,0+2+1=03,0+0=0,3692<eos>": (0, 0),  # wrong digit
      "12=4+8,3+5+1=09,7+9=16,0+2+1=03,0+0=0,3692<eos>": (0, 0),
  }
  responses, mask, info = _cases(task, info, cases)
  rewards = _assert_matches_python(task, info, responses, mask)[:len(cases)]
  np.testing.assert_array_equal(rewards, [c[0] for c in cases.values()])
  _, tr, _ = _process(task, responses, mask, info)
  np.testing.assert_allclose(np.sum(tr[:len(cases)], -1), [c[1] / 6 for c in cases.values()],
                             atol=1e-6)
  # token_rewards on one example: 1/6 at each ',' of the three valid steps, nothing else.
  i = list(cases).index("4+8=12,3+5+1=09,7+9=16,0+2=2,0+0=0,2692<eos>")
  expected = np.zeros(task.response_len, np.float32)
  expected[[6, 15, 22]] = 1 / 6
  np.testing.assert_allclose(tr[i], expected, atol=1e-7)


def _rewrite_scratch(task, operands, rng, wrong_step=None):
  """A random valid rewrite of a correct scratchpad (term order, zeros, leading zeros); with
  wrong_step=i, step i's total is off by 10 (a wrong carry) and later carries follow it."""
  d = task.num_digits
  values = [int("".join(map(str, row))) for row in operands]
  carry, steps, answer = 0, [], 0
  for i in range(d):
    digits = [v // 10**i % 10 for v in values]
    terms = digits + [carry]
    total = sum(terms)
    if i == wrong_step:
      total = total + 10 if total < 10 else total - 10
    terms = [t for t in terms if t or rng.random() < 0.5] or [0]
    rng.shuffle(terms)
    s = f"{total:02d}" if total >= 10 or rng.random() < 0.5 else str(total)
    steps.append("+".join(map(str, terms)) + "=" + s)
    answer += total % 10 * 10**i
    carry = total // 10
  answer += carry * 10**d
  a = str(answer)
  a = a.zfill(rng.integers(len(a), d + 2)) if len(a) <= d else a
  return ",".join(steps) + "," + a + "<eos>"


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_scratch_add_alternative_paths_and_corrupted_carries(seed):
  task, prompts, info, responses, mask = _data("scratch_add")
  rng = np.random.default_rng(seed)
  texts = [_rewrite_scratch(task, info["operands"][i], rng) for i in range(N // 2)]
  wrong = rng.integers(0, task.num_digits, N // 2)
  texts += [_rewrite_scratch(task, info["operands"][i], rng, wrong[i])
            for i in range(N // 2)]
  alt, alt_mask = _encode(task, texts)
  half = jax.tree.map(lambda x: np.concatenate([x[:N // 2]] * 2), info)
  rewards, tr, _ = _process(task, alt, alt_mask, half)
  np.testing.assert_array_equal(rewards, [1.0] * (N // 2) + [0.0] * (N // 2))
  np.testing.assert_allclose(np.sum(tr, -1)[N // 2:], wrong / (task.num_digits + 1), atol=1e-6)
  _assert_matches_python(task, half, alt, alt_mask)


def test_scratch_add_any_digit_change_scores_zero():
  task, prompts, info, responses, mask = _data("scratch_add")
  rng = np.random.default_rng(0)
  digit = mask & (responses <= 9)
  rows = np.arange(N)
  pos = np.array([rng.choice(np.flatnonzero(d)) for d in digit])
  bad = responses.copy()
  bad[rows, pos] = (bad[rows, pos] + rng.integers(1, 10, N)) % 10
  np.testing.assert_array_equal(_process(task, bad, mask, info)[0], 0.0)


# --- countdown_steps ------------------------------------------------------------------------------

def test_countdown_steps_hand_written():
  task = envs.get("countdown_steps")
  info = {"numbers": np.array([[3, 5, 15, 16, 20]], np.int32), "target": np.array([26], np.int32),
          "steps": np.zeros((1, 4, 4), np.int32)}
  cases = {  # text: (reward, sum of token_rewards)
      "16+3=19,15+20=35,35/5=7,7+19=26<eos>": (1, 1),
      "16-15=1,20+5=25,25+1=26<eos>": (1, 1),  # three steps, 3 left unused
      "20+5=25,16-15=1,1+25=26<eos>": (1, 1),  # independent steps swapped
      "5+20=25,15-16=1,1+25=26<eos>": (0, 0.25),  # negative result
      "1+25=26,16-15=1,20+5=25<eos>": (0, 0),  # results used before they exist
      "16-15=1,20+5=25,25+1=26,26-3=23<eos>": (0, 0.75),  # last result misses the target
      "16-15=1,20+5=25,25+1=26<eos>,7+7=14": (1, 1),  # junk after EOS
      "16-15=1,20+5=25,25+1=26": (0, 0.5),  # no EOS
      "16-15=1,20+5=25,25+1=26,": (0, 0.75),
      "16+16=32,32-5=27,27-1=26<eos>": (0, 0),  # 16 used twice; 1 not available
      "16/3=5,5*5=25,25+1=26<eos>": (0, 0),  # inexact division
      "016-15=1,20+5=25,25+1=26<eos>": (0, 0),  # leading zero
      "16-15=01,20+5=25,25+1=26<eos>": (0, 0),
      "16-15=1,20+5=25,25*1=25,25+1=26<eos>": (0, 0.75),  # the 1 is used up
      "15+5=20,20+3=23,23+3=26<eos>": (0, 0.5),  # 3 used twice
      "20+3=23,23+16=39,39-15=24,24+5=29,29-3=26<eos>": (0, 0.75),  # more than k-1 steps
      "26<eos>": (0, 0),
      "<eos>": (0, 0),
      "16-15=1,20+5=25,1=26<eos>": (0, 0.5),
      "16-15=1,20+5=25,25+1+0=26<eos>": (0, 0.5),
  }
  responses, mask, info = _cases(task, info, cases)
  rewards = _assert_matches_python(task, info, responses, mask)[:len(cases)]
  np.testing.assert_array_equal(rewards, [c[0] for c in cases.values()])
  _, tr, ends = _process(task, responses, mask, info)
  np.testing.assert_allclose(np.sum(tr[:len(cases)], -1), [c[1] for c in cases.values()],
                             atol=1e-6)
  # token_rewards on one example: 1/4 at each ',', the rest 1/2 at the EOS.
  expected = np.zeros(task.response_len, np.float32)
  expected[[7, 15, 23]] = [0.25, 0.25, 0.5]
  np.testing.assert_allclose(tr[1], expected, atol=1e-7)
  np.testing.assert_array_equal(np.flatnonzero(ends[1]), [7, 15, 23])
  # use_all: only paths through all the numbers count.
  task = envs.get("countdown_steps", **dict(TASKS[3][1]))
  info = {"numbers": np.array([[3, 5, 15, 16]], np.int32), "target": np.array([8], np.int32),
          "steps": np.zeros((1, 3, 4), np.int32)}
  cases = ["16-15=1,5+3=8,8*1=8<eos>", "5+3=8<eos>", "16-15=1,5+3=8<eos>", "3+5=8,16/8=2,15-2=13"]
  responses, mask, info = _cases(task, info, cases)
  rewards = _assert_matches_python(task, info, responses, mask)
  np.testing.assert_array_equal(rewards[:4], [1, 0, 0, 0])


def test_countdown_steps_corrupted_first_result_scores_zero():
  task, prompts, info, responses, mask = _data("countdown_steps")
  rng = np.random.default_rng(0)
  bad = responses.copy()
  for i in range(N):
    first = task.detokenize(responses[i]).split(",")[0]
    pos = rng.integers(first.index("=") + 1, len(first))  # a digit of the first result
    bad[i, pos] = (bad[i, pos] + rng.integers(1, 10)) % 10
  rewards, tr, _ = _process(task, bad, mask, info)
  np.testing.assert_array_equal(rewards, 0.0)
  np.testing.assert_array_equal(np.sum(tr, -1), 0.0)


def _rewrite_countdown(text, rng):
  """Swaps the operands of random '+' and '*' steps (still valid)."""
  out = []
  for step in text.split("<eos>")[0].split(","):
    m = re.fullmatch(r"([0-9]+)([-+*/])([0-9]+)=([0-9]+)", step)
    a, op, b, r = m.groups()
    out.append(f"{b}{op}{a}={r}" if op in "+*" and rng.random() < 0.5 else step)
  return ",".join(out) + "<eos>"


# --- both: random corruptions against the Python reference ----------------------------------------

def _corrupt(task, text, rng):
  """A random edit of a response text (as tokens): substitutions, insertions, deletions,
  swaps, truncation, junk after EOS; or none."""
  toks = re.findall(r"<eos>|<pad>|.", text)
  symbols = list(task.vocab)
  digits = [str(i) for i in range(10)]
  for _ in range(rng.integers(0, 3)):
    if not toks:
      break
    kind, i = rng.integers(0, 6), rng.integers(0, len(toks))
    if kind == 0:
      toks[i] = str(rng.choice(digits))
    elif kind == 1:
      toks[i] = str(rng.choice(symbols))
    elif kind == 2:
      toks.insert(i, str(rng.choice(digits if rng.random() < 0.5 else symbols)))
    elif kind == 3 and len(toks) > 1:
      del toks[i]
    elif kind == 4 and i + 1 < len(toks):
      toks[i], toks[i + 1] = toks[i + 1], toks[i]
    elif kind == 5:
      toks = toks[:i] if rng.random() < 0.5 else toks + [str(rng.choice(symbols))]
  return "".join(toks[:task.response_len])


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(TASKS))
def test_reward_agrees_with_python_on_corruptions(seed, case):
  task, prompts, info, responses, mask = _data(*case)
  rng = np.random.default_rng(seed)
  texts = []
  for i in range(N):
    text = _text(task, responses[i], mask[i])
    if task.name == "scratch_add" and rng.random() < 0.5:
      text = _rewrite_scratch(task, info["operands"][i], rng, rng.integers(-1, 3))
    elif task.name == "countdown_steps":
      text = _rewrite_countdown(text, rng)
    texts.append(_corrupt(task, text, rng))
  noisy, noisy_mask = _encode(task, texts)
  rewards = _assert_matches_python(task, info, noisy, noisy_mask)
  assert 0 < rewards.mean() < 1
  if not case[1]:
    np.testing.assert_array_equal(_vmap_reward(task, noisy, noisy_mask, info), rewards)
