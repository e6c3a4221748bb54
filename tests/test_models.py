"""Decoder features for pretrained architectures and the checkpoint loaders (no real weights).

GQA, tied embeddings, q/k/v biases and bf16 compute are checked against
independent constructions; the HF-directory writer/loader and the GGUF q/k
un-permutation against their inverses. SmolLM2 itself: tests/test_smollm2.py.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.training import train_step as ts
from experiments.models import decoder, gguf_loader, hf_layout, hf_loader

QWEN = decoder.PolicyConfig(vocab_size=40, d_model=48, num_layers=2, num_heads=6, num_kv_heads=2,
                            d_ff=64, max_len=16, rope_base=1e5, rms_eps=1e-5, attn_bias=True)


def _random_params(cfg, seed=0, scale=0.3):
  """Random float32 params: norm scales near 1, every other weight N(0, scale^2)."""
  shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), cfg))
  rng = np.random.default_rng(seed)

  def draw(path, x):
    noise = rng.standard_normal(x.shape).astype(np.float32)
    return 1.0 + 0.1 * noise if path[-1].key == 'scale' else scale * noise

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _tokens(seed, shape, vocab):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def test_gqa_equals_full_attention_with_repeated_kv_heads():
  cfg = QWEN
  params = _random_params(cfg)
  full_cfg = dataclasses.replace(cfg, num_kv_heads=None)
  rep = cfg.num_heads // cfg.kv_heads
  full = jax.tree.map(lambda x: x, params)
  full['blocks'] = dict(params['blocks'])
  for name in ('k', 'v'):  # query head h reads kv head h // rep
    full['blocks'][name] = {
        'kernel': np.repeat(params['blocks'][name]['kernel'], rep, axis=2),
        'bias': np.repeat(params['blocks'][name]['bias'], rep, axis=1)}
  tokens = _tokens(0, (2, 9), cfg.vocab_size)
  # Logits of magnitude ~5 summed in another order: 1e-5 failed once by 1.4e-5 on CI-class CPUs.
  np.testing.assert_allclose(decoder.forward(params, cfg, tokens),
                             decoder.forward(full, full_cfg, tokens), atol=5e-5)
  assert decoder.init_cache(cfg, 3).k.shape == (2, 3, 16, 2, 8)


def test_attention_biases_and_tied_head_are_used():
  cfg = dataclasses.replace(QWEN, tie_embeddings=True)
  shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), cfg))
  assert 'head' not in shapes and shapes['blocks']['q']['bias'].shape == (2, 6, 8)
  params = _random_params(cfg)
  tokens = _tokens(1, (1, 5), cfg.vocab_size)
  out = decoder.forward(params, cfg, tokens)
  no_bias = jax.tree.map(lambda x: x, params)
  no_bias['blocks'] = {k: dict(v) for k, v in params['blocks'].items()}
  no_bias['blocks']['q']['bias'] = np.zeros_like(params['blocks']['q']['bias'])
  assert np.abs(out - decoder.forward(no_bias, cfg, tokens)).max() > 1e-3
  # Tied head: logits = final hidden @ embedding.T, exactly.
  model = decoder.Transformer(cfg)
  pos = jnp.arange(5)[None]
  h, _ = model.apply({'params': params}, tokens, pos, method=model.hidden)
  np.testing.assert_allclose(out, h @ params['embed']['embedding'].T, atol=1e-5)


def test_bf16_compute_keeps_f32_params_and_logits():
  cfg16 = dataclasses.replace(QWEN, dtype=jnp.bfloat16)
  params = _random_params(QWEN, scale=0.2)
  tokens = _tokens(2, (2, 8), QWEN.vocab_size)
  out16, out32 = decoder.forward(params, cfg16, tokens), decoder.forward(params, QWEN, tokens)
  assert out16.dtype == jnp.float32
  assert decoder.init_cache(cfg16, 1).k.dtype == jnp.bfloat16
  assert jax.tree.leaves(jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), cfg16))
                         )[0].dtype == jnp.float32
  err = np.abs(out16 - out32).max()
  assert 0 < err < 0.1 * np.abs(out32).max(), err


def test_cached_decode_matches_forward_with_gqa_and_bias():
  cfg, params = QWEN, _random_params(QWEN, seed=3)
  tokens = _tokens(3, (2, 10), cfg.vocab_size)
  # Jitted: eagerly each op of each call would compile on its own (eager forwards: the tests
  # above).
  full = jax.jit(decoder.forward, static_argnums=1)(params, cfg, tokens)
  logits, cache = jax.jit(decoder.prefill, static_argnums=1)(params, cfg, tokens[:, :4])
  step_fn = jax.jit(decoder.decode_step, static_argnums=1)
  steps = [logits[:, -1]]
  for t in range(4, 9):
    step, cache = step_fn(params, cfg, cache, tokens[:, t], jnp.full((2,), t))
    steps.append(step)
  np.testing.assert_allclose(np.stack(steps, 1), full[:, 3:9], atol=1e-4)


def test_config_validation():
  with pytest.raises(ValueError, match='num_kv_heads'):
    decoder.PolicyConfig(vocab_size=8, d_model=48, num_heads=6, num_kv_heads=4)


@pytest.mark.parametrize('model_type', ['qwen2', 'llama'])
def test_hf_dir_round_trip(tmp_path, model_type):
  cfg = QWEN if model_type == 'qwen2' else dataclasses.replace(
      QWEN, attn_bias=False, tie_embeddings=True, num_kv_heads=3)
  params = _random_params(cfg, seed=4)
  hf_loader.save_hf_dir(tmp_path, params, cfg, model_type=model_type)
  hf = json.loads((tmp_path / 'config.json').read_text())
  assert hf['model_type'] == model_type and hf['num_key_value_heads'] == cfg.kv_heads
  loaded, cfg2, _ = hf_loader.load_hf_dir(tmp_path, max_len=cfg.max_len)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  # HF layout: q_proj.weight is [H * Dh, D] with head-major rows.
  q = hf_layout.from_params(params, cfg)['model.layers.1.self_attn.q_proj.weight']
  np.testing.assert_array_equal(q[8:16], params['blocks']['q']['kernel'][1][:, 1, :].T)


def test_hf_dir_bf16_safetensors_and_errors(tmp_path):
  from safetensors.flax import save_file
  cfg = dataclasses.replace(QWEN, attn_bias=False)
  params = _random_params(cfg, seed=5)
  tensors = hf_layout.from_params(params, cfg)
  save_file({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()},
            str(tmp_path / 'model.safetensors'))
  (tmp_path / 'config.json').write_text(json.dumps(hf_loader.hf_config(cfg, 'llama')))
  loaded, _, _ = hf_loader.load_hf_dir(tmp_path, max_len=8)
  np.testing.assert_allclose(loaded['blocks']['up']['kernel'], params['blocks']['up']['kernel'],
                             rtol=1e-2, atol=1e-2)
  (tmp_path / 'config.json').write_text(json.dumps(dict(hf_loader.hf_config(cfg, 'llama'),
                                                        model_type='mistral')))
  with pytest.raises(NotImplementedError, match='mistral'):
    hf_loader.load_hf_dir(tmp_path, max_len=8)
  with pytest.raises(FileNotFoundError, match='config.json'):
    hf_loader.load_hf_dir(tmp_path / 'nope', max_len=8)
  bad = dict(tensors)
  bad.pop('model.layers.0.mlp.up_proj.weight')
  with pytest.raises(ValueError, match='lacks 1 tensors'):
    hf_layout.to_params(bad, cfg)


def _llama_cpp_permute(w, n_head):
  """llama.cpp convert_hf_to_gguf's q/k permutation (HF rotate-half -> GGUF)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_unpermute_inverts_llama_cpp_permute():
  w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
  np.testing.assert_array_equal(gguf_loader._unpermute(_llama_cpp_permute(w, 3), 3), w)
  # Interleaved pairs (GGUF rows 2i, 2i+1) become rotate-half pairs (i, i + Dh/2).
  ggml = _llama_cpp_permute(w, 3)
  np.testing.assert_array_equal(ggml[1], w[4])


