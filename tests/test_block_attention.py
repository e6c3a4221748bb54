"""Block-sparse packed attention ('blocks'): exact against flat rows and 'paths'."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.models import decoder
from trees import packing
from test_packing import groups as packing_groups  # noqa: E402 (tests/ is on sys.path)

CFG = decoder.PolicyConfig(vocab_size=12, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                          max_len=24, num_kv_heads=2)
B, G, L, P = 3, 4, 6, 5
T = P + G * L  # one pack length for every example: shared shapes, few compiles


def groups(seed, vocab=3, g=G, l=L):
  """Random trees (`test_packing.groups`: responses copy random prefixes of earlier ones;
  ragged responses and prompts) of B groups with P-token prompts."""
  return packing_groups(seed, b=B, g=g, l=l, p=P, vocab=vocab)


def full_pairs(block):
  nb = -(-T // block)
  return nb * (nb + 1) // 2


def objective(lp, ent, mask):
  """A scalar that weighs every token's log-prob and entropy differently."""
  w = jnp.linspace(-1.0, 2.0, lp.size).reshape(lp.shape)
  return jnp.sum(jnp.where(mask, w * lp + 0.3 * w[::-1] * ent, 0.0))


@jax.jit
def flat_value_grad(params, prompts, tok, mask, plen):
  def f(params):
    lp, ent = decoder.token_logprobs(params, CFG, jnp.repeat(prompts, G, 0),
                                     tok.reshape(B * G, L), jnp.repeat(plen, G))
    lp, ent = lp.reshape(B, G, L), ent.reshape(B, G, L)
    return objective(lp, ent, mask), (lp, ent)
  return jax.value_and_grad(f, has_aux=True)(params)


@jax.jit
def packed_value_grad(params, pk, tok, mask):
  def f(params):
    lp, ent = decoder.packed_token_logprobs(params, CFG, pk, tok)
    return objective(lp, ent, mask), (lp, ent)
  return jax.value_and_grad(f, has_aux=True)(params)


PARAMS = decoder.init_params(jax.random.PRNGKey(0), CFG)


def assert_close(got, want, mask, grad_tol=2e-5):
  (v_g, (lp_g, ent_g)), gr_g = got
  (v_w, (lp_w, ent_w)), gr_w = want
  m = np.asarray(mask)
  np.testing.assert_allclose(np.where(m, lp_g, 0), np.where(m, lp_w, 0), atol=1e-5)
  np.testing.assert_allclose(np.where(m, ent_g, 0), np.where(m, ent_w, 0), atol=1e-5)
  np.testing.assert_allclose(v_g, v_w, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(gr_g), jax.tree.leaves(gr_w)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=grad_tol)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(packing.MODES),
                  block=st.sampled_from([3, 8]))  # 3: T = 29 padded to 30
def test_logprobs_and_grads_equal_flat_and_paths(seed, mode, block):
  prompts, tok, mask, plen = groups(seed)
  args = (jnp.asarray(tok), jnp.asarray(mask))
  flat = flat_value_grad(PARAMS, jnp.asarray(prompts), *args, jnp.asarray(plen))
  paths = packed_value_grad(PARAMS, packing.pack(prompts, tok, mask, plen, pack_len=T,
                                                 mode=mode), *args)
  pk = packing.pack(prompts, tok, mask, plen, pack_len=T, mode=mode, attention='blocks',
                    block=block, num_pairs=full_pairs(block))
  blocks = packed_value_grad(PARAMS, pk, *args)
  assert_close(blocks, flat, mask)
  assert_close(blocks, paths, mask)


def test_tight_pair_list_equals_flat_and_is_sparse():
  """The automatic pair count (here exact: not one spare entry), far below the triangle."""
  prompts, tok, mask, plen = groups(1)
  pk = packing.pack(prompts, tok, mask, plen, pack_len=T, attention='blocks', block=4)
  need = np.asarray(packing.block_pair_count(pk))
  assert pk.num_pairs == need.max() < 0.6 * full_pairs(4)
  assert need.min() < need.max()  # other groups leave unused entries
  args = (jnp.asarray(tok), jnp.asarray(mask))
  flat = flat_value_grad(PARAMS, jnp.asarray(prompts), *args, jnp.asarray(plen))
  assert_close(packed_value_grad(PARAMS, pk, *args), flat, mask)


