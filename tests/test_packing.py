"""Tree-packed training (trees.packing + the packed forward): exact against the flat batch."""

import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.training import train_step as ts
from experiments.models import decoder
from trees import packing

CFG = decoder.PolicyConfig(vocab_size=12, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                          max_len=24, num_kv_heads=2)
B, G, L, P = 4, 4, 6, 5


def groups(seed, b=B, g=G, l=L, p=P, vocab=3, ragged_prompts=True):
  """Random groups whose responses copy random prefixes of earlier ones; ragged lengths."""
  rng = np.random.default_rng(seed)
  tok = rng.integers(0, vocab, (b, g, l)).astype(np.int32)
  for i in range(1, g):
    src = rng.integers(0, i, b)
    cut = rng.integers(0, l + 1, b)
    keep = np.arange(l)[None] < cut[:, None]
    tok[:, i] = np.where(keep, tok[np.arange(b), src], tok[:, i])
  lens = rng.integers(0, l + 1, (b, g))
  lens[:, 0] = l
  mask = np.arange(l)[None, None] < lens[..., None]
  prompts = rng.integers(0, CFG.vocab_size, (b, p)).astype(np.int32)
  plen = rng.integers(1, p + 1, b).astype(np.int32) if ragged_prompts else np.full(b, p, np.int32)
  return prompts, tok, mask, plen


def reference_layout_check(pk, prompts, tok, mask, plen, mode):
  """Plain-Python check of one packing: slots = unique prefixes, paths and ancestors."""
  tokens, path, pos = np.asarray(pk.tokens), np.asarray(pk.path), np.asarray(pk.positions)
  anc = np.asarray(packing.ancestor_mask(pk))
  b, g, l = tok.shape
  p = prompts.shape[1]
  for k in range(b):
    keys = {}  # response slot -> the response prefix (tree) or (g, t) (prompt) it holds
    for i in range(g):
      n = int(mask[k, i].sum())
      for t in range(n):
        key = tuple(tok[k, i, :t + 1]) if mode == 'tree' else (i, t)
        s = int(path[k, i, plen[k] + t])
        assert keys.setdefault(s, key) == key, 'one slot holds two different prefixes'
        assert tokens[k, s] == tok[k, i, t] and pos[k, s] == plen[k] + t
      for s in range(plen[k]):
        assert path[k, i, s] == s
    assert len(set(keys.values())) == len(keys) == int(pk.num_slots[k]) - p
    assert sorted(keys) == list(range(p, p + len(keys)))
    np.testing.assert_array_equal(tokens[k, :plen[k]], prompts[k, :plen[k]])

    def is_prefix(a, c):
      if mode == 'tree':
        return c[:len(a)] == a
      return a[0] == c[0] and a[1] <= c[1]

    t_len = tokens.shape[1]
    for i in range(t_len):
      for j in range(t_len):
        if i == j:
          want = True
        elif i in keys:
          want = j < plen[k] or (j in keys and is_prefix(keys[j], keys[i]))
        elif i < plen[k]:
          want = j <= i
        else:
          want = False
        assert anc[k, i, j] == want, (k, i, j)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(packing.MODES),
                  g=st.sampled_from([1, 5]))
def test_layout_matches_plain_python_trie(seed, mode, g):
  prompts, tok, mask, plen = groups(seed, b=2, g=g, l=4, p=3)
  need = packing.required_len(prompts, tok, mask, mode)
  pk = packing.pack(prompts, tok, mask, plen, pack_len=3 + g * 4, mode=mode)  # one shape
  assert int(np.max(pk.num_slots)) == need
  reference_layout_check(pk, prompts, tok, mask, plen, mode)
  if mode == 'prompt':
    assert need == 3 + int(mask.sum(-1).sum(-1).max())


def test_shared_prefixes_take_fewer_slots_and_identical_responses_one_path():
  prompts = np.zeros((1, 2), np.int32)
  tok = np.array([[[1, 2, 3], [1, 2, 4], [1, 2, 3]]], np.int32)
  mask = np.ones_like(tok, bool)
  assert packing.required_len(prompts, tok, mask, 'tree') == 2 + 4  # 1 2 {3, 4}
  assert packing.required_len(prompts, tok, mask, 'prompt') == 2 + 9
  empty = np.zeros_like(mask)
  assert packing.required_len(prompts, tok, empty, 'tree') == 2  # zero-length responses


