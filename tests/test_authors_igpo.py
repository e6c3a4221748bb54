"""`igpo(variant='code')` against a plain-Python transcription of what the IGPO authors'
released training code computes for a group of multi-turn responses.

The transcription was written from reading the authors' code (not copied from it), with
loops over tokens and float64 arithmetic. It follows GuoqingWang1/IGPO at commit
bff163b72718a8b8f9175ce019ec7114ad6bd59a:
  * `scrl/llm_agent/generation.py`, `LLMGenerationManager.run_llm_loop`: before each turn s
    a probe forward pass gives p_s = exp(mean log-prob of the gold-answer tokens); from the
    second turn on the gain p_s − p_{s−1} is appended (so n − 1 gains for n turns);
  * `verl/utils/reward_score/info_gain.py`, `compute_score`: token scores are 0 except the
    gain of chunk i on the last token of chunk i (a chunk is an assistant turn with the tool
    reply after it) and the outcome (F1, −2 for bad format) on the response's last token;
    a response of one turn, or without gains, gets the outcome alone;
  * `verl/trainer/ppo/core_algos.py`, `compute_grpo_outcome_advantage` (what
    `adv_estimator=grpo` in `policy_optimization.sh` runs; the KL is a loss term, so the token
    rewards are the scores): per-token returns-to-go with gamma fixed at 1.0, minus the mean
    over the prompt's group (`agent_grpo.n` responses, right-padded with 0) of the returns
    at the same token position; the group std is computed and never used, so there is no
    std division; times the response mask.

The project's turn level has no token positions, so its 'code' variant takes the baseline per
turn index. The two agree exactly when every turn k spans the same token positions in every
response of the group, which the random cases below build (turn k has `lengths[k]` tokens
in every response that takes it); a fixed case shows they differ otherwise.
"""

import jax
import numpy as np
import pytest

import credit
from credit import agents
from credit.turns import Turns

TOL = dict(rtol=1e-5, atol=2e-5)  # float32 estimator against a float64 transcription


# ----------------------------------------------------------------------------- transcription

def authors_token_advantages(n, p, outcome, lengths):
  """Per response, the authors' token advantages (a list of floats per response, padded to
  the group's longest response with 0).

  n[g]: turns response g took (>= 0); p[g][s]: probe probability of the gold answer before
  turn s; outcome[g]: the outcome score; lengths[g][k]: tokens of response g's turn k
  (assistant turn plus its tool reply)."""
  G = len(n)
  # run_llm_loop: one probe per turn taken, the gain of turn s-1 appended at turn s.
  gains = []
  for g in range(G):
    row, prev = [], None
    for s in range(n[g]):
      cur = float(p[g][s])
      if s > 0:
        row.append(cur - prev)
      prev = cur
    gains.append(row)
  # compute_score: token scores of each response.
  scores = []
  for g in range(G):
    total = sum(lengths[g][:n[g]])
    row = [0.0] * total
    if total:
      if gains[g] == [] or n[g] == 1:
        row[-1] = float(outcome[g])
      else:
        end = 0
        for i in range(n[g]):
          end += lengths[g][i]
          if i < n[g] - 1:
            row[end - 1] = gains[g][i]
          else:
            row[-1] = float(outcome[g])
    scores.append(row)
  # Right padding to the longest response; response_mask is 1 on a response's own tokens.
  seq_len = max(len(row) for row in scores)
  rewards = [row + [0.0] * (seq_len - len(row)) for row in scores]
  mask = [[1.0] * len(row) + [0.0] * (seq_len - len(row)) for row in scores]
  # compute_grpo_outcome_advantage with gamma = 1.0.
  gamma = 1.0
  returns = [[0.0] * seq_len for _ in range(G)]
  for g in range(G):
    nxt = 0.0
    for t in reversed(range(seq_len)):
      cur = rewards[g][t] + gamma * nxt
      returns[g][t] = cur
      nxt = cur * mask[g][t]
  mean = [sum(returns[g][t] for g in range(G)) / G for t in range(seq_len)]
  return [[(returns[g][t] - mean[t]) * mask[g][t] for t in range(seq_len)] for g in range(G)]


# ----------------------------------------------------------------------------- helpers

def make_turns(n, logp, outcome, K):
  """One group: a Turns [G, K] with the outcome on each response's last turn (the authors'
  task has no other reward)."""
  G = len(n)
  mask = np.arange(K)[None, :] < np.asarray(n)[:, None]
  rewards = np.zeros((G, K), np.float32)
  for g in range(G):
    if n[g]:
      rewards[g, n[g] - 1] = outcome[g]
  return Turns(state_ids=np.zeros((G, K + 1), np.int32), rewards=rewards, turn_mask=mask,
               answer_logprobs=np.asarray(logp, np.float32))


def project_tokens(turns, lengths, width=None, **hparams):
  """The registered token-level `igpo` on responses whose turn k has lengths[g][k] tokens
  (`width` tokens per row, at least the longest response)."""
  n = turns.turn_mask.sum(-1)
  width = width or max(1, max(sum(lengths[g][:n[g]]) for g in range(len(n))))
  token_turn = np.full((len(n), width), -1, np.int32)
  for g in range(len(n)):
    t = 0
    for k in range(n[g]):
      token_turn[g, t:t + lengths[g][k]] = k
      t += lengths[g][k]
  turns = turns.replace(token_turn=token_turn)
  rollouts = credit.Rollouts(tokens=np.zeros(token_turn.shape, np.int32), mask=token_turn >= 0,
                             rewards=turns.rewards.sum(-1), turns=turns)
  return np.asarray(credit.get("igpo")(rollouts, **hparams)), token_turn


