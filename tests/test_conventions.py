"""The numbers in docs/conventions.md: our outputs on fixed inputs, beside a small numpy
re-implementation of what verl and TRL compute on the same inputs.

The `verl_*` and `trl_*` functions below are OUR READING of their code, written from
scratch in numpy (not their code, not run against it):
  verl: volcengine/verl @ b178a3c, verl/trainer/ppo/core_algos.py and
        verl/utils/torch_functional.py (masked_mean / masked_var / masked_whiten).
  TRL:  huggingface/trl @ f2cd577, trl/trainer/grpo_trainer.py (_generate_and_score_completions,
        _compute_loss), trl/trainer/rloo_trainer.py, trl/trainer/utils.py (nanstd).
If a test of ours fails, our convention changed: update the table. The readings only
document the other side of each row.
"""

import numpy as np
import pytest

import credit
from experiments.training.train_step import token_weights


def _rollouts(rewards, lengths=None, length=None, **fields):
  """[B, G] rewards (or [G]) and [..., G] lengths -> Rollouts with constant tokens."""
  rewards = np.asarray(rewards, np.float32)
  lengths = np.ones(rewards.shape, np.int32) if lengths is None else np.asarray(lengths)
  length = int(lengths.max()) if length is None else length
  mask = np.arange(length) < lengths[..., None]
  return credit.Rollouts(tokens=np.ones(mask.shape, np.int32), mask=mask, rewards=rewards,
                         **fields)


# ---------------------------------------------------------------------------
# Our reading of verl (numpy, float64 unless noted).


def verl_masked_whiten(x, mask):
  """torch_functional.masked_whiten: mean and *Bessel* variance over the mask (masked_var
  with unbiased=True), eps 1e-8 inside the square root: (x − μ)·rsqrt(var + 1e-8)."""
  m = mask.astype(np.float64)
  n = m.sum()
  mean = (x * m).sum() / (n + 1e-8)
  var = (((x - mean) ** 2) * m).sum() / (n + 1e-8) * n / (n - 1)
  return (x - mean) / np.sqrt(var + 1e-8)


def verl_rloo(scores):
  """compute_rloo_outcome_advantage on one group [G]: a group of one keeps its score."""
  g = len(scores)
  if g == 1:
    return scores.copy()
  return scores * g / (g - 1) - scores.mean() * g / (g - 1)


def verl_rloo_vectorized(scores):
  """compute_rloo_vectorized_outcome_advantage on one group [G]: 0 for a group of one."""
  g = len(scores)
  return (g * scores - scores.sum()) / max(g - 1, 1) * (g > 1)


def verl_rpp_baseline(rewards, mask):
  """compute_reinforce_plus_plus_baseline_outcome_advantage: R − group mean (mean 0 for a
  group of one), on every token, then masked_whiten over the batch. rewards [B, G]."""
  mean = np.where(rewards.shape[-1] > 1, rewards.mean(-1, keepdims=True), 0.0)
  tokens = (rewards - mean)[..., None] * mask
  return verl_masked_whiten(tokens, mask) * mask


def verl_grpo(scores, eps=1e-6, norm_adv_by_std_in_grpo=True):
  """compute_grpo_outcome_advantage on one group [G]: torch.std (Bessel), (R − μ)/(σ + eps);
  a group of one gets μ = 0, σ = 1."""
  if len(scores) == 1:
    mean, std = 0.0, 1.0
  else:
    mean, std = scores.mean(), scores.std(ddof=1)
  return (scores - mean) / (std + eps) if norm_adv_by_std_in_grpo else scores - mean


def verl_gae(token_rewards, values, mask, gamma, lam):
  """compute_gae_advantage_return: the GAE recursion, then masked_whiten of the advantages."""
  adv = np.zeros_like(token_rewards)
  last, next_v = 0.0, 0.0
  for t in reversed(range(token_rewards.shape[-1])):
    delta = token_rewards[:, t] + gamma * next_v - values[:, t]
    new = delta + gamma * lam * last
    next_v = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_v
    last = new * mask[:, t] + (1 - mask[:, t]) * last
    adv[:, t] = last
  return verl_masked_whiten(adv, mask)


