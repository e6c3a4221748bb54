"""SPO-chain (`spo_chain`) against a plain-Python reference written from the SPO authors'
token loop (AIFrameResearch/SPO, `_compute_token_advantages`): V(c) is the mean outcome of
the continuations forked at cutpoint c only, and tokens before the first cutpoint get 0."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings

import credit
from groups import sampled_trees


def chain_ref(rewards, lengths, parent, fork, probs, threshold=0.9):
  """One group, per row and token, unwhitened. The authors index a cutpoint by the last
  token of its prefix (c = p − 1, so c = −1 is the prompt), give the last token the
  chain's score, walk the cutpoints with a running base (none before the first), copy
  each cutpoint's advantage back over the tokens before it, and zero tokens with
  probability > threshold. Continuations are value samples only: all 0."""
  out = [[0.0] * n for n in lengths]
  for n, length in enumerate(lengths):
    if parent[n] >= 0 or length == 0:
      continue
    kids = [b for b in range(len(lengths)) if parent[b] == n]
    cuts = sorted({fork[b] for b in kids})
    value = {p: float(np.mean([rewards[b] for b in kids if fork[b] == p])) for p in cuts}
    token_values = [None] * length
    token_values[-1] = float(rewards[n])
    base = None
    if cuts and cuts[0] == 0:  # cutpoint −1: the prompt's value is the first base
      base, cuts = value[0], cuts[1:]
    for p in cuts:
      token_values[p - 1] = value[p]
    adv = [None] * length
    for i, v in enumerate(token_values):
      if v is not None:
        adv[i] = 0.0 if base is None else v - base
        base = v
    for i in range(length - 1, -1, -1):
      if adv[i] is None:
        adv[i] = adv[i + 1]
    out[n] = [0.0 if probs[n][i] > threshold else a for i, a in enumerate(adv)]
  return out


def whiten_ref(rows, kept, eps=1e-8):
  flat = [a for r, k in zip(rows, kept) for a, keep in zip(r, k) if keep]
  if not flat or max(flat) == min(flat):
    return [[0.0] * len(r) for r in rows]
  m, s = np.mean(flat), np.std(flat)
  return [[(a - m) / (s + eps) if keep else 0.0 for a, keep in zip(r, k)]
          for r, k in zip(rows, kept)]


def rollouts(tokens, mask, rewards, parent, fork, logprobs=None):
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, parent=parent, fork=fork,
                         logprobs=logprobs)


def test_minimal_case_from_the_issue():
  """One chain, one cutpoint, N = 2 continuations with reward 0, chain reward 1: the
  low-probability token after the cutpoint gets R − V(c) = 1 (counting the chain's own
  outcome in V(c) gave 2/3); the tokens before the cutpoint get 0."""
  mask = np.ones((1, 3, 5), bool)
  r = rollouts(np.zeros((1, 3, 5), np.int32), mask, np.array([[1.0, 0.0, 0.0]], np.float32),
               np.array([[-1, 0, 0]], np.int32), np.array([[0, 2, 2]], np.int32))
  adv = np.asarray(credit.get("spo_chain")(r, whiten=False))
  np.testing.assert_array_equal(adv[0, 0], [0, 0, 1, 1, 1])
  np.testing.assert_array_equal(adv[0, 1:], 0)  # continuations: value samples only
  kept = np.asarray(credit.loss_mask("spo_chain", r, adv))
  np.testing.assert_array_equal(kept[0, 0], True)
  np.testing.assert_array_equal(kept[0, 1:], False)


def test_two_cutpoints_and_a_fork_at_the_prompt():
  """Cutpoints at 0 (the prompt's value), 2 and 4: segments get V(2) − V(0), V(4) − V(2),
  R − V(4); with no fork at 0 the first segment gets 0."""
  g, l = 7, 6
  parent = np.array([[-1, 0, 0, 0, 0, 0, 0]], np.int32)
  fork = np.array([[0, 0, 0, 2, 2, 4, 4]], np.int32)
  rewards = np.array([[1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 1.0]], np.float32)
  r = rollouts(np.zeros((1, g, l), np.int32), np.ones((1, g, l), bool), rewards, parent, fork)
  adv = np.asarray(credit.get("spo_chain")(r, whiten=False))[0, 0]
  np.testing.assert_allclose(adv, [0.25, 0.25, 0.5, 0.5, 0.0, 0.0])
  fork2 = np.array([[0, 1, 1, 2, 2, 4, 4]], np.int32)  # no fork at 0: V(1) is the first value
  adv = np.asarray(credit.get("spo_chain")(r.replace(fork=fork2), whiten=False))[0, 0]
  np.testing.assert_allclose(adv, [0.0, 0.25, 0.5, 0.5, 0.0, 0.0])


@settings(max_examples=25, deadline=None)
@given(sampled_trees(sizes=(1, 4, 7)))
def test_matches_the_authors_loop_on_random_forks(group):
  tokens, mask, rewards, parent, fork = group
  lengths = mask.sum(-1)
  for b in range(len(parent)):  # the sampler forks before a generated token: p < length
    for i in range(parent.shape[1]):
      if parent[b, i] >= 0 and parent[b, parent[b, i]] < 0:
        fork[b, i] = min(fork[b, i], max(lengths[b, parent[b, i]] - 1, 0))
  rng = np.random.default_rng(int(rewards.sum() * 1000) + tokens.size)
  probs = rng.choice([0.3, 0.95], size=mask.shape)
  logprobs = np.log(probs).astype(np.float32)
  r = rollouts(tokens, mask, rewards, parent, fork, logprobs)
  fn = credit.get("spo_chain")
  raw = np.asarray(jax.jit(lambda x: fn(x, whiten=False))(r))
  kept = np.asarray(credit.loss_mask("spo_chain", r, raw))
  rows, kept_rows = [], []
  for b in range(len(parent)):
    want = chain_ref(rewards[b].tolist(), lengths[b].tolist(), parent[b].tolist(),
                     fork[b].tolist(), probs[b].tolist())
    for g, row in enumerate(want):
      np.testing.assert_allclose(raw[b, g, :len(row)], row, atol=1e-6, err_msg=f"{b}, {g}")
      assert np.all(raw[b, g, len(row):] == 0)
      k = [parent[b, g] < 0 and probs[b, g, t] <= 0.9 for t in range(len(row))]
      np.testing.assert_array_equal(kept[b, g, :len(row)], k)
      rows.append(row)
      kept_rows.append(k)
  whitened = np.asarray(fn(r)).reshape(-1, mask.shape[-1])
  for i, row in enumerate(whiten_ref(rows, kept_rows)):
    np.testing.assert_allclose(whitened[i, :len(row)], row, rtol=1e-4, atol=1e-4)


def test_vmap_equals_batched_call_and_needs_forks():
  rng = np.random.default_rng(0)
  parent = np.tile(np.array([-1, -1, 0, 0, 1, 1], np.int32), (3, 1))
  fork = np.tile(np.array([0, 0, 1, 3, 2, 2], np.int32), (3, 1))
  rewards = (rng.random((3, 6)) < 0.5).astype(np.float32)
  r = rollouts(np.zeros((3, 6, 5), np.int32), np.ones((3, 6, 5), bool), rewards, parent, fork)
  fn = lambda x: credit.get("spo_chain")(x, whiten=False)
  np.testing.assert_allclose(jax.vmap(fn)(r), fn(r), atol=1e-7)
  with pytest.raises(ValueError, match="tree_cutpoints"):
    credit.get("spo_chain")(r.replace(parent=None, fork=None))
