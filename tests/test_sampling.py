"""Tests for experiments/rollouts/sampling.py (tiny config, CPU, < 60 s)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from experiments.rollouts import sampling
from experiments.models import decoder

CFG = decoder.PolicyConfig(vocab_size=8, d_model=32, num_layers=2, num_heads=2, d_ff=48,
                          max_len=16)
B, P, G, L = 3, 5, 4, 10
EOS, PAD = 1, 7
KEY = jax.random.PRNGKey(42)
IDS = np.arange(B, dtype=np.int32)
PROMPTS = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, P)).astype(np.int32)
ATOL = 1e-5
ROWS = 40  # Teacher-forcing batches are padded to this many rows (one compile).


@pytest.fixture(scope='module')
def params():
  """Random params built in numpy (init_params itself is tested in test_policy)."""
  rng = np.random.default_rng(0)

  def leaf(path, x):
    names = [p.key for p in path]
    if names[-1] == 'scale':
      return jnp.ones(x.shape, jnp.float32)
    fan_in = x.shape[0] if names[-2] in ('q', 'k', 'v') else np.prod(x.shape[:-1])
    std = 1.0 if names[-1] == 'embedding' else fan_in ** -0.5
    std *= 0.3 if names[-2] == 'head' else 1.0  # Flatter next-token distributions.
    return jnp.asarray(rng.normal(size=x.shape) * std, jnp.float32)

  shapes = jax.eval_shape(functools.partial(decoder.init_params, cfg=CFG), jax.random.PRNGKey(0))
  return jax.tree_util.tree_map_with_path(leaf, shapes)


@pytest.fixture(scope='module')
def teacher(params):
  """(prompts [B,P], Samples, prompt_len) -> (logprobs, entropy, full logp) [B,G,L(,V)]."""

  @jax.jit
  def run(prompts, tokens, prompt_len):
    lp, ent = decoder.token_logprobs(params, CFG, prompts, tokens, prompt_len)
    idx = prompt_len[:, None] - 1 + jnp.arange(tokens.shape[1])
    seq = jnp.concatenate([prompts, tokens], 1)  # Only used for equal-length prompts.
    logits = decoder.forward(params, CFG, seq)
    logits = jnp.take_along_axis(logits, idx[..., None], 1)
    return lp, ent, jax.nn.log_softmax(logits)

  def fn(prompts, s, prompt_len=None):
    b, g, l = s.tokens.shape
    n = b * g
    assert n <= ROWS
    pl = np.full((b,), prompts.shape[1]) if prompt_len is None else np.asarray(prompt_len)
    rows = np.concatenate([np.repeat(np.arange(b), g), np.zeros(ROWS - n, int)])
    toks = np.concatenate([np.asarray(s.tokens).reshape(n, l), np.zeros((ROWS - n, l), int)])
    out = run(jnp.asarray(prompts[rows]), jnp.asarray(toks, jnp.int32),
              jnp.asarray(pl[rows], jnp.int32))
    return [np.asarray(x)[:n].reshape((b, g) + x.shape[1:]) for x in out]

  return fn


def _sample_iid(params, **kw):
  kw = {'eos_id': EOS, 'pad_id': PAD, 'prompt_ids': IDS, **kw}
  prompts = kw.pop('prompts', PROMPTS)
  return sampling.sample_iid(params, CFG, kw.pop('key', KEY), prompts, G, L, **kw)


@pytest.fixture(scope='module')
def iid(params):
  return _sample_iid(params)


@pytest.fixture(scope='module')
def fixed(params):
  return sampling.sample_tree_fixed(params, CFG, KEY, PROMPTS, (2, 2, 2), 3, L, eos_id=EOS,
                                    pad_id=PAD, prompt_ids=IDS)


@pytest.fixture(scope='module')
def entropy(params):
  # N = G chains (the i.i.d. fixture's program), F = 2 forks each, C = 1.
  return sampling.sample_tree_entropy(params, CFG, KEY, PROMPTS, G, 2, 1, L, eos_id=EOS,
                                      pad_id=PAD, prompt_ids=IDS)


def _np(s):
  return jax.tree.map(np.asarray, s)


def check_wellformed(s, g):
  s = _np(s)
  assert s.tokens.shape == s.logprobs.shape == s.entropy.shape == s.mask.shape == (B, g, L)
  assert s.parent.shape == s.fork.shape == (B, g)
  assert s.tokens.dtype == np.int32 and s.logprobs.dtype == np.float32
  assert s.mask.dtype == bool and s.parent.dtype == s.fork.dtype == np.int32
  m = s.mask
  assert m[..., 0].all() and (m[..., 1:] <= m[..., :-1]).all()  # Prefix run from 0.
  n = m.sum(-1)
  eos = s.tokens == EOS
  # EOS (if any) is the last masked token; short responses end with EOS.
  assert not (eos & m & (np.arange(L) < (n - 1)[..., None])).any()
  last = np.take_along_axis(s.tokens, (n - 1)[..., None], -1)[..., 0]
  assert ((n == L) | (last == EOS)).all()
  assert (s.tokens[~m] == PAD).all()
  assert (s.logprobs[~m] == 0).all() and (s.entropy[~m] == 0).all()
  assert (s.logprobs[m] <= 0).all() and (s.entropy[m] >= 0).all()


def check_tree(s):
  s = _np(s)
  g = s.tokens.shape[1]
  lengths = s.mask.sum(-1)
  for b in range(B):
    for i in range(g):
      p, f = s.parent[b, i], s.fork[b, i]
      assert -1 <= p < i
      if p < 0:
        assert f == 0
        continue
      assert 0 <= f <= lengths[b, p]
      np.testing.assert_array_equal(s.tokens[b, i, :f], s.tokens[b, p, :f])
      np.testing.assert_array_equal(s.logprobs[b, i, :f], s.logprobs[b, p, :f])
      assert s.mask[b, i, :f].all()


def assert_rows_equal(a, i, b, j):
  """Prompt row i of Samples a equals row j of b (floats up to compile noise)."""
  for name in ('tokens', 'mask', 'parent', 'fork'):
    np.testing.assert_array_equal(getattr(a, name)[i], getattr(b, name)[j])
  for name in ('logprobs', 'entropy'):
    np.testing.assert_allclose(getattr(a, name)[i], getattr(b, name)[j], atol=ATOL)


def check_teacher(teacher, s, prompts=PROMPTS, prompt_len=None):
  lp, ent, _ = teacher(prompts, s, prompt_len)
  m = np.asarray(s.mask)
  np.testing.assert_allclose(np.asarray(s.logprobs)[m], lp[m], atol=ATOL)
  np.testing.assert_allclose(np.asarray(s.entropy)[m], ent[m], atol=ATOL)


# ----------------------------------------------------------------------------
# Token selection.


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(0, 9), p=st.floats(0.01, 1.0),
       temp=st.sampled_from([0.5, 1.0, 2.0]))
def test_filter_logits_matches_numpy(seed, k, p, temp):
  logits = np.random.default_rng(seed).normal(size=(4, 8)).astype(np.float32) * 3
  z = logits / np.float32(temp)
  keep = np.ones_like(z, bool)
  if 0 < k < 8:
    keep &= z >= -np.sort(-z, -1)[:, k - 1:k]
  if p < 1:
    zk = np.where(keep, z, -np.inf)
    probs = np.exp(zk - zk.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, -1, kind='stable')
    sp = np.take_along_axis(probs, order, -1)
    before = np.cumsum(sp, -1) - sp
    assume(np.abs(before - p).min() > 1e-4)  # Avoid float ties at the boundary.
    keep_sorted = before < p
    nucleus = np.zeros_like(keep)
    np.put_along_axis(nucleus, order, keep_sorted, -1)
    keep &= nucleus
  out = np.asarray(sampling.filter_logits(jnp.asarray(logits), temp, k, p))
  np.testing.assert_array_equal(np.isfinite(out), keep)
  np.testing.assert_allclose(out[keep], z[keep], rtol=1e-6)
  assert keep[np.arange(4), z.argmax(-1)].all()


def _np_filtered_probs(logits, temp, top_k, top_p):
  """Plain-numpy (float64) reference of the filtered distribution [R, V] and, per row,
  the distance of the nearest mass-before to top_p (to skip float ties)."""
  z = logits.astype(np.float64) / temp
  r, v = z.shape
  out, margin = np.zeros_like(z), np.full(r, np.inf)
  for i in range(r):
    order = np.argsort(-z[i], kind='stable')
    keep = np.zeros(v, bool)
    n = top_k if 0 < top_k < v else v
    keep[order[:n]] = True
    keep &= z[i] >= z[i, order[n - 1]]  # ties at the top-k threshold are kept
    if top_p < 1:
      zk = np.where(keep, z[i], -np.inf)
      probs = np.exp(zk - zk.max())
      probs /= probs.sum()
      sp = probs[order]
      before = np.cumsum(sp) - sp
      margin[i] = np.abs(before[:n] - top_p).min()
      last = np.flatnonzero(before[:n] < top_p).max()
      keep &= z[i] >= z[i, order[last]]
    w = np.where(keep, np.exp(z[i] - z[i].max()), 0.0)
    out[i] = w / w.sum()
  return out, margin


_filter_small = jax.jit(functools.partial(sampling.filter_logits, max_candidates=8))
_cand_small = jax.jit(sampling._candidate_threshold, static_argnums=3)


@pytest.mark.parametrize('case', ['top_k', 'top_k_top_p', 'peaked_top_p', 'wide_top_p',
                                  'top_k_over_candidates', 'mixed_rows', 'off'])
def test_filter_logits_candidates_match_numpy(case):
  """lax.top_k candidates (C = 8 of V = 64) or the full-sort fallback: both equal a
  float64 numpy reference, and each case takes the path `filter_logits` documents."""
  rng = np.random.default_rng(11)
  peaked = rng.normal(size=(3, 64)) * 4.0
  flat = rng.normal(size=(3, 64)) * 0.3
  temp, top_k, top_p, logits, exact = {
      'top_k': (1.0, 5, 1.0, peaked, True),
      'top_k_top_p': (0.7, 8, 0.6, flat, True),
      'peaked_top_p': (1.0, 0, 0.5, peaked, True),       # nucleus within the candidates
      'wide_top_p': (1.0, 0, 0.9, flat, False),          # nucleus of ~50 tokens > C
      'top_k_over_candidates': (2.0, 20, 0.8, peaked, False),  # C < top_k < V
      'mixed_rows': (1.0, 0, 0.5, np.concatenate([peaked[:2], flat[:1]]), False),
      'off': (1.0, 0, 1.0, peaked, False),               # filter_logits called with no filter
  }[case]
  logits = logits.astype(np.float32)
  want, margin = _np_filtered_probs(logits, temp, top_k, top_p)
  assert margin.min() > 1e-4  # the reference is not at a float tie
  z = logits / np.float32(temp)
  k = top_k if 0 < top_k < 64 else 64
  _, row_exact = _cand_small(jnp.asarray(z), k, top_p, 8)
  assert bool(np.all(row_exact)) == exact
  got = np.asarray(_filter_small(jnp.asarray(logits), temp, top_k, top_p))
  np.testing.assert_array_equal(np.isfinite(got), want > 0)
  p = np.exp(got - got.max(-1, keepdims=True))
  np.testing.assert_allclose(p / p.sum(-1, keepdims=True), want, rtol=1e-5, atol=1e-7)
  # The same as candidates covering the whole vocabulary (a full sort everywhere).
  full = np.asarray(sampling.filter_logits(jnp.asarray(logits), temp, top_k, top_p,
                                           max_candidates=64))
  np.testing.assert_array_equal(got, full)


def test_select_tokens_greedy_equivalents():
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(64, 8)) * 2, jnp.float32)
  u = jax.random.uniform(jax.random.PRNGKey(3), (64,))
  greedy = np.asarray(logits).argmax(-1)
  select = jax.jit(sampling.select_tokens)  # Traced settings: compiles once.
  sel = lambda temperature=1.0, top_k=0, top_p=1.0: np.asarray(
      select(u, logits, temperature, top_k, top_p))
  np.testing.assert_array_equal(sel(temperature=0.0), greedy)
  np.testing.assert_array_equal(sel(temperature=0.0, top_k=3, top_p=0.5), greedy)
  np.testing.assert_array_equal(sel(top_k=1), greedy)
  np.testing.assert_array_equal(sel(temperature=3.0, top_k=1), greedy)
  np.testing.assert_array_equal(sel(top_p=1e-6), greedy)
  top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
  for t in (sel(top_k=3), sel(top_k=3, temperature=5.0)):
    assert (top3 == t[:, None]).any(-1).all()
  assert (sel() != greedy).any()  # Plain sampling does not always pick the argmax.


def test_select_tokens_inverse_cdf_matches_distribution():
  logits = np.array([[0.3, -1.0, 2.0, 0.0, -0.5, 1.0, -2.0, 0.5]], np.float32)
  n = 20000
  u = (np.arange(n) + 0.5) / n  # A uniform grid: counts are n * p up to rounding.
  select = jax.jit(jax.vmap(sampling.select_tokens, in_axes=(0, None, None, None, None)))
  for temp, top_k, top_p in ((1.0, 0, 1.0), (0.5, 4, 1.0), (2.0, 0, 0.8)):
    tokens = np.asarray(select(jnp.asarray(u[:, None], jnp.float32), jnp.asarray(logits),
                               temp, top_k, top_p))[:, 0]
    z = np.asarray(sampling.filter_logits(jnp.asarray(logits), temp, top_k, top_p))[0]
    p = np.exp(z - z.max())
    p /= p.sum()
    np.testing.assert_allclose(np.bincount(tokens, minlength=8) / n, p, atol=2 / n)


# ----------------------------------------------------------------------------
# I.i.d. sampling.


def test_iid_wellformed(iid):
  check_wellformed(iid, G)
  assert (np.asarray(iid.parent) == -1).all() and (np.asarray(iid.fork) == 0).all()
  n = np.asarray(iid.lengths)
  assert (n < L).any() and (n == L).any()  # Both EOS-terminated and truncated rows.
  assert len({tuple(t) for t in np.asarray(iid.tokens).reshape(-1, L)}) > B * G // 2


def test_iid_logprobs_match_teacher_forcing(iid, teacher):
  check_teacher(teacher, iid)


def test_iid_logprobs_are_untempered_and_topk_respected(params, teacher):
  s = _sample_iid(params, temperature=0.7, top_k=3, top_p=0.9)
  check_wellformed(s, G)
  check_teacher(teacher, s)
  _, _, logp = teacher(PROMPTS, s)
  rank = (logp > np.take_along_axis(logp, np.asarray(s.tokens)[..., None], -1)).sum(-1)
  assert (rank[np.asarray(s.mask)] < 3).all()


def test_greedy_is_deterministic_and_matches_argmax(params, teacher):
  a = _sample_iid(params, temperature=0.0)
  b = _sample_iid(params, temperature=0.0, key=jax.random.PRNGKey(7))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  check_wellformed(a, G)
  _, _, logp = teacher(PROMPTS, a)
  m = np.asarray(a.mask)
  np.testing.assert_array_equal(np.asarray(a.tokens)[m], logp.argmax(-1)[m])
  np.testing.assert_array_equal(np.asarray(a.tokens)[:, 1:], np.asarray(a.tokens)[:, :-1])
  for kw in (dict(top_k=1), dict(top_p=1e-6, temperature=0.5)):
    np.testing.assert_array_equal(_sample_iid(params, **kw).tokens, a.tokens)


def test_iid_independent_of_batch_layout(params, iid):
  perm = np.array([2, 0, 1])
  s = _sample_iid(params, prompts=PROMPTS[perm], prompt_ids=IDS[perm])
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, np.asarray(y)[perm]), s, iid)
  other = _sample_iid(params, key=jax.random.PRNGKey(1))
  assert not np.array_equal(other.tokens, iid.tokens)


def test_right_padded_prompts_and_batch_size_change(params, iid, teacher):
  lens = np.array([3, 5, 4], np.int32)
  padded = np.where(np.arange(P) < lens[:, None], PROMPTS, PAD).astype(np.int32)
  s = _sample_iid(params, prompts=padded, prompt_len=lens)
  check_wellformed(s, G)
  assert_rows_equal(s, 1, iid, 1)  # Full-length row is unaffected by the padding.
  lp, ent, _ = teacher(padded, s, lens)
  m = np.asarray(s.mask)
  np.testing.assert_allclose(np.asarray(s.logprobs)[m], lp[m], atol=ATOL)
  # Same prompt unpadded, alone in a batch of 1 (B and P change), with 3 * G
  # responses (same decode shape as above): its first G responses are the same.
  solo = sampling.sample_iid(params, CFG, KEY, PROMPTS[:1, :3], 3 * G, L, eos_id=EOS,
                             pad_id=PAD, prompt_ids=IDS[:1])
  assert_rows_equal(jax.tree.map(lambda x: x[:, :G], solo), 0, s, 0)


def test_prefill_once_and_no_prefix_recompute(params, monkeypatch):
  calls = []
  apply = decoder.apply

  def spy(p, cfg, tokens, positions, *rest):
    calls.append(tokens.shape)
    return apply(p, cfg, tokens, positions, *rest)

  monkeypatch.setattr(decoder, 'apply', spy)
  kw = dict(eos_id=EOS, pad_id=PAD)
  prompts = jnp.zeros((B, P), jnp.int32)
  samplers = (
      lambda cfg: sampling.sample_iid(params, cfg, KEY, prompts, 5, 3, **kw),
      lambda cfg: sampling.sample_tree_fixed(params, cfg, KEY, prompts, (2, 3), 1, 3, **kw),
      lambda cfg: sampling.sample_tree_entropy(params, cfg, KEY, prompts, 2, 1, 2, 3, **kw))
  for i, fn in enumerate(samplers):
    calls.clear()
    # A fresh (static) config forces fresh traces; eval_shape compiles nothing.
    jax.eval_shape(lambda: fn(dataclasses.replace(CFG, rope_base=1e3 + i)))
    assert calls[0] == (B, P)  # One prefill of B rows, not B * G.
    assert all(t == 1 for _, t in calls[1:]), calls  # Everything else: 1-token steps.


# ----------------------------------------------------------------------------
# Fixed-branching trees.


def test_fixed_tree_layout():
  parent, fork, level_ids = sampling.fixed_tree((4, 2, 2), 5)
  assert len(parent) == 16
  np.testing.assert_array_equal(parent[:8], [-1, 0, 0, 2, -1, 4, 4, 6])
  np.testing.assert_array_equal(fork[:8], [0, 10, 5, 10, 0, 10, 5, 10])
  assert set(np.flatnonzero(parent < 0)) == {0, 4, 8, 12}
  np.testing.assert_array_equal(level_ids[0], [0, 4, 8, 12])
  np.testing.assert_array_equal(level_ids[1], np.arange(0, 16, 2))
  np.testing.assert_array_equal(level_ids[2], np.arange(16))


def test_fixed_tree_samples(fixed, iid, teacher):
  check_wellformed(fixed, 8)
  check_tree(fixed)
  check_teacher(teacher, fixed)  # Validates the copied KV caches.
  parent, fork, _ = sampling.fixed_tree((2, 2, 2), 3)
  s = _np(fixed)
  np.testing.assert_array_equal(s.parent, np.broadcast_to(parent, (B, 8)))
  plen = np.take_along_axis(s.mask.sum(-1), np.maximum(s.parent, 0), 1)
  np.testing.assert_array_equal(s.fork, np.where(parent >= 0, np.minimum(fork, plen), 0))
  # Leaf 0 never forks and uses response id 0: it equals i.i.d. response 0.
  np.testing.assert_array_equal(s.tokens[:, 0], np.asarray(iid.tokens)[:, 0])
  # Siblings re-sample after the fork (not all copies of their parent).
  kids = s.parent >= 0
  differ = (s.tokens != np.take_along_axis(s.tokens, np.maximum(s.parent, 0)[..., None], 1))
  assert differ.any(-1)[kids].mean() > 0.3


def test_fixed_tree_independent_of_batch_layout(params, fixed):
  perm = np.array([1, 2, 0])
  s = sampling.sample_tree_fixed(params, CFG, KEY, PROMPTS[perm], (2, 2, 2), 3, L,
                                 eos_id=EOS, pad_id=PAD, prompt_ids=IDS[perm])
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, np.asarray(y)[perm]), s, fixed)


def test_fixed_tree_rejects_bad_shapes(params):
  with pytest.raises(ValueError):  # Last level would start at L.
    sampling.sample_tree_fixed(params, CFG, KEY, PROMPTS, (2, 2, 2), 5, L)
  with pytest.raises(ValueError):  # P + L > max_len.
    sampling.sample_iid(params, CFG, KEY, PROMPTS, 2, 12)


# ----------------------------------------------------------------------------
# Entropy-guided forks.


def test_entropy_forks_policy():
  ent = np.array([[[0.1, 0.9, 0.5, 0.9, 0.3, 2.0],    # length 5: 2.0 is masked out
                   [0.7, 0.2, 0.1, 0.1, 0.1, 0.1]]],  # length 1
                 np.float32)
  mask = np.arange(6) < np.array([[5, 1]])[..., None]
  lp = -np.flip(ent, -1).copy()
  s = sampling.Samples(tokens=jnp.zeros((1, 2, 6), jnp.int32), logprobs=jnp.asarray(lp),
                       entropy=jnp.asarray(ent), mask=jnp.asarray(mask),
                       parent=jnp.full((1, 2), -1), fork=jnp.zeros((1, 2), jnp.int32))
  src, pos = jax.jit(sampling.EntropyForks(num_forks=3, num_continuations=2))(s)
  np.testing.assert_array_equal(src, [[0] * 6 + [1] * 6])
  # Chain 0: top-3 of [.1,.9,.5,.9,.3] -> 1, 3 (tie: earlier first), 2. Chain 1: only 0.
  np.testing.assert_array_equal(pos, [[1, 1, 3, 3, 2, 2, 0, 0, 0, 0, 0, 0]])
  _, pos = jax.jit(sampling.EntropyForks(2, 1, score='nll'))(s)  # nll = flipped entropy.
  np.testing.assert_array_equal(pos, [[0, 2, 0, 0]])  # nll 2.0 then .9 (tie: earlier).


def test_cutpoint_forks_policy():
  p = np.array([[[0.95, 0.5, 0.99, 0.3, 0.8, 0.1],    # length 5: p < 0.9 at 1, 3, 4
                 [0.99, 0.95, 0.2, 0.2, 0.2, 0.2]]],  # length 2: no cutpoint
               np.float32)
  mask = np.arange(6) < np.array([[5, 2]])[..., None]
  s = sampling.Samples(tokens=jnp.zeros((1, 2, 6), jnp.int32), logprobs=jnp.log(p),
                       entropy=jnp.zeros((1, 2, 6)), mask=jnp.asarray(mask),
                       parent=jnp.full((1, 2), -1), fork=jnp.zeros((1, 2), jnp.int32))
  src, pos = jax.jit(sampling.CutpointForks(num_forks=2, num_continuations=2))(s)
  np.testing.assert_array_equal(src, [[0] * 4 + [1] * 4])
  # Chain 0: the first two cutpoints; chain 1: none, so its least likely token (t = 1).
  np.testing.assert_array_equal(pos, [[1, 1, 3, 3, 1, 1, 1, 1]])
  _, pos = jax.jit(sampling.CutpointForks(2, 1, every=2))(s)  # every 2nd cutpoint: 1, 4
  np.testing.assert_array_equal(pos, [[1, 4, 1, 1]])


def test_entropy_tree_samples(entropy, iid, teacher):
  n, f, c = G, 2, 1
  g = n * (1 + f * c)
  check_wellformed(entropy, g)
  check_tree(entropy)
  check_teacher(teacher, entropy)  # Validates the copied KV caches.
  s = _np(entropy)
  for name in ('tokens', 'logprobs', 'entropy', 'mask'):  # Chains are i.i.d. responses 0..N-1.
    np.testing.assert_array_equal(getattr(s, name)[:, :n], np.asarray(getattr(iid, name))[:, :n])
  np.testing.assert_array_equal(s.parent, np.broadcast_to(
      np.concatenate([[-1] * n, np.repeat(np.arange(n), f * c)]), (B, g)))
  lengths = s.mask.sum(-1)
  for b in range(B):
    for k in range(n):
      kids = slice(n + k * f * c, n + (k + 1) * f * c)
      forks = s.fork[b, kids]
      assert (forks < lengths[b, k]).all()  # Valid: re-samples a generated token.
      score = np.where(s.mask[b, k], s.entropy[b, k], -np.inf)
      top = np.argsort(-score, kind='stable')[:f]
      top = np.where(s.mask[b, k, top], top, top[0])
      np.testing.assert_array_equal(forks, np.repeat(top, c))
  assert (s.fork[:, n:] > 0).any()


def test_entropy_tree_independent_of_batch_layout(params, entropy):
  perm = np.array([2, 0, 1])
  s = sampling.sample_tree_entropy(params, CFG, KEY, PROMPTS[perm], G, 2, 1, L, eos_id=EOS,
                                   pad_id=PAD, prompt_ids=IDS[perm])
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, np.asarray(y)[perm]), s, entropy)


@dataclasses.dataclass(frozen=True)
class _EdgeForks:
  """Forks chain c at 0 (re-samples everything) and past its end, for c < 4."""

  def __call__(self, chains):
    b = chains.tokens.shape[0]
    src = jnp.broadcast_to(jnp.repeat(jnp.arange(4, dtype=jnp.int32), 2), (b, 8))
    pos = jnp.broadcast_to(jnp.array([0, 99] * 4, jnp.int32), (b, 8))
    return src, pos


def test_custom_fork_policy_edges(params, iid, teacher):
  s = sampling.sample_tree_forks(params, CFG, KEY, PROMPTS, G, L, _EdgeForks(), eos_id=EOS,
                                 pad_id=PAD, prompt_ids=IDS)
  check_wellformed(s, 12)
  check_tree(s)
  check_teacher(teacher, s)
  s = _np(s)
  lengths = s.mask.sum(-1)
  np.testing.assert_array_equal(s.fork[:, G::2], 0)
  np.testing.assert_array_equal(s.fork[:, G + 1::2], lengths[:, :G] - 1)  # Clipped.
  # Forks at 0 re-sample everything from the prompt (re-feeding its last token;
  # logprobs checked above) with their own uniforms, so they differ from chains.
  assert (s.tokens[:, G::2] != s.tokens[:, :G]).any()