def verl_k3(x):
  """kl_penalty_forward('low_var_kl' / 'k3') with x = logprob − ref_logprob:
  kl = clamp(ref − logprob, −20, 20); clamp(exp(kl) − kl − 1, −10, 10)."""
  kl = np.clip(-x, -20.0, 20.0)
  return np.clip(np.exp(kl) - kl - 1.0, -10.0, 10.0)


def verl_agg_weights(mask, mode, loss_scale_factor=None):
  """agg_loss on one micro-batch, global_batch_size / batch_num_tokens not given, dp_size 1,
  written as weights on the per-token losses."""
  m = mask.astype(np.float64)
  if mode == "seq-mean-token-sum-norm":
    return m / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
  if mode == "seq-mean-token-sum":
    return m / (m.sum(-1) > 0).sum()
  raise NotImplementedError(mode)


# ---------------------------------------------------------------------------
# Our reading of TRL.


def trl_grpo(scores, scale_rewards="group"):
  """GRPOTrainer advantages on one group [G] (sum_then_normalize): nanstd is Bessel, eps 1e-4
  outside; a group of one (eval only: training needs num_generations >= 2) has std 0."""
  std = scores.std(ddof=1) if len(scores) > 1 else 0.0
  adv = scores - scores.mean()
  return adv / (std + 1e-4) if scale_rewards != "none" else adv


def trl_rloo(scores):
  """RLOOTrainer advantages on one group [G]: R − mean of the others; 0 for a group of one."""
  g = len(scores)
  return scores - (scores.sum() - scores) / (g - 1) if g > 1 else np.zeros_like(scores)


def trl_k3(x):
  """GRPOTrainer per_token_kl, x = logp − ref_logp: exp(ref − logp) − (ref − logp) − 1, no clamp."""
  return np.exp(-x) + x - 1.0


def trl_dr_grpo_weights(mask, max_completion_length):
  """GRPOTrainer loss_type='dr_grpo': sum(l · mask) / (B · max_completion_length)."""
  return mask.astype(np.float64) / (mask.shape[0] * max_completion_length)


# ---------------------------------------------------------------------------
# Row: RLOO on a group of one.


def test_rloo_group_of_one():
  ours = np.asarray(credit.get("rloo")(_rollouts([[0.7]])))
  assert ours[0, 0, 0] == 0.0
  r = np.array([0.7])
  np.testing.assert_allclose(verl_rloo(r), [0.7])          # verl 'rloo': R passes through
  np.testing.assert_allclose(verl_rloo_vectorized(r), [0.0])  # verl 'rloo_vectorized': 0
  np.testing.assert_allclose(trl_rloo(r), [0.0])
  # With G > 1 all three agree: G/(G − 1)·(R − μ).
  r3 = np.array([1.0, 0.0, 0.0])
  ours3 = np.asarray(credit.get("rloo")(_rollouts([r3])))[0, :, 0]
  np.testing.assert_allclose(ours3, [1.0, -0.5, -0.5], rtol=1e-6)
  np.testing.assert_allclose(verl_rloo(r3), ours3, rtol=1e-6)
  np.testing.assert_allclose(trl_rloo(r3), ours3, rtol=1e-6)


# Row: REINFORCE++-baseline on groups of one.


def test_reinforce_pp_baseline_groups_of_one():
  rewards = np.array([[1.0], [2.0], [3.0]], np.float32)  # three prompts, G = 1
  ours = np.asarray(credit.get("reinforce_pp_baseline")(_rollouts(rewards)))
  assert np.all(ours == 0.0)
  theirs = verl_rpp_baseline(rewards.astype(np.float64), np.ones((3, 1, 1)))
  np.testing.assert_allclose(theirs[:, 0, 0], [-1.0, 0.0, 1.0], atol=1e-7)


# Row: batch whitening (reinforce_pp, reinforce_pp_baseline).


