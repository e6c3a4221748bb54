"""Tests for experiments/models/decoder.py (tiny configs, CPU, < 60 s)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.models import decoder

CFG = decoder.PolicyConfig(vocab_size=11, d_model=32, num_layers=2, num_heads=2, d_ff=48,
                          max_len=16)
ATOL = 1e-5


@pytest.fixture(scope='module')
def params():
  return jax.jit(decoder.init_params, static_argnums=1)(jax.random.PRNGKey(0), CFG)


@pytest.fixture(scope='module')
def fwd():
  return jax.jit(lambda p, t: decoder.forward(p, CFG, t))


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _tokens(seed, shape, vocab=CFG.vocab_size):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def test_default_param_count():
  cfg = decoder.PolicyConfig(vocab_size=14)
  shapes = jax.eval_shape(functools.partial(decoder.init_params, cfg=cfg), jax.random.PRNGKey(0))
  assert decoder.num_params(shapes) == 393_344  # ~0.39M.
  assert shapes['head']['kernel'].shape == (128, 14)  # Untied head.
  assert shapes['embed']['embedding'].shape == (14, 128)


def test_config_is_hashable_and_validated():
  a, b = decoder.PolicyConfig(vocab_size=14), decoder.PolicyConfig(vocab_size=14)
  assert a == b and hash(a) == hash(b)
  assert a.head_dim == 32 and a.dtype == jnp.float32
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.d_model = 3
  with pytest.raises(ValueError):
    decoder.PolicyConfig(vocab_size=14, d_model=30, num_heads=4)


def test_cache_shape():
  cache = decoder.init_cache(CFG, 3)
  assert cache.k.shape == cache.v.shape == (2, 3, 16, 2, 16)


def test_cached_decode_matches_full_forward(params, fwd):
  tokens = _tokens(1, (3, 12))
  full = fwd(params, tokens)
  p = 5
  logits, cache = jax.jit(lambda pa, t: decoder.prefill(pa, CFG, t))(params, tokens[:, :p])
  np.testing.assert_allclose(logits, full[:, :p], atol=ATOL)
  step = jax.jit(lambda pa, c, t, pos: decoder.decode_step(pa, CFG, c, t, pos))
  for t in range(p, 12):
    logits, cache = step(params, cache, tokens[:, t], np.full((3,), t, np.int32))
    np.testing.assert_allclose(logits, full[:, t], atol=ATOL)


def test_decode_at_per_row_positions_with_right_padding(params, fwd):
  # Rows have prompt lengths 2, 5, 4, right-padded to 5 with arbitrary tokens.
  lens = np.array([2, 5, 4])
  seqs = _tokens(2, (3, 12))
  prompts = np.where(np.arange(5)[None] < lens[:, None], seqs[:, :5], 7)
  _, cache = jax.jit(lambda pa, t: decoder.prefill(pa, CFG, t))(params, jnp.asarray(prompts))
  step = jax.jit(lambda pa, c, t, pos: decoder.decode_step(pa, CFG, c, t, pos))
  full = np.asarray(fwd(params, jnp.asarray(seqs)))
  for i in range(6):  # Feed the last prompt token, then the continuation.
    pos = lens - 1 + i
    logits, cache = step(params, cache, jnp.asarray(seqs[np.arange(3), pos]), jnp.asarray(pos))
    np.testing.assert_allclose(logits, full[np.arange(3), pos], atol=ATOL)


def test_causal_and_rope_relative(params, fwd):
  tokens = _tokens(3, (3, 12))
  base = fwd(params, tokens)
  tokens2 = tokens.copy()
  tokens2[:, 6] = (tokens[:, 6] + 1) % CFG.vocab_size
  changed = fwd(params, tokens2)
  np.testing.assert_allclose(changed[:, :6], base[:, :6], atol=ATOL)
  assert not np.allclose(changed[:, 6:], base[:, 6:], atol=1e-3)
  # RoPE only sees relative positions: shifting all positions is a no-op.
  pos = np.broadcast_to(np.arange(12, dtype=np.int32) + 7, tokens.shape)
  shifted, _ = jax.jit(lambda pa, t, q: decoder.apply(pa, CFG, t, q))(params, tokens, pos)
  np.testing.assert_allclose(shifted, base, atol=1e-4)


def test_token_logprobs_matches_forward(params, fwd):
  prompts, responses = _tokens(4, (3, 5)), _tokens(5, (3, 7))
  lp, ent = jax.jit(lambda pa, a, b: decoder.token_logprobs(pa, CFG, a, b))(
      params, prompts, responses)
  assert lp.shape == ent.shape == (3, 7)
  logits = np.asarray(fwd(params, np.concatenate([prompts, responses], 1)))[:, 4:11]
  logp = _log_softmax(logits)
  np.testing.assert_allclose(
      lp, np.take_along_axis(logp, responses[..., None], -1)[..., 0], atol=ATOL)
  np.testing.assert_allclose(ent, -(np.exp(logp) * logp).sum(-1), atol=ATOL)
  assert np.all(ent > 0) and np.all(ent <= np.log(CFG.vocab_size) + 1e-5)


def test_token_logprobs_with_prompt_len(params, fwd):
  lens = np.array([2, 5, 1])
  prompts = _tokens(6, (3, 5))
  responses = _tokens(7, (3, 7))
  padded = np.where(np.arange(5)[None] < lens[:, None], prompts, 9)
  lp, ent = jax.jit(lambda pa, a, b, n: decoder.token_logprobs(pa, CFG, a, b, n))(
      params, jnp.asarray(padded), jnp.asarray(responses), jnp.asarray(lens))
  # Reference: each row packed as prompt[:len] + response, zero-filled to 12.
  packed = np.zeros((3, 12), np.int32)
  for b in range(3):
    packed[b, :lens[b] + 7] = np.concatenate([prompts[b, :lens[b]], responses[b]])
  logp = _log_softmax(np.asarray(fwd(params, jnp.asarray(packed))))
  idx = lens[:, None] - 1 + np.arange(7)[None]
  logp = np.take_along_axis(np.asarray(logp), idx[..., None], 1)
  np.testing.assert_allclose(lp, np.take_along_axis(logp, responses[..., None], -1)[..., 0],
                             atol=ATOL)
  np.testing.assert_allclose(ent, -(np.exp(logp) * logp).sum(-1), atol=ATOL)


def test_token_logprobs_is_differentiable(params):
  prompts, responses = _tokens(8, (2, 3)), _tokens(9, (2, 4))

  def loss(pa):
    lp, ent = decoder.token_logprobs(pa, CFG, prompts, responses)
    return lp.sum() + 0.1 * ent.sum()

  grads = jax.jit(jax.grad(loss))(params)
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert all(np.any(g != 0) for g in leaves)


@pytest.fixture(scope='module')
def dense_reference(params, fwd):
  """Dense attention's logits, prompt-length gradients and prefill, computed once for every
  chunk size of test_chunked_causal_attention_equals_dense."""
  tokens = _tokens(10, (3, 12))
  return (fwd(params, tokens), _chunk_test_grads(params, CFG),
          _jit_prefill(params, CFG, tokens[:, :7], decoder.init_cache(CFG, 6)))


_jit_forward = jax.jit(decoder.forward, static_argnums=1)
_jit_prefill = jax.jit(decoder.prefill, static_argnums=1)


def _chunk_test_grads(params, cfg):
  lens = jnp.asarray([2, 5, 1])
  prompts, responses = jnp.asarray(_tokens(11, (3, 5))), jnp.asarray(_tokens(12, (3, 7)))
  loss = lambda pa: decoder.token_logprobs(pa, cfg, prompts, responses, lens)[0].sum()
  return jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize('chunk', [3, 5])
def test_chunked_causal_attention_equals_dense(params, dense_reference, chunk):
  """`attn_chunk` (queries in chunks, keys up to each chunk's end) is the dense causal
  attention: logits, right-padded teacher forcing and gradients, at chunk sizes that do and
  do not divide T = 12. (Jitted: eagerly each op compiles on its own; the dense side is
  computed once, in `dense_reference`.)"""
  cfg = dataclasses.replace(CFG, attn_chunk=chunk)
  tokens = _tokens(10, (3, 12))
  dense_logits, g_dense, (ref, ref_cache) = dense_reference
  np.testing.assert_allclose(_jit_forward(params, cfg, tokens), dense_logits, atol=ATOL)
  g_chunk = _chunk_test_grads(params, cfg)
  for a, b in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_dense)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  # prefill into a cache of repeated rows attends within the call (chunked too)
  logits, cache = _jit_prefill(params, cfg, tokens[:, :7], decoder.init_cache(cfg, 6))
  np.testing.assert_allclose(logits, ref, atol=ATOL)
  np.testing.assert_allclose(cache.k, ref_cache.k, atol=ATOL)


def test_attn_chunk_is_validated():
  for bad in (-1, 2.0):
    with pytest.raises(ValueError, match='attn_chunk'):
      decoder.PolicyConfig(vocab_size=14, attn_chunk=bad)
