"""APPO (#35): its Branching Score (experiments/rollouts/branching.py) against a plain reference
built from full-vocabulary forwards, the 'tree_branching' fork policy's layout, and the
dual-group credit `appo` against a plain-Python transcription of the authors' algorithm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
from experiments.models import decoder
from experiments.rollouts import branching, sampling
from experiments.training import loop

B, N, P, L, V = 2, 3, 3, 7, 11


@pytest.fixture(scope='module')
def model():
  cfg = decoder.PolicyConfig(vocab_size=V, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                             max_len=P + L)
  params = decoder.init_params(jax.random.PRNGKey(3), cfg)
  prompts = jax.random.randint(jax.random.PRNGKey(4), (B, P), 1, V)
  chains = sampling.sample_iid(params, cfg, jax.random.PRNGKey(5), prompts, N, L, eos_id=0)
  return cfg, params, prompts, chains


def ref_scores(cfg, params, prompts, chains, m, window):
  tokens, mask = np.asarray(chains.tokens), np.asarray(chains.mask)
  ent, lp = np.asarray(chains.entropy), np.asarray(chains.logprobs)
  out = np.full((B, N, L), -np.inf)
  fwd = jax.jit(lambda x: jax.nn.log_softmax(decoder.forward(params, cfg, x), -1))
  for b in range(B):
    for n in range(N):
      e = np.where(mask[b, n], ent[b, n], -np.inf)
      cand = sorted(range(L), key=lambda t: (-e[t], t))[:m]  # top-k: ties to the earlier
      full = np.concatenate([np.asarray(prompts[b]), tokens[b, n]])
      logp = np.asarray(fwd(jnp.asarray(full[None])))[0]  # [P + L, V]
      for t in cand:
        if not mask[b, n, t]:
          continue
        row = logp[P + t - 1].copy()
        row[tokens[b, n, t]] = -np.inf
        alt = full.copy()
        alt[P + t] = int(np.argmax(row))
        alt_logp = np.asarray(fwd(jnp.asarray(alt[None])))[0]
        js = [j for j in range(t + 1, min(t + window, L - 1) + 1) if mask[b, n, j]]
        g = (np.mean([lp[b, n, j] - alt_logp[P + j - 1, tokens[b, n, j]] for j in js])
             if js else 0.0)
        out[b, n, t] = ent[b, n, t] * abs(g)
  return out


def test_branching_scores_match_reference(model):
  cfg, params, prompts, chains = model
  m, window = 4, 2  # the fork test's sizes (one compiled program)
  got = np.asarray(branching.branching_scores(params, cfg, prompts, jnp.full((B,), P), chains,
                                              candidates=m, window=window))
  want = ref_scores(cfg, params, prompts, chains, m, window)
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  fin = np.isfinite(want)
  np.testing.assert_allclose(got[fin], want[fin], rtol=2e-4, atol=1e-5)
  assert np.any(got[fin] > 0)


def test_tree_branching_forks_at_the_best_scores(model):
  cfg, params, prompts, _ = model
  forks = branching.BranchingForks(num_forks=2, num_continuations=2, window=2, candidates=4)
  s = sampling.sample_tree_forks(params, cfg, jax.random.PRNGKey(5), prompts, N, L, forks,
                                 eos_id=0)
  assert s.tokens.shape == (B, N * (1 + 2 * 2), L)
  chains = jax.tree.map(lambda x: x[:, :N], s)
  np.testing.assert_array_equal(np.asarray(s.parent[:, :N]), -1)
  score = np.asarray(branching.branching_scores(params, cfg, prompts, jnp.full((B,), P),
                                                chains, candidates=4, window=2))
  parent, fork = np.asarray(s.parent[:, N:]), np.asarray(s.fork[:, N:])
  for b in range(B):
    for k in range(N * 4):
      n, f = k // 4, (k // 2) % 2  # children ordered (chain, fork, continuation)
      assert parent[b, k] == n
      best = np.argsort(-score[b, n], kind='stable')[f]
      assert fork[b, k] == min(best, int(chains.lengths[b, n]) - 1)
      # the child keeps the chain's tokens before its fork
      np.testing.assert_array_equal(np.asarray(s.tokens[b, N + k, :fork[b, k]]),
                                    np.asarray(chains.tokens[b, n, :fork[b, k]]))
  # same chains as i.i.d. sampling with G = N (the forks only add rows)
  iid = sampling.sample_iid(params, cfg, jax.random.PRNGKey(5), prompts, N, L, eos_id=0)
  np.testing.assert_array_equal(np.asarray(chains.tokens), np.asarray(iid.tokens))
  with pytest.raises(ValueError, match='window'):
    branching.BranchingForks(1, 1, window=0)


def ref_appo(rewards, mask, parent, fork, eps=1e-6):
  """The authors' `compute_appo_advantage`, one group at a time, in loops."""
  g, length = mask.shape
  kinds = [parent[i] < 0 for i in range(g)]

  def normalised(rows):
    r = [float(rewards[i]) for i in rows]
    mu = sum(r) / len(r)
    sd = (sum((x - mu) ** 2 for x in r) / len(r)) ** 0.5
    return {i: (x - mu) / (sd + eps) for i, x in zip(rows, r)}

  base = {}
  for kind in (True, False):
    rows = [i for i in range(g) if kinds[i] == kind]
    if rows:
      base.update(normalised(rows))
  adv = np.zeros((g, length))
  aux_sum, aux_count = np.zeros((g, length)), np.zeros((g, length))
  for i in range(g):
    if kinds[i]:
      adv[i] = base[i] * mask[i]
  for b in range(g):
    o = parent[b]
    if kinds[b] or not kinds[o]:
      continue  # only branches of initial rollouts credit a prefix
    for t in range(fork[b]):  # the tokens b copied from o
      aux_sum[o, t] += base[b] * mask[o, t]
      aux_count[o, t] += mask[o, t]
  adv = np.where(aux_count > 0, adv + aux_sum / np.maximum(aux_count, 1), adv)
  return adv * mask