_flat = jax.jit(decoder.token_logprobs, static_argnums=1)


_packed = jax.jit(decoder.packed_token_logprobs, static_argnums=1)


CFG_QWEN = dataclasses.replace(CFG, tie_embeddings=True, attn_bias=True, num_kv_heads=1)


@pytest.mark.parametrize('cfg,mode,attention', [
    (CFG, 'tree', 'paths'), (CFG, 'prompt', 'mask'), (CFG_QWEN, 'tree', 'mask'),
    (CFG_QWEN, 'prompt', 'paths')], ids=['gqa-tree-paths', 'gqa-prompt-mask',
                                         'tied-bias-mqa-tree-mask', 'tied-bias-mqa-prompt-paths'])
def test_packed_logprobs_equal_flat(cfg, mode, attention):
  prompts, tok, mask, plen = groups(1)
  params = decoder.init_params(jax.random.PRNGKey(0), cfg)
  flat_lp, flat_ent = _flat(params, cfg, np.repeat(prompts, G, 0), tok.reshape(B * G, L),
                            np.repeat(plen, G))
  pk = packing.pack(prompts, tok, mask, plen, pack_len=P + G * L, mode=mode, attention=attention)
  lp, ent = _packed(params, cfg, pk, tok)
  chex_shape = (B, G, L)
  assert lp.shape == ent.shape == chex_shape
  np.testing.assert_allclose(np.where(mask, lp, 0), np.where(mask, flat_lp.reshape(chex_shape), 0),
                             atol=1e-5)
  np.testing.assert_allclose(np.where(mask, ent, 0),
                             np.where(mask, flat_ent.reshape(chex_shape), 0), atol=1e-5)


def test_rows_logprobs_in_parts_equal_one_pass():
  """loop.rows_logprobs(chunks=c) runs the groups in gcd(B, c) parts: same values."""
  from experiments.training import loop
  prompts, tok, mask, plen = groups(3)
  params = decoder.init_params(jax.random.PRNGKey(1), CFG)
  pk = packing.pack(prompts, tok, mask, plen, pack_len=P + G * L)
  for packed in (None, pk):
    whole = loop.rows_logprobs(params, prompts, tok, mask, plen, packed, cfg=CFG)
    for chunks in (2, 4, 3):  # 3: gcd(4, 3) = 1 part
      np.testing.assert_allclose(
          loop.rows_logprobs(params, prompts, tok, mask, plen, packed, cfg=CFG, chunks=chunks),
          whole, atol=1e-5)


def test_does_not_fit_and_bad_mode_errors():
  prompts, tok, mask, plen = groups(2)
  need = packing.required_len(prompts, tok, mask)
  with pytest.raises(ValueError, match=f'needs {need} packed slots'):
    packing.pack(prompts, tok, mask, plen, pack_len=need - 1)
  with pytest.raises(ValueError, match='packing mode'):
    packing.pack(prompts, tok, mask, plen, pack_len=need, mode='leaves')
  with pytest.raises(ValueError, match='packed attention'):
    packing.pack(prompts, tok, mask, plen, pack_len=need, attention='dense')
  with pytest.raises(ValueError, match=r'\[B, G, L\]'):
    packing.pack(prompts, tok[0], mask[0], plen, pack_len=need)


def test_bucket_len():
  assert packing.bucket_len(5 + 1, 5, 4, 6) == 5 + 3
  assert packing.bucket_len(5 + 24, 5, 4, 6) == 5 + 24
  assert packing.bucket_len(5 + 4, 5, 4, 6) == 5 + 6
  lens = {packing.bucket_len(5 + u, 5, 16, 64) for u in range(0, 16 * 64 + 1)}
  assert len(lens) == 8


