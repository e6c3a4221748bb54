"""One-step diagnoses of two collapses (issue 40, item 6): on a hand-made group where the paper's
intent is unambiguous, does the reading or the scale make the estimator push the wrong way?

These tests pin the current readings' numbers; they change when a reading is fixed.
"""

import numpy as np

import credit

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


def test_siop_the_reading_rewards_an_arbitrary_mode_most_when_nothing_agrees():
  """SIOP rewards turns for raising the support of *reliable* outcome states. With four
  different answers no state is reliable, and the paper's target puts no preference on any.
  The project's target is the modal cluster (ties go to the lowest index), and its answer
  credit is GRPO over agreement with it. So response 0 alone gets +1.5 (Bessel σ), more than
  each member of a 3-of-4 majority gets (+0.5). The less reliable the mode, the larger the
  credit per agreeing response. That is the reading (the dropped reliability weighting), not
  the scale: the credit is GRPO-normalised, as `grpo`'s is."""
  siop = credit.get('siop')
  none_agree = np.asarray(siop(siop_group([10, 11, 12, 13])))[:, 2]
  np.testing.assert_allclose(none_agree, [1.5, -0.5, -0.5, -0.5], atol=1e-5)
  majority = np.asarray(siop(siop_group([10, 10, 10, 13])))[:, 2]
  np.testing.assert_allclose(majority, [0.5, 0.5, 0.5, -1.5], atol=1e-5)
  tie = np.asarray(siop(siop_group([10, 10, 12, 12])))[:, 2]  # 2-2: the lower index wins
  np.testing.assert_allclose(tie, [0.866, 0.866, -0.866, -0.866], atol=1e-3)


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