@st.composite
def fork_groups(draw, g=6, length=5):
  """A group of G responses: 1-3 initial rollouts (rows 0..), the rest forked from an earlier
  row (an initial one or a branch) after copying 0..len(parent) of its tokens."""
  roots = draw(st.integers(1, 3))
  lengths = [draw(st.integers(1, length)) for _ in range(g)]
  tokens = np.array([[draw(st.integers(1, 4)) for _ in range(length)] for _ in range(g)])
  parent, fork = np.full(g, -1), np.zeros(g, int)
  for b in range(roots, g):
    parent[b] = draw(st.integers(0, b - 1))
    fork[b] = draw(st.integers(0, lengths[parent[b]]))
    lengths[b] = max(lengths[b], fork[b])
    tokens[b, :fork[b]] = tokens[parent[b], :fork[b]]
  mask = np.arange(length)[None] < np.array(lengths)[:, None]
  rewards = np.array([draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(g)], np.float32)
  return tokens.astype(np.int32), mask, rewards, parent.astype(np.int32), fork.astype(np.int32)


_APPO_FN = loop.credit_fn('appo', '{}', True)  # one compiled shape [1, 6, 5] for every example


@settings(max_examples=25, deadline=None)
@given(fork_groups())
def test_appo_matches_the_authors_algorithm(group):
  tokens, mask, rewards, parent, fork = group
  adv, keep = _APPO_FN(tokens[None], mask[None], rewards[None], parent[None], fork[None], None,
                       None)
  np.testing.assert_allclose(np.asarray(adv)[0], ref_appo(rewards, mask, parent, fork),
                             rtol=1e-5, atol=1e-5)
  # branches leave the loss; the initial rollouts keep all their tokens
  np.testing.assert_array_equal(np.asarray(keep)[0], mask & (parent < 0)[:, None])


def test_appo_without_forks_is_grpo_with_the_population_std():
  rng = np.random.default_rng(0)
  mask = np.arange(4)[None, None] < rng.integers(1, 5, (3, 5, 1))
  r = credit.Rollouts(tokens=np.ones((3, 5, 4), np.int32), mask=mask,
                      rewards=rng.integers(0, 2, (3, 5)).astype(np.float32))
  appo, grpo = credit.get('appo'), credit.get('grpo')
  np.testing.assert_allclose(appo(r, scale_by_std=False), grpo(r, scale_by_std=False), atol=1e-6)
  pop = np.std(r.rewards, -1, keepdims=True)
  want = np.where(pop > 0, (r.rewards - r.rewards.mean(-1, keepdims=True)) / (pop + 1e-6), 0.0)
  np.testing.assert_allclose(appo(r), np.where(mask, want[..., None], 0.0), atol=1e-5)
  np.testing.assert_array_equal(credit.loss_mask('appo', r, None), mask)


def test_appo_by_hand_and_refusals():
  # Two initial rollouts (1, 0) and two branches: b2 (reward 1) forked from row 0 after 2
  # tokens, b3 (reward 0) from row 1 after 3. Each subgroup is (1, 0): advantages +-1.
  mask = np.ones((1, 4, 5), bool)
  r = credit.Rollouts(tokens=np.ones((1, 4, 5), np.int32), mask=mask,
                      rewards=np.array([[1.0, 0.0, 1.0, 0.0]], np.float32),
                      parent=np.array([[-1, -1, 0, 1]]), fork=np.array([[0, 0, 2, 3]]))
  want = np.array([[2, 2, 1, 1, 1], [-2, -2, -2, -1, -1], [0] * 5, [0] * 5], np.float32)
  np.testing.assert_allclose(credit.get('appo')(r)[0], want, atol=1e-5)
  no_prefix = np.array([[1] * 5, [-1] * 5, [0] * 5, [0] * 5], np.float32)
  np.testing.assert_allclose(credit.get('appo')(r, prefix_credit=False)[0], no_prefix, atol=1e-5)
  with pytest.raises(ValueError, match='parent and Rollouts.fork come together'):
    credit.get('appo')(r.replace(fork=None))
