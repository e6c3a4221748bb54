"""`gigpo` against a plain-Python transcription of verl-agent's GiGPO.

Read (not copied, not run): github langfengQ/verl-agent at commit
2716b30b930f4fbddb01798ffcd20e707287680a (2026-02-11, the newest upstream commit; read through
forks, as the index holds no copy of langfengQ/verl-agent itself), `gigpo/core_gigpo.py`
(last changed upstream in 29e3e8b, 2025-09-03): `compute_step_discounted_returns`,
`compute_gigpo_outcome_advantage`, `episode_norm_reward` (called with its default
`compute_mean_std_cross_steps=True`), `build_step_group` (exact anchor observations) and
`step_norm_reward`; the call in `verl/trainer/ppo/ray_trainer.py` `compute_advantage`;
`agent_system/reward_manager/episode.py` (the episode's total reward on every step row);
defaults from `verl/trainer/config/ppo_trainer.yaml` (`mode: mean_norm`,
`step_advantage_w: 1.0`, `enable_similarity: False`) and `algorithm.gamma=0.95` in
`examples/gigpo_trainer/*.sh`.

verl-agent's batch has one row per step (turn): `uid` (the prompt group), `traj_uid`, the
anchor observation, the step's reward and the episode's total reward. The transcription takes
those rows and computes what the authors' functions compute, in Python floats.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
from credit.turns import Turns, episode_returns

B, G, K = 2, 4, 3  # one shape for every example
EPS = 1e-6


def rows_of(ids, rewards, mask):
  """verl-agent's step rows: (uid, traj_uid, anchor_obs, reward, episode reward) in step order."""
  rows = []
  for b in range(len(mask)):
    for i in range(len(mask[b])):
      n = int(sum(mask[b][i]))
      total = sum(float(rewards[b][i][k]) for k in range(n))
      for k in range(n):
        rows.append((b, (b, i), int(ids[b][i][k]), float(rewards[b][i][k]), total))
  return rows