def test_batch_whitening_population_variance_eps_outside():
  # Three one-token responses with returns 1, 2, 3 and no KL term.
  ours = np.asarray(credit.get("reinforce_pp")(_rollouts([[1.0, 2.0, 3.0]])))[0, :, 0]
  np.testing.assert_allclose(ours, [-1.2247449, 0.0, 1.2247449], rtol=1e-6)  # ±√(3/2)
  theirs = verl_masked_whiten(np.array([1.0, 2.0, 3.0]), np.ones(3))
  np.testing.assert_allclose(theirs, [-1.0, 0.0, 1.0], atol=1e-7)
  np.testing.assert_allclose(ours[[0, 2]] / theirs[[0, 2]], np.sqrt(3 / 2), rtol=1e-6)  # √(n/(n−1))


def test_batch_whitening_of_one_token():
  # One unmasked token: we give 0 ((x − x)/(0 + eps)); verl's Bessel masked_var raises there.
  ours = np.asarray(credit.get("reinforce_pp")(_rollouts([[5.0]])))
  assert ours[0, 0, 0] == 0.0


# Row: gae returns raw (not whitened) advantages.


def test_gae_is_not_whitened():
  # Two 2-token responses, outcome rewards 1 and 0, critic 0, γ = λ = 1.
  rollouts = _rollouts([[1.0, 0.0]], lengths=[[2, 2]], values=np.zeros((1, 2, 2), np.float32))
  ours = np.asarray(credit.get("gae")(rollouts, gamma=1.0, lam=1.0))[0]
  np.testing.assert_allclose(ours, [[1.0, 1.0], [0.0, 0.0]])
  token_rewards = np.array([[0.0, 1.0], [0.0, 0.0]])
  theirs = verl_gae(token_rewards, np.zeros((2, 2)), np.ones((2, 2)), 1.0, 1.0)
  np.testing.assert_allclose(theirs, [[0.8660254] * 2, [-0.8660254] * 2], rtol=1e-6)  # ±√3/2


# Row: GRPO std and eps.


def test_grpo_bessel_std_eps_outside():
  ours = np.asarray(credit.get("grpo")(_rollouts([[0.0, 1.0]])))[0, :, 0]
  expect = np.array([-0.5, 0.5]) / (np.sqrt(0.5) + 1e-6)  # σ = √(1/2) with Bessel, G = 2
  np.testing.assert_allclose(ours, expect, rtol=1e-6)
  np.testing.assert_allclose(verl_grpo(np.array([0.0, 1.0])), expect, rtol=1e-12)
  trl = trl_grpo(np.array([0.0, 1.0]))  # eps 1e-4
  np.testing.assert_allclose(trl, np.array([-0.5, 0.5]) / (np.sqrt(0.5) + 1e-4), rtol=1e-12)
  assert abs(abs(trl[0]) - 0.70700) < 1e-5 and abs(abs(ours[0]) - 0.7071058) < 1e-6


