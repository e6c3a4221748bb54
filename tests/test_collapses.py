"""One-step diagnoses of the collapses (issue 40, item 6): on a hand-made case where the paper's
intent is unambiguous, does the reading or the scale make the method push the wrong way?
docs/collapses.md has each verdict beside its result.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import credit
from experiments.training import train_step as ts

G = 4


def siop_group(answers):
  """G responses: one reasoning step (tokens 5, 6), the answer token, EOS; no hindsight
  evidence (the hindsight pass equals the sampling pass), so only the answer term is left."""
  tokens = np.array([[5, 6, a, 1] for a in answers], np.int32)
  ends = np.zeros((G, 4), bool)
  ends[:, [1, 3]] = True
  lp = np.full((G, 4), -1.0, np.float32)
  return credit.Rollouts(tokens=tokens, mask=np.ones((G, 4), bool),
                         rewards=np.zeros(G, np.float32), step_ends=ends, logprobs=lp,
                         hindsight_logprobs=lp)


def test_siop_the_authors_reading_prefers_no_arbitrary_mode():
  """SIOP rewards turns for raising the support of *reliable* outcome states. With four
  different answers no state is reliable. The first reading took the modal cluster as every
  response's target (ties to the lowest index) and gave its answer GRPO over agreement with
  it: response 0 alone got +1.5 (Bessel σ), more than each member of a 3-of-4 majority got
  (+0.5); the less reliable the mode, the larger the credit per agreeing response. That was
  the reading (the scale is GRPO's), and the 0 % collapse was rerun after the fix. The
  authors' code (dl-m9/SIOP) targets each response's own cluster, weighted by its share q:
  four different answers get equal credit, so no response is preferred, and a 3-of-4
  majority gets more than the odd one out."""
  siop = credit.get('siop')
  none_agree = np.asarray(siop(siop_group([10, 11, 12, 13])))
  assert np.all(none_agree == none_agree[:1])
  majority = np.asarray(siop(siop_group([10, 10, 10, 13])))
  assert np.all(majority[:3] == majority[:1]) and np.all(majority[0] > majority[3])
  # One reward per step: (1 − λ) q on the answer step (q = 3/4, 1/4), 0 on the first step,
  # z-normalised over the group's 8 step rewards, then summed to the end of each response.
  pool = np.array([0, 0, 0, 0, 0.375, 0.375, 0.375, 0.125])
  z = (pool - pool.mean()) / (pool.std(ddof=1) + 1e-6)
  np.testing.assert_allclose(majority[:, 2], z[4:], atol=1e-5)
  np.testing.assert_allclose(majority[:, 0], z[:4] + z[4:], atol=1e-5)


def progress_group(rewards):
  """Two responses of three tokens; the policy has moved to p = 0.9 on response 0's first
  token (the reference gives 0.5 everywhere), elsewhere p = 0.5."""
  lp = np.log(np.array([[0.9, 0.5, 0.5], [0.5, 0.5, 0.5]], np.float32))
  return credit.Rollouts(tokens=np.zeros((2, 3), np.int32), mask=np.ones((2, 3), bool),
                         rewards=np.asarray(rewards, np.float32), logprobs=lp,
                         ref_logprobs=np.log(np.full((2, 3), 0.5, np.float32)))


def test_progress_advantage_the_reading_rewards_drift_whatever_the_reward():
  """The paper measures log π/π_ref of an RL-trained policy to score trajectories. Used as a
  training bonus, it credits the tokens the policy has already moved towards. With equal
  rewards GRPO gives 0, but `progress_advantage` gives the moved token x − x̄ = log 1.8 − x̄ ≈
  +0.49. Its sign does not depend on coef: coef = 0.1 gives +0.049, the same direction, ten
  times slower. A gradient step raises that token's x, so the bonus grows: a feedback loop
  with no reward in it. The reading causes the collapse; the scale only sets its speed. With
  R = (0, 1) the failed response's moved token is penalised −0.22 instead of −0.81 (coef 1;
  its other tokens and GRPO's own advantage get −0.81 and −0.71)."""
  pa = credit.get('progress_advantage')
  equal = progress_group([1.0, 1.0])
  x = np.log(1.8)
  np.testing.assert_allclose(np.asarray(pa(equal))[0], [x - x / 6, -x / 6, -x / 6], atol=1e-5)
  np.testing.assert_allclose(np.asarray(pa(equal, coef=0.1)), 0.1 * np.asarray(pa(equal)),
                             atol=1e-6)
  assert np.all(np.asarray(credit.get('grpo')(equal)) == 0)
  failed = np.asarray(pa(progress_group([0.0, 1.0])))
  np.testing.assert_allclose(failed[0], [-0.2173, -0.8051, -0.8051], atol=1e-3)


def test_em_the_run_left_out_the_papers_kl_which_bounds_the_dis_preferred_term():
  """EM's collapse (grpo:iid:em, run without a KL: 0 % by step ~10, entropy rising) on a
  hand-made token: one dis-preferred sample (A < 0). #156 maximises alpha E_pref log pi −
  (1 − alpha) E_dispref log pi regularised by a KL to the reference. Without the KL the loss
  (1 − alpha) log pi falls without bound as log pi -> −inf, so a scale-free optimiser keeps
  pushing the token's mass onto the others; with k3 at kl_coef b it is least at
  log pi = ref − log(1 + (1 − alpha) / b) (d/dlogp: (1 − alpha) + b (1 − e^{ref − logp}) = 0)."""
  alpha, b, ref = 0.5, 0.1, -1.0

  def loss(lc, lp):
    lp = jnp.full((1, 1), lp, jnp.float32)
    mask, r = jnp.ones((1, 1), bool), jnp.full((1, 1), ref, jnp.float32)
    pg, _, _ = ts.surrogate(lc, lp, r, -jnp.ones((1, 1)), mask, r)
    kl = credit.kl_penalty(lp, r, mask, lc.kl_estimator) if lc.kl_loss else 0.0
    return jnp.sum(pg + lc.kl_coef * kl)

  bare = ts.LossConfig(policy_loss='em', em_alpha=1.0)
  object.__setattr__(bare, 'em_alpha', alpha)  # alpha < 1 without a KL, as the run was set
  without = jax.jit(jax.vmap(functools.partial(loss, bare)))
  values = np.asarray(without(jnp.array([ref, -5.0, -50.0])))
  assert values[0] > values[1] > values[2] and values[2] == pytest.approx((1 - alpha) * -50.0)
  assert float(jax.grad(functools.partial(loss, bare))(-50.0)) == pytest.approx(1 - alpha)
  lc = ts.LossConfig(policy_loss='em', em_alpha=alpha, kl_coef=b)
  best = ref - np.log(1 + (1 - alpha) / b)
  grad = jax.jit(jax.vmap(jax.grad(functools.partial(loss, lc))))
  below, at, above = np.asarray(grad(jnp.array([best - 0.1, best, best + 0.1])))
  assert abs(at) < 1e-5 and below < 0 < above
  grid = np.linspace(ref - 8.0, ref + 0.5, 171)
  with_kl = np.asarray(jax.jit(jax.vmap(functools.partial(loss, lc)))(jnp.asarray(grid)))
  assert float(grid[np.argmin(with_kl)]) == pytest.approx(best, abs=0.05)


def test_advantage_model_the_reading_is_right_the_untrained_model_is_the_cause():
  """#77's model outputs each response's advantage over the prompt's expected reward. With
  outputs equal to their labels R − μ the estimator is Dr. GRPO's advantage, so the reading
  pushes the right way. The run's model had not learned: after its 10 warm-up steps its value
  loss was still about half its labels' variance, so its centred scores were mostly noise.
  Adam turns noise of any size into a full step: its first update is −lr·g/(|g| + ε), the
  same for scores a thousand times smaller. Here a model that scores a failed response
  highest raises that response's tokens by lr, as far as a right model moves the successes.
  The cause is the model's training (the paper trains it before RL, on far more data), not
  the reading."""
  g, l, v = 4, 3, 5
  rewards = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
  tokens = np.array([[0, 1, 2], [3, 4, 0], [1, 1, 1], [2, 3, 4]], np.int32)
  mask = np.ones((g, l), bool)
  perfect = np.zeros((g, l), np.float32)
  perfect[:, -1] = rewards - rewards.mean()  # the score is read before the last token
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, values=perfect)
  am = credit.get('advantage_model')
  np.testing.assert_allclose(np.asarray(am(r)), np.asarray(credit.get('dr_grpo')(r)), atol=1e-7)
  noise = np.zeros((g, l), np.float32)
  noise[:, -1] = 1e-3 * np.array([0.2, 1.0, -0.7, -0.5])  # uncorrelated with R: 1 failed, top

  def first_step(adv):  # one Adam step on per-response logits [G, L, V]
    loss = lambda th: -jnp.sum(adv * jnp.take_along_axis(
        jax.nn.log_softmax(th), tokens[..., None], -1)[..., 0])
    th = jnp.zeros((g, l, v))
    opt = optax.adam(1e-2)
    upd, _ = opt.update(jax.grad(loss)(th), opt.init(th), th)
    lp = lambda t: jnp.take_along_axis(jax.nn.log_softmax(t), tokens[..., None], -1)[..., 0]
    return np.asarray(lp(th + upd) - lp(th))  # the change of each sampled token's log-prob

  noisy = am(r.replace(values=noise))
  small, large = first_step(noisy), first_step(1e3 * noisy)
  np.testing.assert_allclose(small, large, rtol=1e-3)
  right = first_step(am(r))
  assert np.all(small[1] > 0) and np.all(right[1] < 0)  # the failed response: up, not down
  # As far (each logit moves by lr either way; up and down differ at second order in lr).
  np.testing.assert_allclose(np.abs(small[1]), np.abs(right[1]), rtol=1e-2)