def make_batch(seed, params, pack_mode=None, attention='paths', b=B, block=0):
  """Flat `Batch` of b * G rows, and the same batch with a packing when pack_mode is set."""
  prompts, tok, mask, plen = groups(seed, b=b)
  rng = np.random.default_rng(seed + 100)
  adv = (rng.normal(size=(b, G, 1)) * np.ones((1, 1, L))).astype(np.float32)
  adv[:, :, L // 2:] *= -1.5  # token-level credit differs along a response
  old, _ = _flat(params, CFG, np.repeat(prompts, G, 0), tok.reshape(b * G, L), np.repeat(plen, G))
  old = old.reshape(b, G, L) + 0.3 * rng.normal(size=(b, G, L))  # ratios away from 1: clips act
  ref = old - 0.2 * rng.normal(size=(b, G, L))
  pk = None
  if pack_mode:
    pk = packing.pack(prompts, tok, mask, plen, pack_len=packing.required_len(
        prompts, tok, mask, pack_mode) + 2, mode=pack_mode, attention=attention, block=block)
  m = jnp.asarray(mask)
  return ts.batch_from_samples(jnp.asarray(prompts), jnp.asarray(tok), m,
                               jnp.where(m, adv, 0.0), jnp.where(m, old, 0.0).astype(jnp.float32),
                               jnp.where(m, ref, 0.0).astype(jnp.float32), jnp.asarray(plen), pk)


def test_loss_and_grads_equal_flat_every_aggregation():
  """Clip-higher, dual-clip, KL-as-loss and entropy terms on; f32, rtol 1e-5 (grads 1e-4)."""
  params = decoder.init_params(jax.random.PRNGKey(1), CFG)
  lc = ts.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01)
  flat = make_batch(3, params)
  packed = make_batch(3, params, 'tree')
  fn = jax.jit(jax.value_and_grad(ts.policy_loss, has_aux=True), static_argnums=(1, 2))
  wm = ts.token_weights(flat.mask, 'token-mean')
  for agg in ts.AGG_MODES:  # the mode only enters through the weights: one compile
    w = ts.token_weights(flat.mask, agg)
    (loss_f, aux_f), grad_f = fn(params, CFG, lc, flat, (w, wm))
    (loss_p, aux_p), grad_p = fn(params, CFG, lc, packed, (w, wm))
    assert float(aux_f['clip_frac']) > 0  # clipping acts on this batch
    np.testing.assert_allclose(loss_p, loss_f, rtol=1e-5, atol=1e-6, err_msg=agg)
    for k in aux_f:
      np.testing.assert_allclose(aux_p[k], aux_f[k], rtol=1e-5, atol=1e-6, err_msg=agg)
    for a, b in zip(jax.tree.leaves(grad_p), jax.tree.leaves(grad_f)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=agg)


# Minibatches would shuffle rows vs groups. The loss divides by the minibatch's rows; the
# metrics (token-mean weights) by its tokens, on a mesh a sum over the row shards.
STEP_LC = ts.LossConfig(agg='seq-mean-token-sum', kl_coef=0.05, num_microbatches=2)


# The packed batches the steps run: tree-packed with 'paths' attention, and with block-sparse
# attention (blocks of 4 slots, the automatic pair count).
PACKED = {'tree': dict(pack_mode='tree'),
          'blocks': dict(pack_mode='tree', attention='blocks', block=4)}


@pytest.fixture(scope='module')
def flat_and_packed_steps():
  """params, and {None: flat, 'tree' / 'blocks': packed} -> (batch, metrics, params after
  one train step with 2 micro-batches) on the same 8 groups: the one-device results that
  test_train_step_equals_flat_with_microbatches compares and the 8-device test matches."""
  params = decoder.init_params(jax.random.PRNGKey(2), CFG)
  out = {}
  for mode in (None, *PACKED):
    batch = make_batch(6, params, b=8, **PACKED.get(mode, {}))
    state = ts.init_state(jax.tree.map(jnp.copy, params), ts.make_optimizer(1e-2, 0))
    state, m = ts.train_step_jit(state, batch, cfg=CFG, loss_cfg=STEP_LC)
    out[mode] = (batch, jax.tree.map(np.asarray, m), jax.tree.map(np.asarray, state.params))
  return params, out