def test_grpo_group_of_one():
  ours = np.asarray(credit.get("grpo")(_rollouts([[0.7]])))[0, 0, 0]
  np.testing.assert_allclose(ours, 0.7 / (1 + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(verl_grpo(np.array([0.7])), [0.7 / (1 + 1e-6)])
  np.testing.assert_allclose(trl_grpo(np.array([0.7])), [0.0])


def test_grpo_all_equal_rewards_are_exactly_zero():
  rewards = np.full(7, 0.3, np.float32)
  ours = np.asarray(credit.get("grpo")(_rollouts([rewards])))
  assert np.all(ours == 0.0)
  # The plain formula in float32 (numpy's summation order; torch's may round differently)
  # turns the rounding error of the mean into a visible advantage.
  mean = rewards.mean(dtype=np.float32)
  std = rewards.std(ddof=1, dtype=np.float32)
  plain = (rewards - mean) / (std + np.float32(1e-6))
  assert np.all(np.abs(plain) > 1e-3)


# Row: Dr. GRPO.


def test_dr_grpo_advantage():
  r = np.array([0.0, 1.0, 1.0])
  ours = np.asarray(credit.get("dr_grpo")(_rollouts([r])))[0, :, 0]
  np.testing.assert_allclose(ours, [-2 / 3, 1 / 3, 1 / 3], rtol=1e-6)
  np.testing.assert_allclose(verl_grpo(r, norm_adv_by_std_in_grpo=False), ours, rtol=1e-6)
  np.testing.assert_allclose(trl_grpo(r, scale_rewards="none"), ours, rtol=1e-6)
  one = np.asarray(credit.get("dr_grpo")(_rollouts([[0.7]])))[0, 0, 0]
  np.testing.assert_allclose(one, 0.7, rtol=1e-6)  # a group of one keeps R (verl too)
  np.testing.assert_allclose(verl_grpo(np.array([0.7]), norm_adv_by_std_in_grpo=False), [0.7])
  np.testing.assert_allclose(trl_grpo(np.array([0.7]), scale_rewards="none"), [0.0])


# Row: seq-mean-token-sum-norm scale.


def test_seq_mean_token_sum_norm_weight():
  lengths = np.array([5, 3, 1, 0])
  mask = np.arange(5) < lengths[:, None]  # S = 4 sequences, L_max = 5
  ours = np.asarray(token_weights(mask, "seq-mean-token-sum-norm"))
  np.testing.assert_allclose(ours, mask / (4 * 5))
  verl = verl_agg_weights(mask, "seq-mean-token-sum-norm")
  np.testing.assert_allclose(verl, mask / 5)
  np.testing.assert_allclose(verl[mask] / ours[mask], 4.0)  # verl = S × ours
  np.testing.assert_allclose(trl_dr_grpo_weights(mask, 5), ours)


# Row: empty sequences in the sequence means.


def test_empty_rows_count_in_the_sequence_mean():
  mask = np.array([[True, True, False], [False, False, False]])
  ours = np.asarray(token_weights(mask, "seq-mean-token-sum"))
  np.testing.assert_allclose(ours[0], [0.5, 0.5, 0.0])  # S = 2: the empty row counts
  np.testing.assert_allclose(verl_agg_weights(mask, "seq-mean-token-sum")[0], [1.0, 1.0, 0.0])
  ours_mean = np.asarray(token_weights(mask, "seq-mean-token-mean"))
  np.testing.assert_allclose(ours_mean[0], [0.25, 0.25, 0.0])


# Row: k3 clamping.


@pytest.mark.parametrize("x,ours_value,verl_value", [
    (30.0, 29.0, 10.0),                 # log π − log π_ref = 30
    (-3.0, np.exp(3.0) - 4.0, 10.0),    # 16.0855...: verl's clamp already acts here
    (-30.0, np.exp(30.0) - 31.0, 10.0),  # 1.0686e13
    (0.5, np.exp(-0.5) - 0.5, np.exp(-0.5) - 0.5),  # inside the clamp: the same
])
def test_k3_is_not_clamped(x, ours_value, verl_value):
  lp, ref = np.array([[x]], np.float32), np.zeros((1, 1), np.float32)
  ours = float(credit.kl_penalty(lp, ref, np.ones((1, 1), bool), "k3")[0, 0])
  np.testing.assert_allclose(ours, ours_value, rtol=1e-6)
  np.testing.assert_allclose(verl_k3(np.float64(x)), verl_value, rtol=1e-6)
  np.testing.assert_allclose(trl_k3(np.float64(x)), ours_value, rtol=1e-6)


def test_verl_k3_clamp_starts_acting_at_minus_2_61_and_11():
  # Our reading of verl: where exp(−x) + x − 1 reaches 10.
  assert verl_k3(-2.60) < 10.0 and verl_k3(-2.62) == 10.0
  assert verl_k3(10.99) < 10.0 and verl_k3(11.01) == 10.0


def test_k3_is_accurate_near_zero():
  # expm1(−x) + x: no cancellation at small x, where k3 ≈ x²/2.
  x = np.float32(1e-4)
  ours = float(credit.kl_penalty(np.array([[x]]), np.zeros((1, 1), np.float32),
                                 np.ones((1, 1), bool), "k3")[0, 0])
  np.testing.assert_allclose(ours, 0.5e-8, rtol=1e-3)
  naive = np.exp(-x, dtype=np.float32) + x - np.float32(1.0)  # float32, no expm1
  assert abs(naive - 0.5e-8) > 0.5e-8 * 0.1