def test_gguf_config_from_metadata_and_errors():
  meta = {'general.architecture': 'llama', 'llama.embedding_length': 576,
          'llama.attention.head_count': 9, 'llama.attention.head_count_kv': 3,
          'llama.block_count': 30, 'llama.feed_forward_length': 1536,
          'llama.rope.freq_base': 1e5, 'llama.attention.layer_norm_rms_epsilon': 1e-5,
          'llama.vocab_size': 49152, 'llama.rope.dimension_count': 64}
  cfg = gguf_loader.config_from_metadata(meta, max_len=32)
  assert (cfg.num_layers, cfg.kv_heads, cfg.head_dim, cfg.tie_embeddings) == (30, 3, 64, True)
  with pytest.raises(NotImplementedError, match='gemma'):
    gguf_loader.config_from_metadata(dict(meta, **{'general.architecture': 'gemma'}), max_len=8)
  with pytest.raises(NotImplementedError, match='partial RoPE'):
    gguf_loader.config_from_metadata(dict(meta, **{'llama.rope.dimension_count': 32}), max_len=8)


def test_param_specs_shard_a_pretrained_sized_model():
  cfg = decoder.PolicyConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9,
                             num_kv_heads=3, d_ff=1536, max_len=64, tie_embeddings=True)
  shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), cfg))
  specs = ts.param_specs(shapes, fsdp=8)
  assert specs['embed']['embedding'] == jax.sharding.PartitionSpec('fsdp', None)
  assert specs['blocks']['gate']['kernel'] == jax.sharding.PartitionSpec(None, None, 'fsdp')
  assert specs['blocks']['q']['kernel'] == jax.sharding.PartitionSpec(None, 'fsdp', None, None)
  for spec, x in zip(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)),
                     jax.tree.leaves(shapes)):
    for ax, part in enumerate(spec):
      assert part is None or x.shape[ax] % 8 == 0
  assert all(s == jax.sharding.PartitionSpec() for s in jax.tree.leaves(
      ts.param_specs(shapes, fsdp=1), is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))


