"""Hugging Face Llama/Qwen2 weight layout <-> our stacked decoder params.

Both loaders reduce a checkpoint to `tensors`, a dict of HF-named arrays in HF
(PyTorch) layout, [out, in] matrices, rotate-half RoPE order:
  model.embed_tokens.weight [V, D], lm_head.weight [V, D] (absent when tied),
  model.norm.weight [D], and per layer i under model.layers.{i}.:
  input_layernorm.weight, post_attention_layernorm.weight [D],
  self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k,v}_proj.bias (Qwen2, Llama
  attention_bias), self_attn.o_proj.bias (Llama attention_bias),
  self_attn.{q,k}_norm.weight [Dh] (Qwen3), mlp.{gate,up,down}_proj.weight
  and mlp.{gate,up,down}_proj.bias (Llama mlp_bias).
`to_params` stacks them into the `decoder` param tree (layers on axis 0) and
refuses tensors it did not read (strict accounting); `from_params` is its
inverse (used to write HF directories).
"""

import dataclasses
import re
import warnings
from typing import Callable

import jax
import numpy as np

from experiments.models import decoder

_LAYER = 'model.layers.{}.'


def _check(name, x, shape):
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f'{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}')
  return x


# Tensors that may sit in a checkpoint without being weights (recomputed from the config).
NON_WEIGHTS = (r'model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq', r'model\.rotary_emb\.inv_freq')


EMBED, HEAD = 'model.embed_tokens.weight', 'lm_head.weight'


def tied_head(cfg: decoder.PolicyConfig, names, same: Callable[[], bool],
              source: str = 'checkpoint') -> tuple[decoder.PolicyConfig, tuple[str, ...]]:
  """(cfg, redundant names) for a tied config (tie_word_embeddings) whose checkpoint also
  stores `lm_head.weight`, read as transformers >= 5 reads it: a copy equal to the
  embedding (`same()`, exact equality as `torch.equal`) is redundant and dropped; a
  different head is loaded untied (cfg.tie_embeddings False), with a warning naming it."""
  if not cfg.tie_embeddings or HEAD not in names:
    return cfg, ()
  if same():
    return cfg, (HEAD,)
  warnings.warn(f'{source}: config.json ties the embeddings (tie_word_embeddings) but the '
                f'stored {HEAD} differs from {EMBED}; loading the stored head untied, as '
                'transformers >= 5 does (set tie_word_embeddings to false to silence this)',
                stacklevel=3)
  return dataclasses.replace(cfg, tie_embeddings=False), ()


def unread(tensors, cfg: decoder.PolicyConfig, redundant=()) -> list[str]:
  """Names in `tensors` that `to_params` does not consume (and are not known non-weights
  or `redundant`, e.g. a tied head's stored copy: `tied_head`)."""
  used = set(_names(cfg)) | set(redundant)
  return sorted(n for n in tensors if n not in used
                and not any(re.fullmatch(p, n) for p in NON_WEIGHTS))