@pytest.mark.parametrize('block,g,l', [(1, G, L), (3, G, L), (8, G, L), (4, 70, 3)])
def test_block_masks_cover_exactly_the_ancestors(block, g, l):
  """The union of the pair masks is `ancestor_mask` on slots on some path; at block 1
  the pair count is the number of (slot, ancestor-or-self) pairs. G = 70: 3 bitset words."""
  prompts, tok, mask, plen = groups(11, vocab=2, g=g, l=l)
  t = P + g * l
  pk = packing.pack(prompts, tok, mask, plen, pack_len=t, attention='blocks', block=block)
  anc = np.asarray(packing.ancestor_mask(pk))
  qb, kb, count = (np.asarray(x) for x in packing.block_pairs(pk))
  bm = np.asarray(packing.block_mask(pk, jnp.asarray(qb), jnp.asarray(kb)))
  nb = pk.num_blocks
  dense = np.zeros((B, nb * block, nb * block), bool)
  for b in range(B):
    for m in range(pk.num_pairs):
      if qb[b, m] < nb:
        q0, k0 = qb[b, m] * block, kb[b, m] * block
        dense[b, q0:q0 + block, k0:k0 + block] |= bm[b, m]
    assert np.all(qb[b, count[b]:] == nb)  # unused entries point at the dropped segment
    used = np.stack([qb[b, :count[b]], kb[b, :count[b]]], -1)
    assert np.all(used[:, 1] <= used[:, 0])  # ancestors sit in lower blocks
    assert [tuple(x) for x in used] == sorted(set(map(tuple, used)))  # sorted, distinct
  valid = np.asarray(packing._valid_slots(pk))
  np.testing.assert_array_equal(dense[:, :t, :t][valid], anc[valid])
  if block == 1:
    np.testing.assert_array_equal(count, anc.sum(axis=(1, 2)))


def test_pair_overflow_is_an_error_or_nan():
  prompts, tok, mask, plen = groups(5)
  pk = packing.pack(prompts, tok, mask, plen, pack_len=T, attention='blocks', block=2)
  need = int(np.max(np.asarray(packing.block_pair_count(pk))))
  with pytest.raises(ValueError, match=f'needs {need} attention block pairs'):
    packing.pack(prompts, tok, mask, plen, pack_len=T, attention='blocks', block=2,
                 num_pairs=need - 1)
  small = pk.replace(num_pairs=need - 1)  # as a traced pack with a wrong bound would be
  lp, _ = jax.jit(decoder.packed_token_logprobs, static_argnums=1)(PARAMS, CFG, small, tok)
  over = np.asarray(packing.block_pair_count(pk)) > need - 1
  assert over.any() and np.isnan(np.asarray(lp)[over]).all()
  assert np.isfinite(np.asarray(lp)[~over]).all()


def test_bad_arguments():
  prompts, tok, mask, plen = groups(2)
  with pytest.raises(ValueError, match='block / num_pairs are for attention "blocks" or'):
    packing.pack(prompts, tok, mask, plen, pack_len=T, block=4)
  with pytest.raises(ValueError, match='num_pairs needs an explicit block'):
    packing.pack(prompts, tok, mask, plen, pack_len=T, attention='blocks', num_pairs=9)
  for bad in (-1, 2.0, True):
    with pytest.raises(ValueError, match='must be a \\(static\\) int >= 0'):
      packing.pack(prompts, tok, mask, plen, pack_len=T, attention='blocks', block=bad)
  with pytest.raises(ValueError, match='exceeds the 1 lower-triangular'):
    packing.pack(prompts, tok, mask, plen, pack_len=T, attention='blocks', block=T, num_pairs=2)
  with pytest.raises(ValueError, match='block attention needs a packing'):
    packing.block_pair_count(packing.pack(prompts, tok, mask, plen, pack_len=T))
  with pytest.raises(ValueError, match='at least one block pair'):
    packing.pair_bucket(0, 4)


def test_pair_bucket_and_default_block():
  counts = range(1, 5000)
  buckets = [packing.pair_bucket(c, 200) for c in counts]
  assert all(c <= k <= 1.125 * c for c, k in zip(counts, buckets))
  assert len({k for k in buckets if 1024 <= k < 2048}) == 8  # 8 lengths per doubling
  assert packing.pair_bucket(20, 5) == 15  # never past the triangle
  assert [packing.default_block(t, 'cpu') for t in (8, 160, 256, 257, 9000)] == [16, 32, 32,
                                                                                  64, 64]
  assert {packing.default_block(t, 'tpu') for t in (8, 9000)} == {128}


