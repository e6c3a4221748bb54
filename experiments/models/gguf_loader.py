"""GGUF checkpoints (llama.cpp format, e.g. the built-in SmolLM2) -> decoder params.

The `gguf` package reads the file and dequantises every tensor (Q4_1, Q8_0, ...)
to float32. llama.cpp stores matrices as [out, in] like PyTorch, under its own
names; for the 'llama' architecture its converter also permutes the rows of the
q/k projections from Hugging Face's rotate-half RoPE order to interleaved pairs,
which `_unpermute` undoes, so GGUF and HF checkpoints share `hf_layout.to_params`.
"""

import os
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from experiments.models import decoder, hf_layout, hf_loader

# llama.cpp tensor names -> Hugging Face names (per layer under 'blk.{i}.').
_GLOBAL = {'token_embd.weight': 'model.embed_tokens.weight',
           'output_norm.weight': 'model.norm.weight',
           'output.weight': 'lm_head.weight'}
_PER_LAYER = {
    'attn_norm.weight': 'input_layernorm.weight',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight', 'attn_q.bias': 'self_attn.q_proj.bias',
    'attn_k.weight': 'self_attn.k_proj.weight', 'attn_k.bias': 'self_attn.k_proj.bias',
    'attn_v.weight': 'self_attn.v_proj.weight', 'attn_v.bias': 'self_attn.v_proj.bias',
    'attn_output.weight': 'self_attn.o_proj.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight', 'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
}
ARCHITECTURES = ('llama', 'qwen2')


def metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  """Scalar / string / list metadata fields of a GGUF file."""
  return {name: field.contents() for name, field in reader.fields.items()}


def config_from_metadata(meta: dict, *, max_len: int, dtype=jnp.float32,
                         has_output: bool = False, remat: bool = False) -> decoder.PolicyConfig:
  """PolicyConfig from GGUF metadata; `max_len` = cache slots (a run-time choice)."""
  arch = meta.get('general.architecture')
  if arch not in ARCHITECTURES:
    raise NotImplementedError(f'GGUF architecture {arch!r} not supported; '
                              f'supported: {ARCHITECTURES}')
  g = lambda key, default=None: meta.get(f'{arch}.{key}', default)
  d, heads = int(g('embedding_length')), int(g('attention.head_count'))
  rope_dim = g('rope.dimension_count')
  if rope_dim is not None and int(rope_dim) != d // heads:
    raise NotImplementedError(f'partial RoPE (dimension_count={rope_dim}, head_dim={d // heads})')
  if g('rope.scaling.type') not in (None, 'none'):
    raise NotImplementedError(f'RoPE scaling {g("rope.scaling.type")!r} not supported')
  vocab = g('vocab_size') or len(meta['tokenizer.ggml.tokens'])
  return decoder.PolicyConfig(
      vocab_size=int(vocab), d_model=d, num_layers=int(g('block_count')), num_heads=heads,
      num_kv_heads=int(g('attention.head_count_kv', heads)),
      d_ff=int(g('feed_forward_length')), max_len=max_len,
      rope_base=float(g('rope.freq_base', 10000.0)),
      rms_eps=float(g('attention.layer_norm_rms_epsilon', 1e-6)),
      tie_embeddings=not has_output, attn_bias=arch == 'qwen2', dtype=dtype, remat=remat)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation (rotate-half <- interleaved pairs)."""
  rows = w.shape[0]
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader: gguf.GGUFReader, cfg: decoder.PolicyConfig, arch: str) -> dict:
  """Dequantised tensors of a GGUF file under Hugging Face names and layout."""
  out = {}
  for t in reader.tensors:
    if t.name in _GLOBAL:
      name = _GLOBAL[t.name]
    else:
      parts = t.name.split('.', 2)
      if parts[0] != 'blk' or parts[2] not in _PER_LAYER:
        continue  # e.g. rope_freqs: not used by these architectures.
      name = f'model.layers.{parts[1]}.' + _PER_LAYER[parts[2]]
    w = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32)
    if arch == 'llama' and t.name.endswith(('attn_q.weight', 'attn_k.weight')):
      w = _unpermute(w, cfg.num_heads if 'attn_q' in t.name else cfg.kv_heads)
    out[name] = w
  return out


def context_limits(meta: dict, where: str = 'GGUF file') -> list[tuple[int, str]]:
  """(largest allowed max_len, reason) from the file's `<arch>.context_length`, if any."""
  arch = meta.get('general.architecture')
  ctx = meta.get(f'{arch}.context_length')
  return [] if ctx is None else [(int(ctx), f'{arch}.context_length={int(ctx)} in {where}')]


def read(path: str | os.PathLike) -> gguf.GGUFReader:
  """Opens a GGUF file; a truncated or corrupt one -> ValueError naming it."""
  try:
    return gguf.GGUFReader(path)
  except FileNotFoundError:
    raise
  except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
    # gguf reports a short file as e.g. a numpy reshape error from deep inside.
    raise ValueError(f'{os.fspath(path)}: not a readable GGUF file (truncated or corrupt?): '
                     f'{type(e).__name__}: {e}') from e


def load_gguf(path: str | os.PathLike, *, max_len: int, dtype=jnp.float32, remat: bool = False):
  """GGUF file -> (params, cfg, reader). Params are float32 numpy arrays.

  Refuses max_len above the file's context length (`context_limits`).
  """
  reader = read(path)
  meta = metadata(reader)
  has_output = any(t.name == 'output.weight' for t in reader.tensors)
  cfg = config_from_metadata(meta, max_len=max_len, dtype=dtype, has_output=has_output,
                             remat=remat)
  hf_loader.check_max_len(context_limits(meta, os.fspath(path)), max_len)
  try:
    tensors = hf_tensors(reader, cfg, meta['general.architecture'])
  except (ValueError, IndexError, TypeError) as e:
    raise ValueError(f'{os.fspath(path)}: cannot read its tensors (truncated or corrupt?): '
                     f'{type(e).__name__}: {e}') from e
  return hf_layout.to_params(tensors, cfg, source=os.fspath(path)), cfg, reader