def test_lora_adapters_start_neutral_and_train_alone():
  base_cfg = dataclasses.replace(QWEN, attn_bias=False)
  cfg = dataclasses.replace(base_cfg, lora_rank=4, lora_alpha=8.0)
  base = _random_params(base_cfg, seed=6)
  params = decoder.add_lora(jax.random.PRNGKey(1), base, cfg)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  lora = [p for p, _ in leaves if decoder.is_lora(p)]
  assert len(lora) == 14  # A and B for q, k, v, o, gate, up, down (stacked over layers)
  tokens = _tokens(7, (2, 6), cfg.vocab_size)
  np.testing.assert_allclose(jax.jit(decoder.forward, static_argnums=1)(params, cfg, tokens),
                             decoder.forward(base, base_cfg, tokens), atol=1e-6)
  rows = 4
  batch = ts.Batch(prompts=tokens[:1].repeat(rows, 0)[:, :3], tokens=_tokens(8, (rows, 5), 40),
                   mask=jnp.ones((rows, 5), bool),
                   advantages=jnp.asarray([[1.0], [-1.0], [0.5], [-0.5]]) * jnp.ones((1, 5)),
                   old_logprobs=jnp.zeros((rows, 5)))
  state = ts.init_state(params, ts.make_optimizer(1e-2, lora_only=True))
  batch = batch.replace(old_logprobs=jax.jit(decoder.token_logprobs, static_argnums=1)(
      params, cfg, batch.prompts, batch.tokens)[0])
  before = jax.tree.map(np.asarray, params)  # the step donates its state
  new, _ = ts.train_step_jit(state, batch, cfg=cfg, loss_cfg=ts.LossConfig())
  moved = {jax.tree_util.keystr(p): float(np.abs(np.asarray(a) - b).max()) for (p, a), b in
           zip(jax.tree_util.tree_leaves_with_path(new.params), jax.tree.leaves(before))}
  assert all(v == 0 for k, v in moved.items() if 'lora' not in k), moved  # base frozen
  assert all(v > 0 for k, v in moved.items() if 'lora_b' in k), moved  # adapters train