def mean_std(xs):
  """torch.mean and torch.std (Bessel) of a list of two or more numbers."""
  mu = sum(xs) / len(xs)
  return mu, (sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def gigpo_authors(rows, gamma=0.95, w=1.0, mode='mean_norm', eps=EPS):
  """One advantage per step row."""
  remove_std = mode == 'mean_norm'
  # compute_step_discounted_returns: reverse discounted sums within each trajectory.
  returns = [0.0] * len(rows)
  for traj in {r[1] for r in rows}:
    idx = [j for j, r in enumerate(rows) if r[1] == traj]
    running = 0.0
    for j in reversed(idx):
      running = rows[j][3] + gamma * running
      returns[j] = running

  def norm(values, keys, single_mean_zero):
    by_key = {}
    for v, key in zip(values, keys):
      by_key.setdefault(key, []).append(v)
    stats = {}
    for key, xs in by_key.items():
      if len(xs) == 1:  # episode: mean 0, std 1; step: its own mean, std 1
        stats[key] = (0.0 if single_mean_zero else xs[0], 1.0)
      else:
        stats[key] = mean_std(xs)
    out = []
    for v, key in zip(values, keys):
      mu, sd = stats[key]
      out.append(v - mu if remove_std else (v - mu) / (sd + eps))
    return out

  # episode_norm_reward, compute_mean_std_cross_steps=True: every step row's episode score
  # enters its prompt group's statistics.
  episode = norm([r[4] for r in rows], [r[0] for r in rows], True)
  # build_step_group (exact anchors within a prompt group) + step_norm_reward.
  step = norm(returns, [(r[0], r[2]) for r in rows], False)
  return [e + w * s for e, s in zip(episode, step)]


def project(ids, rewards, mask, **hparams):
  """credit.get('gigpo') on tokens laid out as two per turn; returns per-row advantages (one
  per taken turn, in verl-agent's row order) after checking the tokens of a turn agree."""
  lengths = mask.sum(-1)
  token_turn = np.where(np.arange(2 * K) // 2 < lengths[..., None], np.arange(2 * K) // 2, -1)
  turns = Turns(state_ids=ids, rewards=rewards, turn_mask=mask, token_turn=token_turn)
  r = credit.Rollouts(tokens=np.zeros((B, G, 2 * K), np.int32), mask=token_turn >= 0,
                      rewards=np.asarray(episode_returns(rewards, mask)), turns=turns)
  adv = np.asarray(credit.get('gigpo')(r, **hparams))
  assert np.all(adv[token_turn < 0] == 0)
  np.testing.assert_array_equal(adv[..., 0::2], adv[..., 1::2])
  return [float(adv[b, i, 2 * k]) for b in range(B) for i in range(G) for k in range(lengths[b, i])]


@st.composite
def batches(draw, rewards=st.integers(-4, 4).map(lambda i: i / 4)):
  """B prompt groups of G trajectories, 0..K turns (the first at least 1), anchor states from
  a small alphabet (shared across trajectories and turns), quarter-grid step rewards."""
  n = np.array([[draw(st.integers(0, K)) for _ in range(G)] for _ in range(B)])
  n[:, 0] = np.maximum(n[:, 0], 1)
  mask = np.arange(K) < n[..., None]
  states = draw(st.integers(1, 3))
  ids = np.array([[[draw(st.integers(0, states - 1)) for _ in range(K + 1)] for _ in range(G)]
                  for _ in range(B)], np.int32)
  outcome_only = draw(st.booleans())
  r = np.array([[[draw(rewards) for _ in range(K)] for _ in range(G)] for _ in range(B)])
  if outcome_only:  # the reward on the last taken turn only
    last = mask & ~np.concatenate([mask[..., 1:], np.zeros_like(mask[..., :1])], -1)
    r = np.where(last, r, 0.0)
  return ids, np.where(mask, r, 0.0).astype(np.float32), mask


@settings(max_examples=25, deadline=None)
@given(batches())
def test_default_mean_norm_is_the_authors(batch):
  ids, rewards, mask = batch
  want = gigpo_authors(rows_of(ids, rewards, mask))
  np.testing.assert_allclose(project(ids, rewards, mask), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(batches(), st.sampled_from([1.0, 0.5]), st.sampled_from([1.0, 0.5]))
def test_mean_std_norm_is_the_authors(batch, gamma, w):
  # γ ∈ {1, 0.5} and quarter rewards keep the returns exact in float32, so tied returns are
  # bitwise tied in both (see the tie convention below).
  ids, rewards, mask = batch
  want = gigpo_authors(rows_of(ids, rewards, mask), gamma=gamma, w=w, mode='mean_std_norm')
  got = project(ids, rewards, mask, gamma=gamma, omega=w, mode='mean_std_norm')
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_convention_tied_returns_give_exactly_zero():
  """Seven trajectories take one turn each from state 7 and get reward 0.95: the bucket's
  returns, and the episode scores, are bitwise tied. The project gives exactly 0. The authors'
  torch.mean sums in float32 and misses the tied value by an ulp, and `mean_std_norm` divides
  that by σ + 1e-6: numpy float32 arithmetic (standing in for torch's) gives ≈ +0.056 per term.
  In exact arithmetic both are 0 (the transcription, in float64, gives 0)."""
  n, x = 7, np.float32(0.95)
  total = np.float32(0)
  for _ in range(n):
    total = np.float32(total + x)
  mu = np.float32(total / np.float32(n))
  sd = np.float32(np.sqrt(np.float32(n) * (x - mu) ** 2 / np.float32(n - 1)))
  authors_f32 = float((x - mu) / (sd + np.float32(EPS)))
  assert mu != x
  np.testing.assert_allclose(authors_f32, 0.056, atol=1e-3)
  rows = [(0, (0, i), 7, float(x), float(x)) for i in range(n)]
  assert gigpo_authors(rows, mode='mean_std_norm') == [0.0] * n
  ids = np.full((1, n, 2), 7, np.int32)
  mask = np.ones((1, n, 1), bool)
  rewards = np.full((1, n, 1), x, np.float32)
  turns = Turns(state_ids=ids, rewards=rewards, turn_mask=mask,
                token_turn=np.zeros((1, n, 1), np.int32))
  r = credit.Rollouts(tokens=np.zeros((1, n, 1), np.int32), mask=mask, rewards=rewards[..., 0],
                      turns=turns)
  assert np.all(np.asarray(credit.get('gigpo')(r, mode='mean_std_norm')) == 0.0)


def test_long_episodes_weigh_more_in_the_episode_baseline():
  """The authors' episode statistics run over step rows (`compute_mean_std_cross_steps`, on
  in their pipeline), as the project's default; `episode_stats_per_step=False` is a project
  option (GRPO's per-trajectory statistics). Trajectory 0: 3 turns, R = 1; trajectory 1: 1
  turn, R = 0; distinct states. Per step: μ = 3/4, A^E = 1/4 and −3/4; per trajectory: ±1/2."""
  ids = np.array([[[0, 1, 2, 3], [4, 5, 5, 5]]], np.int32)
  mask = np.array([[[True, True, True], [True, False, False]]])
  rewards = np.array([[[0, 0, 1], [0, 0, 0]]], np.float32)
  want = gigpo_authors(rows_of(ids, rewards, mask))
  np.testing.assert_allclose(want, [0.25, 0.25, 0.25, -0.75], atol=1e-12)
  token_turn = np.array([[[0, 1, 2], [0, -1, -1]]], np.int32)
  turns = Turns(state_ids=ids, rewards=rewards, turn_mask=mask, token_turn=token_turn)
  r = credit.Rollouts(tokens=np.zeros((1, 2, 3), np.int32), mask=token_turn >= 0,
                      rewards=np.array([[1.0, 0.0]], np.float32), turns=turns)
  np.testing.assert_allclose(credit.get('gigpo')(r)[0], [[0.25] * 3, [-0.75, 0, 0]], atol=1e-6)
  per_traj = credit.get('gigpo')(r, episode_stats_per_step=False)[0]
  np.testing.assert_allclose(per_traj, [[0.5] * 3, [-0.5, 0, 0]], atol=1e-6)