@pytest.mark.parametrize('packed', PACKED)
def test_train_step_equals_flat_with_microbatches(flat_and_packed_steps, packed):
  """[blocks]: micro-batches slice the block packing by group (4 of the 8 each): the
  static pair bound carries over."""
  _, out = flat_and_packed_steps
  (_, m_f, p_f), (batch, m_p, p_p) = out[None], out[packed]
  pk = batch.packing
  assert (pk.attention, pk.block) == (('blocks', 4) if packed == 'blocks' else ('paths', 0))
  for k in m_f:
    np.testing.assert_allclose(m_p[k], m_f[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # Adam's first step moves every weight by ~lr whatever the gradient's size, so a weight
  # whose gradient is ~0 can differ by more than the gradients' rounding (seen: 5.8e-6).
  for a, b in zip(jax.tree.leaves(p_p), jax.tree.leaves(p_f)):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_packed_minibatches_take_whole_groups(flat_and_packed_steps):
  params, out = flat_and_packed_steps
  batch = out['tree'][0]  # 8 packed groups
  state = ts.init_state(jax.tree.map(jnp.copy, params), ts.make_optimizer(1e-2, 0))
  with pytest.raises(ValueError, match='8 groups not divisible'):
    ts.train_step(state, batch, cfg=CFG, loss_cfg=ts.LossConfig(num_minibatches=3))
  state, m = ts.train_step(state, batch, cfg=CFG,
                           loss_cfg=ts.LossConfig(num_minibatches=2, num_epochs=2))
  assert np.isfinite(float(m['loss'])) and int(state.step) == 4


SCRIPT = textwrap.dedent('''
    import pickle
    import jax, jax.numpy as jnp, numpy as np
    assert jax.device_count() == 8, jax.devices()
    import tests_helper as h
    ts = h.ts
    with open('inputs.pkl', 'rb') as f:
      params, batch = pickle.load(f)  # the packed batch of the flat_and_packed_steps fixture
    # 8 devices as data=4 x fsdp=2: one packed group per device, fsdp-sharded params.
    mesh = ts.make_mesh(fsdp=2)
    state = ts.init_state(jax.tree.map(jnp.asarray, params), ts.make_optimizer(1e-2, 0))
    state = ts.shard_state(jax.tree.map(np.asarray, state), mesh)  # host arrays: no slicing
    state, m = ts.train_step_jit(state, ts.shard_batch(batch, mesh), cfg=h.CFG,
                                 loss_cfg=h.STEP_LC)
    with open('outputs.pkl', 'wb') as f:
      pickle.dump(jax.tree.map(np.asarray, (m, state.params)), f)
    print('OK', float(m['loss']))
''')


def test_packed_on_eight_device_mesh_matches_flat_on_one(tmp_path, flat_and_packed_steps):
  """The packed step on an 8-device mesh (a subprocess: the device count is fixed at start-up)
  equals the flat step on one device (the fixture's, computed in this process)."""
  params, out = flat_and_packed_steps
  _, m_flat, p_flat = out[None]
  with open(tmp_path / 'inputs.pkl', 'wb') as f:
    pickle.dump(jax.tree.map(np.asarray, (params, out['tree'][0])), f)
  (tmp_path / 'tests_helper.py').write_text(open(__file__).read().split('\nSCRIPT = ')[0])
  (tmp_path / 'run.py').write_text(SCRIPT)
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=os.getcwd())
  env.pop('JAX_COORDINATOR_ADDRESS', None)
  proc = subprocess.run([sys.executable, str(tmp_path / 'run.py')], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'OK' in proc.stdout
  with open(tmp_path / 'outputs.pkl', 'rb') as f:
    m_mesh, p_mesh = pickle.load(f)
  for k in m_flat:  # the loss, and the metrics' cross-shard token count
    np.testing.assert_allclose(m_mesh[k], m_flat[k], rtol=1e-5, err_msg=k)
  for a, b in zip(jax.tree.leaves(p_mesh), jax.tree.leaves(p_flat)):
    np.testing.assert_allclose(a, b, atol=1e-4)
