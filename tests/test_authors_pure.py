"""`pure` against a plain-Python transcription of its authors' released code.

`pure_authors` below is our own re-implementation (loops, Python floats) of what the authors'
public training code computes for one prompt's group, written after reading it (not copied,
not run). `credit.get('pure')(r, variant='code')` must match it; the default (`'paper'`) must
match the paper's reading (`pure_paper` here, and `test_outcome_variants.pure_reference`
where every token is a step); a fixed case shows the two giving different numbers.
"""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
from test_outcome_variants import pure_reference

L = 6  # tokens per response (one shape per group size: eager JAX compiles per shape)


# ---------------------------------------------------------------------------------------------
# PURE. Read: github CJReinforce/PURE, openrlhf/trainer/ppo_utils/experience_maker.py,
# NaiveExperienceMaker.process_experiences and make_experience_list (also make_experience and
# _generate_vllm for the step masks; openrlhf/utils/utils.py,
# turn_process_reward_logits_to_reward for the weights), commit
# 41f9363b8cc4af044b7fc5f7f9bbbf62139e9553, run with examples/scripts/train_pure.sh:
# --advantage_estimator rloo --reward_baseline token --reward_mode PRMVR
# --verifiable_reward_coef 1.0 (and the CLI defaults: temperature 0.1 hard-coded, weighted
# reward on, step-separator advantages masked). The per-token KL penalty (init_kl_coef·kl,
# subtracted from the rewards before the returns) and the whitening of the advantages over the
# replay buffer are left out: neither is part of the credit for one group.


def pure_authors(token_rewards, ends, lengths, rewards, temperature=0.1, form='min', coef=1.0):
  """One group's advantages, a list of per-token lists of length L.

  Steps end at the separator tokens and at the response's last token (EOS), which always
  closes the final step; `token_rewards` at a step end is the PRM's score p(+) − p(−) there.
  """
  g = len(lengths)
  step_pos, step_rew, step_len = [], [], []
  for i in range(g):
    n = lengths[i]
    cols = [t for t in range(n - 1) if ends[i][t]] + [n - 1]
    scores = [float(token_rewards[i][t]) for t in cols]
    if form == 'min':  # softmax over the steps of −score/T
      top = max(-s / temperature for s in scores)
      e = [math.exp(-s / temperature - top) for s in scores]
      w = [x / sum(e) for x in e]
    else:  # --disable_weighted_reward: softmax of ones, 1/#steps
      w = [1.0 / len(scores)] * len(scores)
    step_pos.append(cols)
    step_rew.append([wk * s for wk, s in zip(w, scores)])
    # num_tokens_per_step: the tokens after the previous step end, this end token excluded
    step_len.append([cols[0]] + [cols[k] - cols[k - 1] - 1 for k in range(1, len(cols))])
  outcome = [sum(step_rew[i]) for i in range(g)]  # process_rewards.sum(-1)
  solved_minus_one = [float(r) - 1.0 for r in rewards]  # verifier reward in {−1, 0}
  out = []
  for i in range(g):
    # reward_baseline 'token': leave-one-out reward per token times the step's length
    rate = (sum(outcome) - outcome[i]) / (sum(lengths) - lengths[i])
    x = [0.0] * L
    for pos, pr, nt in zip(step_pos[i], step_rew[i], step_len[i]):
      x[pos] = pr - rate * nt
    v = solved_minus_one[i]
    x[lengths[i] - 1] += coef * (v - (sum(solved_minus_one) - v) / (g - 1))
    returns = [0.0] * L
    acc = 0.0
    for t in reversed(range(L)):
      acc += x[t]
      returns[t] = acc
    for pos in step_pos[i]:  # 0 advantage on the step separators (and EOS)
      returns[pos] = 0.0
    out.append(returns)
  return out


def pure_paper(token_rewards, ends, lengths, rewards, temperature=0.1, form='min', coef=1.0):
  """The paper's reading (the project's default): softmin-weighted process rewards at the
  marked steps plus coef·R on the last token, returns minus the others' mean G_0."""
  g = len(lengths)
  returns = []
  for i in range(g):
    n = lengths[i]
    cols = [t for t in range(n) if ends[i][t]]
    x = [0.0] * L
    if cols:
      scores = [float(token_rewards[i][t]) for t in cols]
      if form == 'min':
        top = max(-s / temperature for s in scores)
        e = [math.exp(-s / temperature - top) for s in scores]
        w = [v / sum(e) for v in e]
      else:
        w = [1.0] * len(cols)
      for t, wk, s in zip(cols, w, scores):
        x[t] = wk * s
    x[n - 1] += coef * float(rewards[i])
    row, acc = [0.0] * L, 0.0
    for t in reversed(range(n)):
      acc += x[t]
      row[t] = acc
    returns.append(row)
  g0 = [row[0] for row in returns]
  return [[(returns[i][t] - (sum(g0) - g0[i]) / (g - 1)) if t < lengths[i] else 0.0
           for t in range(L)] for i in range(g)]