def pbsd_pair(step_evidence):
  """A success and a failure, each with two reasoning steps of two tokens (evidence e_1, e_2
  spread over their tokens) and a one-token answer closed by EOS."""
  ends = np.array([[0, 1, 0, 1, 0, 1]] * 2, bool)
  lp = np.full((2, 6), -1.0, np.float32)
  d = np.repeat(np.asarray(step_evidence, np.float32) / 2, 2)
  hs = lp + np.concatenate([d, [0.0, 0.0]])[None]
  return credit.Rollouts(tokens=np.zeros((2, 6), np.int32), mask=np.ones((2, 6), bool),
                         rewards=np.array([1.0, 0.0], np.float32), step_ends=ends,
                         logprobs=lp, hindsight_logprobs=hs)


def test_pbsd_the_reading_follows_its_teacher_the_teacher_is_the_cause():
  """PBSD (#164) moves a response's outcome credit onto the steps that raise the verified
  answer's posterior under the answer-conditioned teacher. Step 1 supports the answer
  (evidence +2), step 2 undermines it (−2): in the success step 1 gets the larger credit, in
  the failure step 2 the larger blame, as the paper intends, and each response's total over
  its steps is its GRPO advantage. With the evidence reversed (a teacher that cannot use the
  answer in its context, as the small model's measured one: docs/collapses.md), every weight is
  reversed, and the credit goes to the undermining step. The reading follows its teacher; the
  collapse comes from the teacher at this scale."""
  pbsd, grpo = credit.get('pbsd'), credit.get('grpo')
  good = np.asarray(pbsd(pbsd_pair([2.0, -2.0])))
  a = np.asarray(grpo(pbsd_pair([2.0, -2.0])))[:, 0]
  assert good[0, 0] > good[0, 2] > 0 and good[1, 2] < good[1, 0] < 0
  np.testing.assert_allclose(good[:, :4].sum(-1), 2 * 2 * a, rtol=1e-5)  # 2 steps x 2 tokens
  np.testing.assert_allclose(good[:, 4:], np.repeat(a[:, None], 2, 1), rtol=1e-6)
  bad = np.asarray(pbsd(pbsd_pair([-2.0, 2.0])))
  np.testing.assert_allclose(bad[:, :2], good[:, 2:4], rtol=1e-6)
  np.testing.assert_allclose(bad[:, 2:4], good[:, :2], rtol=1e-6)



@pytest.mark.parametrize('text,want', [
    ('4+8=12,3+5+1=09,7+9=16,1692<eos>', (1692, 1692)),   # the demonstration's format
    ('4+8=12,3+5+1=9,7+9=16,1692<eos>', (1692, 1692)),    # a one-digit total
    ('4+8=12,3+5+1=09,7+9=16,1592<eos>', (1592, 1692)),   # an answer that is not the copy
    ('4+8=12,3+5+1=09,7+9=06,692<eos>', (692, 692)),      # no carry out of the last column
    ('4+8=12,3+5+1=09,1692<eos>', None),                  # two steps of three
    ('4+8=12,3+5+1=09,7+9=16,1692', None),                # no EOS
    ('4+8=12,3+5+1=,7+9=16,1692<eos>', None)])            # a step without a total
def test_answer_only_copy_fidelity_reads_the_answer_its_scratchpad_implies(text, want):
  """`answer_only` (#143): where its collapse happens is measured by experiments/answer_copy.py
  (docs/collapses.md); its copy fidelity compares the written answer with the one the column
  totals imply (their units digits, the last carry in front)."""
  from experiments.answer_copy import implied_answer
  assert implied_answer(text, 3) == want