def to_params(tensors: dict, cfg: decoder.PolicyConfig, *, source: str = 'checkpoint',
              redundant=()):
  """HF-layout tensors -> decoder params (float32 numpy arrays).

  Every tensor must be consumed: names the config does not account for (e.g. an
  o_proj bias under a config without attention_bias) raise a ValueError listing them;
  `redundant` names are exempt (see `tied_head`).
  """
  missing = [n for n in _names(cfg) if n not in tensors]
  if missing:
    raise ValueError(f'{source} lacks {len(missing)} tensors, e.g. {missing[:3]}')
  extra = unread(tensors, cfg, redundant)
  if extra:
    raise ValueError(f'{source} has {len(extra)} tensors the config does not use (so the model '
                     f'would compute something else): {extra[:8]}')
  d, h, k, dh, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
  get = lambda n, shape: _check(n, np.asarray(tensors[n], np.float32), shape)

  def stack(suffix, shape, fn):
    return np.stack([fn(get(_LAYER.format(i) + suffix, shape)) for i in range(cfg.num_layers)])

  blocks = {
      'attn_norm': {'scale': stack('input_layernorm.weight', (d,), lambda w: w)},
      'mlp_norm': {'scale': stack('post_attention_layernorm.weight', (d,), lambda w: w)},
      'q': {'kernel': stack('self_attn.q_proj.weight', (h * dh, d), lambda w: w.T.reshape(d, h, dh))},
      'k': {'kernel': stack('self_attn.k_proj.weight', (k * dh, d), lambda w: w.T.reshape(d, k, dh))},
      'v': {'kernel': stack('self_attn.v_proj.weight', (k * dh, d), lambda w: w.T.reshape(d, k, dh))},
      'o': {'kernel': stack('self_attn.o_proj.weight', (d, h * dh), lambda w: w.T.reshape(h, dh, d))},
      'gate': {'kernel': stack('mlp.gate_proj.weight', (f, d), lambda w: w.T)},
      'up': {'kernel': stack('mlp.up_proj.weight', (f, d), lambda w: w.T)},
      'down': {'kernel': stack('mlp.down_proj.weight', (d, f), lambda w: w.T)},
  }
  if cfg.attn_bias:
    for name, heads in (('q', h), ('k', k), ('v', k)):
      blocks[name]['bias'] = stack(f'self_attn.{name}_proj.bias', (heads * dh,),
                                   lambda b: b.reshape(heads, dh))
  if cfg.o_bias:
    blocks['o']['bias'] = stack('self_attn.o_proj.bias', (d,), lambda b: b)
  if cfg.mlp_bias:
    for name, n in (('gate', f), ('up', f), ('down', d)):
      blocks[name]['bias'] = stack(f'mlp.{name}_proj.bias', (n,), lambda b: b)
  if cfg.qk_norm:
    for name in ('q', 'k'):
      blocks[f'{name}_norm'] = {'scale': stack(f'self_attn.{name}_norm.weight', (dh,), lambda w: w)}
  params = {
      'embed': {'embedding': get('model.embed_tokens.weight', (cfg.vocab_size, d))},
      'blocks': blocks,
      'final_norm': {'scale': get('model.norm.weight', (d,))},
  }
  if not cfg.tie_embeddings:
    params['head'] = {'kernel': get('lm_head.weight', (cfg.vocab_size, d)).T}
  return params


def from_params(params, cfg: decoder.PolicyConfig) -> dict:
  """Decoder params -> HF-layout float32 tensors (inverse of `to_params`)."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  b = p['blocks']
  d = cfg.d_model
  out = {'model.embed_tokens.weight': p['embed']['embedding'],
         'model.norm.weight': p['final_norm']['scale']}
  if not cfg.tie_embeddings:
    out['lm_head.weight'] = p['head']['kernel'].T
  for i in range(cfg.num_layers):
    pre = _LAYER.format(i)
    out[pre + 'input_layernorm.weight'] = b['attn_norm']['scale'][i]
    out[pre + 'post_attention_layernorm.weight'] = b['mlp_norm']['scale'][i]
    for name in ('q', 'k', 'v'):
      out[pre + f'self_attn.{name}_proj.weight'] = b[name]['kernel'][i].reshape(d, -1).T
      if cfg.attn_bias:
        out[pre + f'self_attn.{name}_proj.bias'] = b[name]['bias'][i].reshape(-1)
    out[pre + 'self_attn.o_proj.weight'] = b['o']['kernel'][i].reshape(-1, d).T
    if cfg.o_bias:
      out[pre + 'self_attn.o_proj.bias'] = b['o']['bias'][i]
    if cfg.qk_norm:
      for name in ('q', 'k'):
        out[pre + f'self_attn.{name}_norm.weight'] = b[f'{name}_norm']['scale'][i]
    for name in ('gate', 'up', 'down'):
      out[pre + f'mlp.{name}_proj.weight'] = b[name]['kernel'][i].T
      if cfg.mlp_bias:
        out[pre + f'mlp.{name}_proj.bias'] = b[name]['bias'][i]
  return {n: np.ascontiguousarray(x, np.float32) for n, x in out.items()}


def _names(cfg):
  names = ['model.embed_tokens.weight', 'model.norm.weight']
  if not cfg.tie_embeddings:
    names.append('lm_head.weight')
  per_layer = ['input_layernorm.weight', 'post_attention_layernorm.weight',
               'self_attn.q_proj.weight', 'self_attn.k_proj.weight', 'self_attn.v_proj.weight',
               'self_attn.o_proj.weight', 'mlp.gate_proj.weight', 'mlp.up_proj.weight',
               'mlp.down_proj.weight']
  if cfg.attn_bias:
    per_layer += ['self_attn.q_proj.bias', 'self_attn.k_proj.bias', 'self_attn.v_proj.bias']
  if cfg.o_bias:
    per_layer.append('self_attn.o_proj.bias')
  if cfg.mlp_bias:
    per_layer += ['mlp.gate_proj.bias', 'mlp.up_proj.bias', 'mlp.down_proj.bias']
  if cfg.qk_norm:
    per_layer += ['self_attn.q_norm.weight', 'self_attn.k_norm.weight']
  return names + [_LAYER.format(i) + n for i in range(cfg.num_layers) for n in per_layer]
