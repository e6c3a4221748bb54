"""TAURA (credit.turn_weighting, issue 23) against a plain-Python reference and its outcome
counterpart (equal turn entropies: GRPO)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
from credit.turns import Turns
from groups import grpo_ref

G, K, A = 4, 3, 2  # turns of A action tokens, one observation token between turns


def make(seed, equal=False):
  """Rollouts of G trajectories [obs, a, a, obs, a, a, ...] with ragged turn counts."""
  rng = np.random.default_rng(seed)
  n = rng.integers(1, K + 1, G)
  l = K * (A + 1)
  token_turn = np.full((G, l), -1, np.int32)
  mask = np.zeros((G, l), bool)
  for i in range(G):
    for k in range(n[i]):
      s = k * (A + 1)
      mask[i, s:s + A + 1] = True
      token_turn[i, s + 1:s + 1 + A] = k
  policy = token_turn >= 0
  turn_mask = np.arange(K) < n[:, None]
  rewards = rng.integers(0, 2, G).astype(np.float32)
  ent = np.full((G, l), 0.7, np.float32) if equal else rng.exponential(1.0, (G, l)).astype(
      np.float32)
  turns = Turns(state_ids=np.zeros((G, K + 1), np.int32),
                rewards=np.where(turn_mask & (np.arange(K) == n[:, None] - 1),
                                 rewards[:, None], 0.0).astype(np.float32),
                turn_mask=turn_mask, token_turn=token_turn)
  return credit.Rollouts(tokens=np.zeros((G, l), np.int32), mask=mask, rewards=rewards,
                         policy_mask=policy, turns=turns, entropy=ent)


def ref_taura(r, w_min, w_max):
  adv = grpo_ref(r.rewards)
  out = np.zeros(r.mask.shape)
  for i in range(G):
    turns = sorted({int(k) for k in r.turns.token_turn[i] if k >= 0})
    h = {k: np.mean([r.entropy[i][t] for t in range(r.mask.shape[1])
                     if r.turns.token_turn[i][t] == k]) for k in turns}
    h_bar = np.mean(list(h.values()))
    for t, k in enumerate(r.turns.token_turn[i]):
      if k >= 0:
        w = 1.0 if h_bar <= 1e-6 else min(max(h[k] / h_bar, w_min), w_max)
        out[i, t] = adv[i] * w
  return out


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(0.5, 2.0), (0.0, 10.0), (1.0, 1.0)]))
def test_taura_matches_reference(seed, clip):
  r = make(seed)
  got = np.asarray(credit.get("taura")(r, w_min=clip[0], w_max=clip[1]))
  np.testing.assert_allclose(got, ref_taura(r, *clip), rtol=1e-4, atol=1e-5)


def test_equal_turn_entropies_give_grpo_and_inputs_are_checked():
  r = make(3, equal=True)
  np.testing.assert_allclose(credit.get("taura")(r), credit.get("grpo")(r), atol=1e-6)
  assert credit.needs("taura") == ("turns", "entropy")
  with pytest.raises(ValueError, match="entropy"):
    credit.get("taura")(r.replace(entropy=None))
  with pytest.raises(ValueError, match="w_min"):
    credit.get("taura")(r, w_min=1.5)
  ent = np.array(r.entropy)
  t = int(np.argwhere(np.asarray(r.turns.token_turn)[0] >= 0)[0, 0])
  ent[0, t] = np.nan
  with pytest.raises(ValueError, match="rollouts.entropy is not finite"):
    credit.get("taura")(r.replace(entropy=ent))
  out = np.asarray(jax.jit(credit.get("taura"))(r.replace(entropy=ent)))
  assert np.isnan(out[0, t]), out[0]  # under jit: NaN, never a finite number


def ref_copo_turns(r, w_min, w_max):
  """TAURA's reference with the turn confidence exp(mean log-prob) in place of entropy."""
  conf = np.zeros(r.mask.shape)
  for i in range(G):
    for k in {int(k) for k in r.turns.token_turn[i] if k >= 0}:
      ts = [t for t in range(r.mask.shape[1]) if r.turns.token_turn[i][t] == k]
      conf[i, ts] = np.exp(np.mean([r.logprobs[i][t] for t in ts]))
  return ref_taura(r.replace(entropy=conf.astype(np.float32)), w_min, w_max)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_copo_turns_matches_reference(seed):
  r = make(seed)
  r = r.replace(logprobs=-np.random.default_rng(seed).exponential(1.0, r.mask.shape).astype(
      np.float32))
  np.testing.assert_allclose(credit.get("copo_turns")(r), ref_copo_turns(r, 0.5, 2.0),
                             rtol=1e-4, atol=1e-5)
  same = r.replace(logprobs=np.full(r.mask.shape, -0.3, np.float32))
  np.testing.assert_allclose(credit.get("copo_turns")(same), credit.get("grpo")(same), atol=1e-6)

