"""APPO's Branching Score (experiments/rollouts/branching.py) against a plain reference built
from full-vocabulary forwards, and the 'tree_branching' fork policy's layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.models import decoder
from experiments.rollouts import branching, sampling

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
