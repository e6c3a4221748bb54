"""`appo` against a plain-Python transcription of the APPO authors' released code.

Read (not copied, not run): github AMAP-ML/APPO at commit
b04e7e9b7f71464b50e8bb9875f65ce960e6ce33 (2026-06-11, its only commit):
`APPO/verl_arpo_entropy/verl/trainer/ppo/ray_trainer.py` `compute_appo_advantage` and
`apply_appo_reward_scale_M`; `.../workers/rollout/vllm_rollout/appo_branching.py`
`APPOBrancher.build_branch_rollout` (a branch copies the response up to and including its branch
token, `response[:idx + 1]`, and continues after it) and `compute_reward_scale_M`;
`.../trainer/ppo/core_algos.py` `compute_policy_loss_future_kl`; options of
`APPO/scripts/_appo_common.sh` (`adv_estimator=appo`, `reward_scale_discount=0.9`,
`policy_loss.loss_mode=future_kl`, `future_kl_clip_ratio=0.2`, `future_kl_clip_high_only=True`,
`future_kl_weight=1.0`).

The authors' batch has rows of kind 'init' or 'branch' per prompt and, per branch, a meta record
(its initial rollout's row, its row, the branch token's index in the response, its Branching
Score). The project's fork edges map onto it: a branch with `fork` = f copied tokens is the
authors' branch at token f − 1.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import credit

G, L = 6, 5
EPS = 1e-6


def reward_scale_m(split, score, max_score, length, discount=0.9):
  """`compute_reward_scale_M`: 1 + (BS / max BS)·discount^(split − t) on tokens t ≤ split."""
  m = [1.0] * length
  if max_score <= 0 or score <= 0:
    return m
  for t in range(min(split + 1, length)):
    m[t] = 1.0 + score / max_score * discount ** (split - t)
  return m


def appo_authors(kinds, rewards, lengths, metas, width=L, discount=0.9):
  """Token advantages [rows][width]. kinds: 'init' / 'branch' (one prompt); rewards: outcome
  rewards, placed on each row's last valid token (verl's reward manager); metas: (orig row,
  branch row, branch token index, Branching Score)."""
  n = len(kinds)
  token_rewards = [[0.0] * width for _ in range(n)]
  for i in range(n):
    token_rewards[i][lengths[i] - 1] = float(rewards[i])
  # apply_appo_reward_scale_M: each initial rollout's rewards times the mean of its branches' M.
  if metas:
    top = max(m[3] for m in metas)
    if top > 0:
      per_orig = {}
      for orig, _, split, score in metas:
        per_orig.setdefault(orig, []).append(reward_scale_m(split, score, top, width, discount))
      for orig, ms in per_orig.items():
        for t in range(width):
          token_rewards[orig][t] *= sum(m[t] for m in ms) / len(ms)
  scores = [sum(row) for row in token_rewards]
  # compute_appo_advantage: GRPO per (prompt, kind), population std, eps 1e-6.
  base = [0.0] * n
  for kind in ('init', 'branch'):
    idx = [i for i in range(n) if kinds[i] == kind]
    if not idx:
      continue
    mu = sum(scores[i] for i in idx) / len(idx)
    sd = (sum((scores[i] - mu) ** 2 for i in idx) / len(idx)) ** 0.5 if len(idx) > 1 else 0.0
    for i in idx:
      base[i] = (scores[i] - mu) / (sd + EPS)
  valid = [[1.0 if t < lengths[i] else 0.0 for t in range(width)] for i in range(n)]
  adv = [[base[i] * valid[i][t] if kinds[i] == 'init' else 0.0 for t in range(width)]
         for i in range(n)]
  aux_sum = [[0.0] * width for _ in range(n)]
  aux_count = [[0.0] * width for _ in range(n)]
  for orig, row, split, _ in metas:
    if split < 0 or kinds[orig] != 'init' or kinds[row] != 'branch':
      continue
    for t in range(min(split + 1, width)):
      aux_sum[orig][t] += base[row] * valid[orig][t]
      aux_count[orig][t] += valid[orig][t]
  for i in range(n):
    for t in range(width):
      if aux_count[i][t] > 0:
        adv[i][t] += aux_sum[i][t] / max(aux_count[i][t], 1.0)
      adv[i][t] *= valid[i][t]
  return np.array(adv)


def as_authors(rewards, lengths, parent, fork, scores=None):
  """The project's fork edges as the authors' rows and metas (branch token = fork − 1)."""
  kinds = ['init' if p < 0 else 'branch' for p in parent]
  metas = [(int(parent[b]), b, int(fork[b]) - 1, 1.0 if scores is None else scores[b])
           for b in range(len(parent)) if parent[b] >= 0]
  return kinds, rewards, lengths, metas


def project(rewards, lengths, parent, fork, **hparams):
  mask = np.arange(L)[None] < np.asarray(lengths)[:, None]
  r = credit.Rollouts(tokens=np.ones((1, len(lengths), L), np.int32), mask=mask[None],
                      rewards=np.asarray(rewards, np.float32)[None],
                      parent=np.asarray(parent, np.int32)[None],
                      fork=np.asarray(fork, np.int32)[None])
  return np.asarray(credit.get('appo')(r, **hparams))[0], np.asarray(
      credit.loss_mask('appo', r, None))[0]


@st.composite
def fork_groups(draw):
  """1-3 initial rollouts, the rest branches of an initial one that copy 1..len − 1 of its
  tokens (the branch token is never the last: the project's samplers re-sample a generated
  token, and the outcome reward sits on the last one); random Branching Scores."""
  roots = draw(st.integers(1, 3))
  lengths = [draw(st.integers(2, L)) for _ in range(G)]
  parent, fork = [-1] * G, [0] * G
  for b in range(roots, G):
    parent[b] = draw(st.integers(0, roots - 1))
    fork[b] = draw(st.integers(1, lengths[parent[b]] - 1))
    lengths[b] = max(lengths[b], fork[b] + 1)
  rewards = [draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])) for _ in range(G)]
  scores = [draw(st.floats(0.0, 2.0)) for _ in range(G)]
  return rewards, lengths, parent, fork, scores


@settings(max_examples=25, deadline=None)
@given(fork_groups())
def test_appo_is_the_authors_given_the_same_forks(group):
  rewards, lengths, parent, fork, scores = group
  got, keep = project(rewards, lengths, parent, fork)
  want = appo_authors(*as_authors(rewards, lengths, parent, fork, scores))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # branches have result_mask 0 in the authors' rollouts: out of the loss
  mask = np.arange(L)[None] < np.asarray(lengths)[:, None]
  np.testing.assert_array_equal(keep, mask & (np.asarray(parent) < 0)[:, None])


def test_difference_m_scales_a_reward_only_when_the_branch_token_is_the_last():
  """M multiplies the token rewards at and before the branch token; the outcome reward sits on
  the last token, so M changes a score only when a branch is taken at an initial rollout's last
  token (the authors' candidates do not exclude it). Three initial rollouts (rewards 1, 0, 0.5;
  3 tokens) and one branch at row 0's last token with the top Branching Score: M = 2 there, so
  the authors' scores are (2, 0, 0.5) and row 0 gets 1.373 (rows 1, 2: −0.981, −0.392); the
  project applies no M: 1.225 (−1.225, 0). The project's forks re-sample a generated token, so
  its samplers never copy a whole parent, and M is 1 on every fork they make."""
  rewards, lengths = [1.0, 0.0, 0.5, 1.0], [3, 3, 3, 3]
  parent, fork = [-1, -1, -1, 0], [0, 0, 0, 3]
  authors = appo_authors(*as_authors(rewards, lengths, parent, fork))
  got, _ = project(rewards, lengths, parent, fork)
  np.testing.assert_allclose(authors[:3, 0], [1.372811, -0.980580, -0.392232], atol=1e-5)
  np.testing.assert_allclose(got[:3, 0], [1.224744, -1.224744, 0.0], atol=1e-5)
  # The same group with the branch one token earlier: M leaves the scores alone, identical.
  fork = [0, 0, 0, 2]
  np.testing.assert_allclose(project(rewards, lengths, parent, fork)[0],
                             appo_authors(*as_authors(rewards, lengths, parent, fork)), atol=1e-5)


def future_kl_weights(log_ratio, gamma=2.0 ** (-1 / 128), clip=0.2, high_only=True, weight=1.0):
  """`compute_policy_loss_future_kl`'s advantage factor 1 + b·f_t for one response (no
  dual-clip filtering or safety cap: log ratios small): f_t = clip(exp(Σ_{k≥t} γ^{k−t} Δ_k))."""
  out = []
  for t in range(len(log_ratio)):
    future = sum(gamma ** (k - t) * log_ratio[k] for k in range(t, len(log_ratio)))
    f = min(max(np.exp(future), 1.0 if high_only else 1.0 - clip), 1.0 + clip)
    out.append(1.0 + weight * f)
  return out


def test_difference_the_released_loss_reweights_the_advantage():
  """The released scripts train with `loss_mode=future_kl`: each token's advantage is
  multiplied by 1 + b·clip(exp(FutureKL_t), 1, 1.2), b = 1. On the on-policy pass (Δ = 0) that
  is ×2 on every token; later minibatches add up to ×2.2 where the policy has moved up. The
  project's loss takes the estimator's advantage as it is (×1): a loss, not an estimator,
  difference, so the project's `appo` runs are not the released training recipe."""
  assert future_kl_weights([0.0, 0.0, 0.0]) == [2.0, 2.0, 2.0]
  np.testing.assert_allclose(future_kl_weights([0.5, 0.0, -0.1]), [2.2, 1.0 + 1.0, 2.0])
