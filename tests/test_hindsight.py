"""Hindsight, answer-conditioned step credit (issue 23): the answer hint and the hindsight
pass of experiments/training/hindsight.py against hand-built sequences, and PBSD and HCAPO
(credit/hindsight.py) against plain-Python references and their GRPO reductions."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
from envs.scratchpad_addition import ScratchpadAddition
from experiments.models import decoder
from experiments.training import hindsight, loop
from groups import grpo_ref

TASK = ScratchpadAddition(num_digits=2)
CFG = decoder.PolicyConfig(vocab_size=TASK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                           d_ff=32, max_len=TASK.prompt_len + 2 * TASK.response_len)

# Compiling is most of this module's time. The task's sampling, demonstrations and step ends,
# the answer hint, the reference forwards and the estimators run jitted, one program per shape
# (op by op they compiled hundreds of small programs); the library runs them jitted too
# (hindsight_prompts, hinted_demonstrations, the loop's passes and credit). The batch sizes
# are shared (64 prompts, or 2 prompts x 3 responses) so each program compiles once here.
sample = jax.jit(TASK.sample, static_argnums=1)
demonstrations = jax.jit(TASK.demonstrations)
step_ends = jax.jit(TASK.step_ends)
answer_hint = jax.jit(functools.partial(hindsight.answer_hint, TASK))
forward = jax.jit(lambda params, prompt, seq: decoder.token_logprobs(params, CFG, prompt, seq))


@functools.lru_cache(maxsize=None)
def _jitted(name, static):
  return jax.jit(lambda rollouts, hp: credit.get(name)(rollouts, **dict(static), **hp))


def estimate(name, rollouts, static=(), **hp):
  """`credit.get(name)(rollouts, **hp, **dict(static))` jitted, as the loop's credit pass
  runs it: one program per shape (not one per operation), the float hyperparameters `hp`
  traced so every value shares it (`static`: those Python reads, e.g. siop's broadcast)."""
  hp = {k: jnp.float32(v) for k, v in hp.items()}
  return np.asarray(_jitted(name, tuple(static))(rollouts, hp))


@pytest.fixture(scope='module')
def params():
  return decoder.init_params(jax.random.PRNGKey(0), CFG)


def test_answer_hint_is_the_sum():
  prompts, info = sample(jax.random.key(3), 64)
  hint, n = (np.asarray(x) for x in answer_hint(prompts, info))
  demo, dmask = (np.asarray(x) for x in demonstrations(prompts, info))
  for i in range(64):
    ops = np.asarray(info['operands'][i])
    value = sum(int(''.join(map(str, row))) for row in ops)
    digits = [int(c) for c in str(value)]
    got = list(hint[i, :n[i]])
    assert got == digits or got == [0] + digits  # the demonstration may lead with a 0
    assert all(t == TASK.pad_id for t in hint[i, n[i]:])
    dl = int(dmask[i].sum())
    assert list(demo[i, dl - 1 - n[i]:dl - 1]) == got  # the tokens before EOS


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_with_hint_places_the_hint_after_each_prompt(seed):
  rng = np.random.default_rng(seed)
  b, p, r, pad = 3, 5, 4, 99
  prompts = rng.integers(0, 9, (b, p)).astype(np.int32)
  plen = rng.integers(1, p + 1, b).astype(np.int32)
  hint = rng.integers(0, 9, (b, r)).astype(np.int32)
  n = rng.integers(0, r + 1, b).astype(np.int32)
  for prompt_len in (None, plen):
    out, out_len = (np.asarray(x) for x in hindsight.with_hint(
        jnp.asarray(prompts), prompt_len, jnp.asarray(hint), jnp.asarray(n), pad))
    for i in range(b):
      k = p if prompt_len is None else int(plen[i])
      want = list(prompts[i, :k]) + list(hint[i, :n[i]])
      assert out_len[i] == len(want)
      assert list(out[i, :len(want)]) == want
      assert all(t == pad for t in out[i, len(want):])


def test_hindsight_pass_equals_teacher_forcing_after_prompt_and_answer(params):
  b, g = 2, 3  # the shapes of the self-hindsight test below: one compiled pass for both
  prompts, info = sample(jax.random.key(1), b)
  demo, dmask = demonstrations(prompts, info)
  tokens = jnp.stack([demo, jnp.roll(demo, 1, 0), demo], 1)
  mask = jnp.stack([dmask, jnp.roll(dmask, 1, 0), dmask], 1)
  hp, hl = hindsight.hindsight_prompts(prompts, None, info, task=TASK)
  got = np.asarray(loop.rows_logprobs(params, hp, tokens, mask, hl, None, cfg=CFG))
  hint, n = answer_hint(prompts, info)
  for i in range(b):
    ctx = jnp.concatenate([prompts[i], hint[i, :int(n[i])]])[None]
    for j in range(g):
      want, _ = forward(params, ctx, tokens[i, j][None])
      m = np.asarray(mask[i, j])
      np.testing.assert_allclose(got[i, j][m], np.asarray(want[0])[m], atol=2e-5)


# ------------------------------------------------------------------ the estimators


def ref_steps(ends, mask):
  """[(start, stop)] of the reasoning steps (stop exclusive: through the step end): closed
  steps, less one closed on the response's last token (its answer)."""
  out, start = [], 0
  n = int(mask.sum())
  for t in range(n):
    if ends[t] and t < n - 1:
      out.append((start, t + 1))
      start = t + 1
  return out


def ref_pbsd(rewards, mask, ends, d, beta):
  a = grpo_ref(rewards)
  out = np.zeros(mask.shape)
  for idx in np.ndindex(rewards.shape):
    m = mask[idx]
    out[idx][m] = a[idx]
    steps = ref_steps(ends[idx], m)
    if not steps:
      continue
    z = [beta * np.sign(a[idx]) * sum(d[idx][s:e]) for s, e in steps]
    top = max(z)
    e_ = [math.exp(v - top) for v in z]
    for (s, e), w in zip(steps, e_):
      out[idx][s:e] = a[idx] * len(steps) * w / sum(e_)
  return out


def ref_hcapo(rewards, mask, ends, d, omega, clip):
  a = grpo_ref(rewards)
  out = np.zeros(mask.shape)
  qs = {}
  for idx in np.ndindex(rewards.shape):
    out[idx][mask[idx]] = a[idx]
    for s, e in ref_steps(ends[idx], mask[idx]):
      mean = float(np.mean(d[idx][s:e]))
      qs[idx + (s, e)] = (1 - math.exp(-min(max(mean, -clip), clip))) * rewards[idx]
  for grp in np.ndindex(rewards.shape[:-1]):
    keys = [k for k in qs if k[:len(grp)] == grp]
    vals = np.array([qs[k] for k in keys])
    if len(vals) < 2 or vals.max() <= vals.min():
      continue
    norm = (vals - vals.mean()) / (vals.std(ddof=1) + 1e-6)
    for k, v in zip(keys, norm):
      idx, s, e = k[:-2], k[-2], k[-1]
      out[idx][s:e] += omega * v
  return out


@st.composite
def step_groups(draw):
  g = draw(st.sampled_from([1, 3, 5]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  l = 9
  mask = np.arange(l) < rng.integers(0, l + 1, (2, g))[..., None]
  ends = (rng.random((2, g, l)) < 0.3) & mask
  rewards = (rng.random((2, g)) < 0.5).astype(np.float32)
  tokens = rng.integers(0, 5, (2, g, l)).astype(np.int32)
  lp = np.where(mask, -rng.random((2, g, l)) * 3, 0).astype(np.float32)
  hs = np.where(mask, lp + rng.normal(size=(2, g, l)), 0).astype(np.float32)
  return tokens, mask, ends, rewards, lp, hs


def _rollouts(tokens, mask, ends, rewards, lp, hs):
  return credit.Rollouts(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask),
                         rewards=jnp.asarray(rewards), logprobs=jnp.asarray(lp),
                         step_ends=jnp.asarray(ends), hindsight_logprobs=jnp.asarray(hs))


@settings(max_examples=12, deadline=None)
@given(step_groups(), st.sampled_from([0.5, 2.0]))
def test_pbsd_matches_reference(data, beta):
  tokens, mask, ends, rewards, lp, hs = data
  got = estimate('pbsd', _rollouts(*data), beta=beta)
  want = ref_pbsd(rewards, mask, ends, (hs - lp).astype(np.float64), beta)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


@settings(max_examples=12, deadline=None)
@given(step_groups())
def test_hcapo_matches_reference(data):
  tokens, mask, ends, rewards, lp, hs = data
  got = estimate('hcapo', _rollouts(*data), omega=0.5, clip=1.0)
  want = ref_hcapo(rewards, mask, ends, (hs - lp).astype(np.float64), 0.5, 1.0)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


@settings(max_examples=15, deadline=None)
@given(step_groups())
def test_reductions_to_grpo(data):
  tokens, mask, ends, rewards, lp, hs = data
  grpo = estimate('grpo', _rollouts(*data))
  for name, hp in (('pbsd', dict(beta=0.0)), ('hcapo', dict(omega=0.0, clip=1.0))):
    np.testing.assert_allclose(estimate(name, _rollouts(*data), **hp), grpo, atol=1e-6)
  same = _rollouts(tokens, mask, ends, rewards, lp, lp)  # the answer changes nothing: d = 0
  # (at the reference tests' hyperparameters: their compiled programs)
  for name, hp in (('pbsd', dict(beta=2.0)), ('hcapo', dict(omega=0.5, clip=1.0))):
    np.testing.assert_allclose(estimate(name, same, **hp), grpo, atol=1e-6)


def test_pbsd_moves_credit_to_the_step_that_supports_the_answer():
  # One success, one failure; two reasoning steps and an answer token (d = 5: the teacher
  # copies it; no hindsight term); step 0 supports the answer (d > 0).
  mask = np.ones((1, 2, 5), bool)
  ends = np.array([[[0, 1, 0, 1, 1], [0, 1, 0, 1, 1]]], bool)
  lp = np.full((1, 2, 5), -1.0, np.float32)
  hs = lp + np.array([1.0, 1.0, -1.0, -1.0, 5.0], np.float32)
  r = credit.Rollouts(tokens=jnp.zeros((1, 2, 5), jnp.int32), mask=jnp.asarray(mask),
                      rewards=jnp.array([[1.0, 0.0]]), logprobs=jnp.asarray(lp),
                      step_ends=jnp.asarray(ends), hindsight_logprobs=jnp.asarray(hs))
  adv = estimate('pbsd', r)
  assert adv[0, 0, 0] > adv[0, 0, 2] > 0  # the success: the supporting step gets more
  assert adv[0, 1, 2] < adv[0, 1, 0] < 0  # the failure: the undermining step gets more blame
  a = grpo_ref([[1.0, 0.0]])[0]
  np.testing.assert_allclose(adv[0, :, 4], a, atol=1e-6)  # the answer keeps A_i
  # Mean-one step weights on two 2-token steps: their total is 4 tokens x A_i, as GRPO's.
  np.testing.assert_allclose(adv[0, :, :4].sum(-1), 4 * a, atol=1e-5)


def test_missing_pass_is_named():
  r = credit.Rollouts(tokens=jnp.zeros((1, 2, 3), jnp.int32), mask=jnp.ones((1, 2, 3), bool),
                      rewards=jnp.zeros((1, 2)), logprobs=jnp.zeros((1, 2, 3)),
                      step_ends=jnp.zeros((1, 2, 3), bool))
  for name in ('pbsd', 'hcapo'):
    with pytest.raises(ValueError, match='hindsight_logprobs'):
      credit.get(name)(r)


def test_nan_in_the_hindsight_pass_is_not_hidden():
  r = credit.Rollouts(tokens=jnp.zeros((1, 2, 2), jnp.int32), mask=jnp.ones((1, 2, 2), bool),
                      rewards=jnp.array([[1.0, 0.0]]), logprobs=jnp.zeros((1, 2, 2)),
                      step_ends=jnp.array([[[1, 0], [1, 0]]], bool),
                      hindsight_logprobs=jnp.array([[[jnp.nan, 0.0], [0.0, 0.0]]]))
  with pytest.raises(ValueError, match='hindsight_logprobs'):
    credit.validate(r)
  for name in ('pbsd', 'hcapo'):
    assert np.isnan(estimate(name, r)[0, 0, 0])


def test_hinted_demonstrations_carry_the_answer_on_a_fraction_of_prompts():
  n = 64
  wide, plen, responses, mask = (np.asarray(x) for x in hindsight.hinted_demonstrations(
      jax.random.key(5), task=TASK, n=n, frac=0.5))
  prompts, info = sample(jax.random.split(jax.random.key(5))[0], n)
  demo, dmask = demonstrations(prompts, info)
  np.testing.assert_array_equal(responses, demo)
  np.testing.assert_array_equal(wide[:, :TASK.prompt_len], prompts)
  hint, hl = (np.asarray(x) for x in answer_hint(prompts, info))
  hinted = plen > TASK.prompt_len
  assert 0.25 < hinted.mean() < 0.75
  for i in range(n):
    k = plen[i] - TASK.prompt_len
    assert k in (0, hl[i])
    np.testing.assert_array_equal(wide[i, TASK.prompt_len:plen[i]], hint[i, :k])
    assert np.all(wide[i, plen[i]:] == TASK.pad_id)


@pytest.mark.slow  # ~15 s: a warm start (the hinted batch itself has a quick test)
def test_hinted_warm_start_trains_and_has_its_own_fingerprint(tmp_path):
  from configs import hindsight as hindsight_config
  from configs import tempo as tempo_config
  cfg = hindsight_config.get_config()
  cfg.quick, cfg.progress = True, False
  tempo_config.shrink(cfg, defaults=hindsight_config.get_config())
  cfg.quick = False
  cfg.task.kwargs = {'num_digits': 1}
  cfg.sft.steps = 30
  params, info = loop.sft(cfg, str(tmp_path / 'sft'))
  assert math.isfinite(info['loss']) and 0.0 <= info['greedy_acc'] <= 1.0
  plain = cfg.copy_and_resolve_references()
  plain.sft.hindsight_frac = 0.0
  with pytest.raises(ValueError, match='sft.hindsight_frac: None -> 0.5|hindsight_frac'):
    loop.sft(plain, str(tmp_path / 'sft'))  # the plain start is another checkpoint
  assert loop.run_config(plain, 0).sft.get('hindsight_frac') is None  # old fingerprints kept


# ------------------------------------------------------------------ SIOP: the group's own mode


def ref_answers(tokens, mask, ends):
  """Per response: its answer (tuple) or None (cut off: no step end on its last token)."""
  out = []
  for i in range(len(mask)):
    n = int(mask[i].sum())
    if n == 0 or not ends[i][n - 1]:
      out.append(None)
      continue
    last = max([t + 1 for t in range(n - 1) if ends[i][t]], default=0)
    out.append(tuple(int(x) for x in tokens[i][last:n - 1]))
  return out


@st.composite
def answer_groups(draw):
  g = draw(st.sampled_from([1, 4, 6]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  l = 8
  tokens = rng.integers(0, 2, (2, g, l)).astype(np.int32)  # small vocabulary: answers repeat
  n = rng.integers(0, l + 1, (2, g))
  mask = np.arange(l) < n[..., None]
  ends = (rng.random((2, g, l)) < 0.3) & mask
  closed = rng.random((2, g)) < 0.8  # most responses end on a step end (EOS)
  for b, i in np.ndindex(2, g):
    if n[b, i]:
      ends[b, i, n[b, i] - 1] = closed[b, i]
  rewards = (rng.random((2, g)) < 0.5).astype(np.float32)
  lp = np.where(mask, -rng.random((2, g, l)) * 3, 0).astype(np.float32)
  hs = np.where(mask, lp + rng.normal(size=(2, g, l)), 0).astype(np.float32)
  return tokens, mask, ends, rewards, lp, hs


@settings(max_examples=15, deadline=None)
@given(answer_groups())
def test_final_answers_and_their_clusters_match_reference(data):
  tokens, mask, ends = (jnp.asarray(x) for x in data[:3])
  (answer, length, has), (same, share) = jax.jit(lambda *a: (
      credit.hindsight.final_answers(*a), credit.hindsight.answer_clusters(*a)))(
          tokens, mask, ends)  # (jitted: see `estimate`)
  for b in range(2):
    answers = ref_answers(*(np.asarray(x)[b] for x in (tokens, mask, ends)))
    valid = [a for a in answers if a]  # the authors' code drops empty answers
    for i, a in enumerate(answers):
      assert bool(has[b, i]) == (a is not None)
      if a is not None:
        assert tuple(np.asarray(answer[b, i, :length[b, i]])) == a
      assert np.all(np.asarray(answer[b, i, length[b, i]:]) == -1)
      assert float(share[b, i]) == pytest.approx(valid.count(a) / len(valid) if a else 0.0)
      assert list(np.asarray(same[b, i])) == [bool(a) and a == c for c in answers]


def ref_siop(tokens, mask, ends, lp, hs, lam, broadcast):
  """The authors' SIOP (dl-m9/SIOP a871ef9: `siop_cluster_pass`, `compute_siop_process_rewards`
  and core_algos' 'siop' advantage), read and rewritten for one chain-of-thought response per
  row: clusters by exact match, q = the cluster's share of the answered responses (η = 0);
  turns are the steps (each closed by a step end, plus a cut-off tail); turn k's reward is
  q (log p̂_k − log p̂_{k−1}), p̂ the answer's per-token probability, which Bayes turns into
  the step's hindsight evidence over the answer's length; the last turn adds (1 − λ) q and a
  one-turn response gets only that; the group's turn rewards are z-normalised together (std
  below 1e-6 -> 1; one reward -> 0), then summed from each turn to the last."""
  out = np.zeros(mask.shape)
  d = (hs - lp).astype(np.float64)
  for b in range(mask.shape[0]):
    answers = ref_answers(tokens[b], mask[b], ends[b])
    valid = [a for a in answers if a]
    rewards, spans = [], []
    for i, a in enumerate(answers):
      n = int(mask[b, i].sum())
      cuts = [t + 1 for t in range(n) if ends[b, i, t]]
      steps = list(zip([0] + cuts, cuts + ([n] if not cuts or cuts[-1] < n else [])))
      steps = steps if n else []
      q = valid.count(a) / len(valid) if a else 0.0
      r = [0.0] * len(steps)
      for k, (s0, s1) in enumerate(steps):
        if q and len(steps) > 1:
          r[k] += q * d[b, i, s0:s1].sum() / len(a)
      if steps:
        r[-1] += (1 - lam) * q
      rewards.append(r)
      spans.append(steps)
    if broadcast:
      totals = grpo_ref(np.array([[sum(r) for r in rewards]]))[0]
      for i in range(len(answers)):
        out[b, i][mask[b, i]] = totals[i]
      continue
    pool = np.array([x for r in rewards for x in r])
    if len(pool) <= 1:
      continue
    std = pool.std(ddof=1)
    std = 1.0 if std < 1e-6 else std
    for i, (r, steps) in enumerate(zip(rewards, spans)):
      z = (np.array(r) - pool.mean()) / (std + 1e-6)
      for k, (s0, s1) in enumerate(steps):
        out[b, i, s0:s1] = z[k:].sum()
  return out


@settings(max_examples=12, deadline=None)
@given(answer_groups(), st.booleans())
def test_siop_matches_the_authors_code(data, broadcast):
  tokens, mask, ends, rewards, lp, hs = data
  got = estimate('siop', _rollouts(*data), static=(('broadcast', broadcast),), lam=0.3)
  np.testing.assert_allclose(got, ref_siop(tokens, mask, ends, lp, hs, 0.3, broadcast),
                             atol=1e-4, rtol=1e-4)
  # The task's reward plays no part.
  other = _rollouts(tokens, mask, ends, 1.0 - rewards, lp, hs)
  np.testing.assert_allclose(
      estimate('siop', other, static=(('broadcast', broadcast),), lam=0.3), got, atol=1e-6)


def test_self_hindsight_pass_puts_each_responses_own_answer_after_the_prompt(params):
  prompts, info = sample(jax.random.key(1), 2)
  demo, dmask = demonstrations(prompts, info)
  tokens = jnp.stack([demo, demo, jnp.roll(demo, 1, 0)], 1)  # response 2: the other's demo
  mask = jnp.stack([dmask, dmask, jnp.roll(dmask, 1, 0)], 1)
  gp = jnp.repeat(prompts[:, None], 3, 1)
  ginfo = jax.tree.map(lambda x: jnp.repeat(x[:, None], 3, 1), info)
  ends = step_ends(gp, tokens, mask, ginfo) & mask
  own, own_len = hindsight.own_answer_prompts(prompts, None, tokens, mask, ends,
                                              pad_id=TASK.pad_id)
  hint, n = answer_hint(prompts, info)  # each prompt's gold answer
  for i, j in np.ndindex(2, 3):
    k = i if j < 2 else 1 - i  # whose demonstration response (i, j) is
    wide, plen = hindsight.with_hint(prompts[i:i + 1], None, hint[k:k + 1], n[k:k + 1],
                                     TASK.pad_id)
    row = 3 * i + j
    assert int(own_len[row]) == int(plen[0])
    np.testing.assert_array_equal(np.asarray(own[row, :wide.shape[1]]), np.asarray(wide[0]))
    assert np.all(np.asarray(own[row, wide.shape[1]:]) == TASK.pad_id)
  # The pass scores response (i, j) after row 3i + j alone (rows of groups of one).
  got = loop.rows_logprobs(params, own, tokens.reshape(6, 1, -1), mask.reshape(6, 1, -1),
                           own_len, None, cfg=CFG).reshape(2, 3, -1)
  for i, j in np.ndindex(2, 3):
    want = loop.rows_logprobs(params, own[3 * i + j][None], tokens[i, j][None, None],
                              mask[i, j][None, None], own_len[3 * i + j][None], None, cfg=CFG)
    np.testing.assert_allclose(np.asarray(got[i, j]), np.asarray(want[0, 0]), atol=1e-5)