# The train step with 'blocks' under micro-batches (they slice the packing by group; the
# static pair bound carries over): test_packing.test_train_step_equals_flat_with_microbatches
# [blocks], on that module's one flat step.


@pytest.mark.parametrize('p,g,l,block,extra', [(5, 4, 6, 2, 0), (3, 3, 7, 4, 5), (8, 2, 3, 4, 0),
                                               (1, 5, 4, 16, 3)])
def test_iid_block_pairs_match_a_packed_iid_group(p, g, l, block, extra):
  """The analytic count (aot.stage_flops) equals `block_pair_count` of such a pack."""
  tok = np.arange(g)[None, :, None] * np.ones((1, 1, l), np.int32)  # distinct first tokens
  tok = tok.astype(np.int32)
  mask = np.ones(tok.shape, bool)
  prompts = np.zeros((1, p), np.int32)
  t = p + g * l + extra
  pk = packing.pack(prompts, tok, mask, pack_len=t, attention='blocks', block=block)
  assert int(packing.block_pair_count(pk)[0]) == packing.iid_block_pairs(p, g, l, block, t)


def test_auto_picks_blocks_on_shared_long_prefixes_and_paths_on_tiny_rows():
  rng = np.random.default_rng(0)
  tok = np.repeat(rng.integers(0, 5, (1, 1, 64)), 8, axis=1).astype(np.int32)
  tok[:, :, 60] = np.arange(8)  # 8 responses share 60 tokens, then fork
  mask = np.ones(tok.shape, bool)
  prompts = np.zeros((1, 2), np.int32)
  t = packing.required_len(prompts, tok, mask)
  pk = packing.pack(prompts, tok, mask, pack_len=t, attention='auto', backend='cpu')
  assert pk.attention == 'blocks' and pk.block in packing.BLOCK_COSTS['cpu'].blocks
  assert pk.num_pairs * pk.block ** 2 < 8 * 66 ** 2 / 4  # a quarter of the paths' scores
  prompts_s, tok_s, mask_s, plen_s = groups(0)
  tiny = packing.pack(prompts_s, tok_s, mask_s, plen_s, pack_len=T, attention='auto',
                      backend='tpu')
  assert tiny.attention == 'paths' and tiny.block == 0
  traced = jax.jit(lambda tk: packing.pack(prompts, tk, mask, pack_len=t, attention='auto'))
  assert jax.eval_shape(traced, tok).attention == 'paths'  # counts unknown: no pair bound
  traced = jax.jit(lambda tk: packing.pack(prompts, tk, mask, pack_len=t, attention='blocks',
                                           backend='cpu'))
  pk = jax.eval_shape(traced, tok)  # every lower-triangular pair: always enough
  nb = -(-t // packing.default_block(t, 'cpu'))
  assert pk.block == packing.default_block(t, 'cpu') and pk.num_pairs == nb * (nb + 1) // 2


def test_compile_check_flops_for_long_responses():
  """aot's analytic teacher-forcing FLOPs with 'blocks' (TPU blocks of 128): attention
  about the causal half of 'paths', and the packed forward keeps >= 0.9 of the saving
  in dense-layer FLOPs at S >= 1k (i.i.d. groups: only the prompt shared)."""
  from experiments.training import aot
  cfg = decoder.PolicyConfig(vocab_size=32000, d_model=1536, num_layers=28, num_heads=12,
                             num_kv_heads=2, d_ff=8960, max_len=4608)
  for p, l in ((512, 1024), (512, 4096)):
    shape = dict(rows=256, group_size=8, prompt_len=p, response_len=l, packing='tree')
    paths = aot.teacher_forcing_flops(cfg, aot.RLShape(**shape, pack_attention='paths'))
    blocks = aot.teacher_forcing_flops(cfg, aot.RLShape(**shape, pack_attention='blocks'))
    t = p + 8 * l
    pairs = packing.pair_bucket(packing.iid_block_pairs(p, 8, l, 128), -(-t // 128))
    assert aot.packed_pairs(aot.RLShape(**shape, pack_attention='blocks'), t) == (
        32 * pairs * 128 ** 2)
    ratio = blocks['packed']['attention'] / paths['packed']['attention']
    assert 0.45 < ratio < 0.6, ratio
    total = lambda f: f['dense'] + f['attention']
    kept = (1 - total(blocks['packed']) / total(blocks['flat'])) / blocks['dense_saving']
    assert kept >= 0.9, kept
    assert blocks['packed']['dense'] == paths['packed']['dense']