def rollouts(token_rewards, ends, lengths, rewards):
  lengths = np.asarray(lengths)
  mask = np.arange(L) < lengths[..., None]
  return credit.Rollouts(tokens=np.zeros(mask.shape, np.int32), mask=mask,
                         rewards=np.asarray(rewards, np.float32),
                         token_rewards=np.asarray(token_rewards, np.float32),
                         step_ends=np.asarray(ends, bool))


QUARTERS = st.integers(-4, 4).map(lambda i: i / 4)  # PRM scores p(+) − p(−) in [−1, 1]


@st.composite
def batches(draw, b=2):
  """b groups of one size G in [2, 4]: token rewards, step ends, lengths, rewards."""
  g = draw(st.integers(2, 4))
  shape = (b, g)
  tr = draw(st.lists(QUARTERS, min_size=b * g * L, max_size=b * g * L))
  ends = draw(st.lists(st.booleans(), min_size=b * g * L, max_size=b * g * L))
  lengths = draw(st.lists(st.integers(1, L), min_size=b * g, max_size=b * g))
  rewards = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=b * g, max_size=b * g))
  return (np.reshape(tr, shape + (L,)), np.reshape(ends, shape + (L,)),
          np.reshape(lengths, shape), np.reshape(rewards, shape))


def per_group(fn, tr, ends, lengths, rewards, **kw):
  return np.array([fn(tr[b].tolist(), ends[b].tolist(), lengths[b].tolist(), rewards[b].tolist(),
                      **kw) for b in range(len(lengths))])


@settings(max_examples=20, deadline=None)
@given(batches(), st.sampled_from(['min', 'sum']), st.sampled_from([0.1, 0.5]),
       st.sampled_from([1.0, 0.5]))
def test_code_variant_is_the_authors_computation(batch, form, temperature, coef):
  r = rollouts(*batch)
  got = np.asarray(credit.get('pure')(r, variant='code', form=form, temperature=temperature,
                                      outcome_coef=coef))
  assert got.dtype == np.float32
  want = per_group(pure_authors, *batch, form=form, temperature=temperature, coef=coef)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(batches(), st.sampled_from(['min', 'sum']))
def test_default_is_the_paper_reading(batch, form):
  r = rollouts(*batch)
  got = np.asarray(credit.get('pure')(r, form=form, temperature=0.5))
  np.testing.assert_array_equal(got, credit.get('pure')(r, form=form, temperature=0.5,
                                                        variant='paper'))
  want = per_group(pure_paper, *batch, form=form, temperature=0.5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Every token a step: the existing reference of tests/test_outcome_variants.py.
  every = r.replace(step_ends=None)
  got = np.asarray(credit.get('pure')(every, form=form, temperature=0.5))
  tr, _, _, rewards = batch
  for b in range(len(rewards)):
    np.testing.assert_allclose(got[b], pure_reference(tr[b], r.mask[b], rewards[b], 0.5, form),
                               rtol=1e-5, atol=1e-5)


def test_fixed_case_the_variants_differ():
  # A: 4 tokens, steps end at t=1 and t=3 (EOS), scores 0.5 and 0.5 (softmin weights ½), R=1.
  # B: 3 tokens, one step ending at EOS t=2, score −0.5, R=0.
  tr = [[[0, .5, 0, .5, 0, 0], [0, 0, -.5, 0, 0, 0]]]
  ends = [[[0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]]]
  r = rollouts(tr, ends, [[4, 3]], [[1.0, 0.0]])
  paper = np.asarray(credit.get('pure')(r))[0]
  code = np.asarray(credit.get('pure')(r, variant='code'))[0]
  # Paper: G_0 = 1.5 and −0.5; A's returns [1.5, 1.5, 1.25, 1.25] minus −0.5, B's −0.5 minus 1.5.
  np.testing.assert_allclose(paper, [[2, 2, 1.75, 1.75, 0, 0], [-2, -2, -2, 0, 0, 0]], atol=1e-6)
  # Code: ρ_A = −0.5/3, ρ_B = 0.5/4; every step here has one (A) or two (B) tokens before its
  # end; verifier terms ±1. A: x_1 = 0.25 + 1/6, x_3 = 0.25 + 1/6 + 1; B: x_2 = −0.5 − 0.25 − 1.
  np.testing.assert_allclose(code, [[11 / 6, 0, 17 / 12, 0, 0, 0], [-1.75, -1.75, 0, 0, 0, 0]],
                             atol=1e-6)
  np.testing.assert_allclose(code, pure_authors(tr[0], ends[0], [4, 3], [1.0, 0.0]), atol=1e-6)
  np.testing.assert_allclose(paper, pure_paper(tr[0], ends[0], [4, 3], [1.0, 0.0]), atol=1e-6)


def test_unknown_variant_and_jit():
  tr = [[[0, .5, 0, .5, 0, 0], [0, 0, -.5, 0, 0, 0]]]
  ends = [[[0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]]]
  r = rollouts(tr, ends, [[4, 3]], [[1.0, 0.0]])
  with pytest.raises(ValueError, match="'paper' or 'code'"):
    credit.get('pure')(r, variant='released')
  jitted = jax.jit(lambda x: credit.get('pure')(x, variant='code'))
  np.testing.assert_allclose(jitted(r), credit.get('pure')(r, variant='code'), atol=1e-6)
