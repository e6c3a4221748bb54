"""Hugging Face checkpoint directories (Llama, Qwen2) <-> decoder params, without torch.

A directory holds config.json, one or more *.safetensors files (read with
`safetensors`' flax backend, so bf16 checkpoints load too) and tokenizer.json
(+ tokenizer_config.json with the chat template). `save_hf_dir` writes the same
layout from our params (float32), e.g. to turn the built-in GGUF into an HF dir.
"""

import glob
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from experiments.models import decoder, hf_layout

MODEL_TYPES = ('llama', 'qwen2')


def config_from_hf(hf: dict, *, max_len: int, dtype=jnp.float32,
                   remat: bool = False) -> decoder.PolicyConfig:
  """PolicyConfig from a parsed config.json; `max_len` = cache slots."""
  kind = hf.get('model_type')
  if kind not in MODEL_TYPES:
    raise NotImplementedError(f'model_type {kind!r} not supported; supported: {MODEL_TYPES}')
  d, heads = hf['hidden_size'], hf['num_attention_heads']
  if hf.get('head_dim') not in (None, d // heads):
    raise NotImplementedError(f'head_dim={hf["head_dim"]} != hidden_size / heads = {d // heads}')
  scaling = hf.get('rope_scaling')
  if scaling and scaling.get('rope_type', scaling.get('type')) not in (None, 'default'):
    raise NotImplementedError(f'rope_scaling {scaling} not supported')
  if hf.get('hidden_act', 'silu') != 'silu':
    raise NotImplementedError(f'hidden_act {hf["hidden_act"]!r} not supported')
  bias = True if kind == 'qwen2' else bool(hf.get('attention_bias', False))
  return decoder.PolicyConfig(
      vocab_size=hf['vocab_size'], d_model=d, num_layers=hf['num_hidden_layers'],
      num_heads=heads, num_kv_heads=hf.get('num_key_value_heads', heads),
      d_ff=hf['intermediate_size'], max_len=max_len,
      rope_base=float(hf.get('rope_theta', 10000.0)), rms_eps=float(hf.get('rms_norm_eps', 1e-6)),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)), attn_bias=bias,
      dtype=dtype, remat=remat)


def load_hf_dir(path: str | os.PathLike, *, max_len: int, dtype=jnp.float32,
                remat: bool = False):
  """HF directory -> (params as float32 numpy arrays, cfg, parsed config.json)."""
  path = pathlib.Path(path)
  if not (path / 'config.json').is_file():
    raise FileNotFoundError(f'{path} has no config.json (not a Hugging Face checkpoint dir)')
  hf = json.loads((path / 'config.json').read_text())
  cfg = config_from_hf(hf, max_len=max_len, dtype=dtype, remat=remat)
  files = sorted(glob.glob(str(path / '*.safetensors')))
  if not files:
    raise FileNotFoundError(f'{path} has no *.safetensors files')
  tensors = {}
  for f in files:
    with safe_open(f, framework='flax') as st:
      for name in st.keys():
        tensors[name] = np.asarray(st.get_tensor(name).astype(jnp.float32))
  if cfg.tie_embeddings:
    tensors.pop('lm_head.weight', None)
  return hf_layout.to_params(tensors, cfg), cfg, hf


def hf_config(cfg: decoder.PolicyConfig, model_type: str = 'llama', **extra) -> dict:
  """config.json contents for `cfg` (inverse of `config_from_hf`)."""
  if model_type not in MODEL_TYPES:
    raise ValueError(f'model_type must be one of {MODEL_TYPES}, got {model_type!r}')
  if model_type == 'qwen2' and not cfg.attn_bias:
    raise ValueError('qwen2 checkpoints have q/k/v biases; cfg.attn_bias is False')
  out = {
      'architectures': ['Qwen2ForCausalLM' if model_type == 'qwen2' else 'LlamaForCausalLM'],
      'model_type': model_type, 'vocab_size': cfg.vocab_size, 'hidden_size': cfg.d_model,
      'num_hidden_layers': cfg.num_layers, 'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.kv_heads, 'intermediate_size': cfg.d_ff,
      'rope_theta': cfg.rope_base, 'rms_norm_eps': cfg.rms_eps, 'hidden_act': 'silu',
      'tie_word_embeddings': cfg.tie_embeddings, 'torch_dtype': 'float32',
  }
  if model_type == 'llama':
    out['attention_bias'] = cfg.attn_bias
  out.update(extra)
  return out


def save_hf_dir(path: str | os.PathLike, params, cfg: decoder.PolicyConfig, *,
                tokenizer=None, model_type: str = 'llama', **config_extra) -> pathlib.Path:
  """Writes config.json, model.safetensors (float32) and the tokenizer's files."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / 'config.json').write_text(
      json.dumps(hf_config(cfg, model_type, **config_extra), indent=2))
  save_file(hf_layout.from_params(params, cfg), str(path / 'model.safetensors'))
  if tokenizer is not None:
    tokenizer.save_hf_dir(path)
  return path