# ----------------------------------------------------------------------------- tests

def test_code_variant_equals_the_authors_code_on_random_groups():
  rng = np.random.default_rng(0)
  for case in range(30):
    G, K = ((1, 2), (3, 3), (5, 4))[case % 3]  # few shapes: few compilations
    n = rng.integers(1 if case % 4 else 0, K + 1, size=G)  # some groups with n_g = 0
    logp = np.log(rng.uniform(0.02, 1.0, size=(G, K + 1))).astype(np.float32)
    outcome = rng.choice([0.0, 0.5, 1.0, -2.0], size=G).astype(np.float32)
    per_turn = rng.integers(1, 4, size=K).tolist()  # turn k spans the same tokens in each
    lengths = [per_turn] * G
    turns = make_turns(n.tolist(), logp, outcome, K)
    want = authors_token_advantages(n.tolist(), np.exp(logp.astype(np.float64)).tolist(),
                                    outcome.tolist(), lengths)
    got, token_turn = project_tokens(turns, lengths, width=3 * K, variant="code")
    for g in range(G):
      m = len(want[g])
      np.testing.assert_allclose(got[g, :m], want[g], **TOL, err_msg=f"case {case}")
      assert np.all(got[g, m:] == 0.0)
    # The turn function itself: token advantages are its turn values spread over the turns.
    turn_level = np.asarray(agents.igpo(turns, variant="code"))
    picked = np.take_along_axis(turn_level, np.maximum(token_turn, 0), -1)
    np.testing.assert_array_equal(np.where(token_turn >= 0, picked, 0.0), got)


def test_fixed_case_paper_and_code_differ():
  # Response 0: two turns, p 0.2 -> 0.6 (gain 0.4), outcome 1; response 1: one turn, outcome 0.
  turns = make_turns([2, 1], np.log([[0.2, 0.6, 0.5], [0.3, 0.5, 0.5]]), [1.0, 0.0], K=2)
  code = np.asarray(agents.igpo(turns, variant="code"))
  paper = np.asarray(agents.igpo(turns))
  # Authors: raw rewards [0.4, 1.0] and [0.0]; returns [1.4, 1.0] and [0.0]; per-turn
  # baselines 0.7 and 0.5 (the finished response counts 0 at turn 1); no std division.
  np.testing.assert_allclose(code, [[0.7, 0.5], [-0.7, 0.0]], **TOL)
  # Paper: the three rewards z-normalised together (mean 7/15, Bessel std), then summed.
  r = np.array([0.4, 1.0, 0.0])
  z = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
  np.testing.assert_allclose(paper, [[z[0] + z[1], z[1]], [z[2], 0.0]], **TOL)
  np.testing.assert_allclose(paper, [[0.92718, 1.05963], [-0.92718, 0.0]], atol=1e-4)
  want = authors_token_advantages([2, 1], [[0.2, 0.6, 0.5], [0.3, 0.5, 0.5]], [1.0, 0.0],
                                  [[1, 1], [1, 1]])
  np.testing.assert_allclose(code, want, **TOL)


def test_unaligned_turns_are_where_the_turn_index_baseline_departs():
  # Response 0's first turn has 2 tokens, response 1's has 1: at token position 1 the
  # authors compare response 0's turn 0 with response 1's turn 1.
  turns = make_turns([2, 2], np.log([[0.2, 0.6, 0.5], [0.5, 0.3, 0.5]]), [1.0, 0.0], K=2)
  lengths = [[2, 1], [1, 2]]
  want = authors_token_advantages([2, 2], [[0.2, 0.6, 0.5], [0.5, 0.3, 0.5]], [1.0, 0.0],
                                  lengths)
  got, _ = project_tokens(turns, lengths, variant="code")
  # Returns: response 0 [1.4, 1.0], response 1 [-0.2, 0.0]. Turn-index baselines 0.6, 0.5;
  # the authors' token baselines are 0.6, 0.7 (1.4 and 0.0 at position 1), 0.5.
  np.testing.assert_allclose(got, [[0.8, 0.8, 0.5], [-0.8, -0.5, -0.5]], **TOL)
  np.testing.assert_allclose(want, [[0.8, 0.7, 0.5], [-0.8, -0.7, -0.5]], **TOL)


def test_variant_default_jit_and_errors():
  rng = np.random.default_rng(1)
  G, K = 4, 3
  n = rng.integers(0, K + 1, size=(2, G))
  mask = np.arange(K) < n[..., None]
  turns = Turns(state_ids=np.zeros((2, G, K + 1), np.int32),
                rewards=np.where(mask, rng.choice([0.0, 1.0], size=mask.shape), 0.0
                                 ).astype(np.float32), turn_mask=mask,
                answer_logprobs=np.log(rng.uniform(0.05, 1.0, (2, G, K + 1))).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(agents.igpo(turns, variant="paper")),
                                np.asarray(agents.igpo(turns)))
  for variant in ("paper", "code"):
    eager = np.asarray(agents.igpo(turns, gamma=0.9, variant=variant))
    jitted = jax.jit(lambda t, v=variant: agents.igpo(t, gamma=0.9, variant=v))(turns)
    np.testing.assert_allclose(np.asarray(jitted), eager, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="paper, code"):
    agents.igpo(turns, variant="released")
  assert "variant" in credit.hparam_names("igpo")
