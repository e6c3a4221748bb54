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
from typing import Optional

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from experiments.models import decoder, hf_layout

MODEL_TYPES = ('llama', 'qwen2', 'qwen3')
# Architectures seen on model hubs whose forward pass this decoder does not implement.
REFUSED_MODEL_TYPES = {
    'gemma': 'embedding scale, (1 + w) RMSNorm and GELU-tanh',
    'gemma2': 'embedding scale, (1 + w) RMSNorm, GELU-tanh, pre/post norms, soft-capping',
    'gemma3': 'embedding scale, (1 + w) RMSNorm, GELU-tanh, pre/post norms, local/global layers',
    'gemma3_text': 'embedding scale, (1 + w) RMSNorm, GELU-tanh, pre/post norms, local/global layers',
}
REQUIRED = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
            'intermediate_size')
# transformers' defaults where config.json may omit a key (LlamaConfig / Qwen2Config / Qwen3Config).
DEFAULT_CONTEXT = {'llama': 2048, 'qwen2': 32768, 'qwen3': 32768}
DEFAULT_HEAD_DIM = {'qwen3': 128}  # Qwen3Config(head_dim=128); the others: hidden / heads.
ROPE_KEYS = {  # Keys each RoPE type reads (besides rope_type / type / rope_theta).
    'default': (),
    'linear': ('factor',),
    'llama3': ('factor', 'low_freq_factor', 'high_freq_factor',
               'original_max_position_embeddings'),
}
# Keys of other architectures that would change the forward pass if they were honoured;
# transformers' Llama / Qwen classes do not read them, but a config carrying them was
# almost surely written for a model this loader would get wrong.
FOREIGN_FORWARD_KEYS = ('quantization_config', 'attn_logit_softcapping',
                        'final_logit_softcapping', 'embedding_multiplier', 'logits_scaling',
                        'residual_multiplier', 'attention_multiplier', 'query_pre_attn_scalar',
                        'use_qk_norm', 'rope_local_base_freq')


class ConfigError(ValueError):
  """config.json asks for something this loader cannot reproduce exactly."""


def read_config(path: str | os.PathLike) -> dict:
  """Parsed config.json; a missing, truncated or non-object file -> error naming it."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f'{path.parent} has no config.json (not a Hugging Face checkpoint dir)')
  try:
    hf = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: not valid JSON (truncated or corrupt?): {e}') from e
  if not isinstance(hf, dict):
    raise ValueError(f'{path}: expected a JSON object, got {type(hf).__name__}')
  return hf


def rope_config(hf: dict, where: str = 'config.json') -> dict:
  """RoPE settings of either config layout as {rope_type, rope_theta, factor, ...}.

  transformers 4.x: top-level `rope_theta` and `rope_scaling` (whose type key is
  `rope_type`, or `type` in older files); transformers >= 5: one `rope_parameters`
  dict holding rope_theta and rope_type. Both may be present (files converted by
  hand); they must then agree. Unknown RoPE types and keys raise ConfigError.
  """
  merged: dict = {}

  def put(key, value, origin):
    if value is None:
      return
    if key in merged and merged[key][0] != value:
      raise ConfigError(f'{where}: {key} is {merged[key][0]!r} in {merged[key][1]} but '
                        f'{value!r} in {origin}')
    merged.setdefault(key, (value, origin))

  for origin in ('rope_parameters', 'rope_scaling'):
    block = hf.get(origin)
    if block is None:
      continue
    if not isinstance(block, dict):
      raise ConfigError(f'{where}: {origin} must be an object, got {block!r}')
    if origin == 'rope_parameters' and block and all(isinstance(v, dict) for v in block.values()):
      raise ConfigError(f'{where}: per-layer-type rope_parameters {sorted(block)} '
                        '(local/global attention layers) are not supported')
    for key, value in block.items():
      put('rope_type' if key == 'type' else key, value, origin)
  put('rope_theta', hf.get('rope_theta'), 'rope_theta')
  out = {k: v for k, (v, _) in merged.items()}
  kind = out.pop('rope_type', 'default')
  if kind not in ROPE_KEYS:
    raise ConfigError(f'{where}: rope_type {kind!r} not supported (supported: '
                      f'{", ".join(ROPE_KEYS)}); refusing rather than computing other numbers')
  theta = out.pop('rope_theta', 10000.0)
  prf = out.pop('partial_rotary_factor', 1.0)
  if float(prf) != 1.0:
    raise ConfigError(f'{where}: partial_rotary_factor={prf} (partial RoPE) not supported')
  if kind == 'linear' and 'factor' not in out:
    raise ConfigError(f'{where}: rope_type linear needs factor')
  attention_factor = out.pop('attention_factor', None)
  if attention_factor not in (None, 1, 1.0):
    raise ConfigError(f'{where}: RoPE attention_factor={attention_factor} not supported')
  if kind == 'default':
    out.pop('factor', None)  # Old files carry {type: default, factor: 1.0}; unused.
  extra = sorted(set(out) - set(ROPE_KEYS[kind]))
  if extra:
    raise ConfigError(f'{where}: RoPE type {kind!r} does not use '
                      f'{", ".join(f"{k}={out[k]!r}" for k in extra)}; refusing to guess')
  missing = [k for k in ROPE_KEYS[kind] if k not in out and kind == 'llama3']
  if missing:
    raise ConfigError(f'{where}: rope_type llama3 needs {", ".join(missing)}')
  return dict(out, rope_type=kind, rope_theta=float(theta))


def sliding_layers(hf: dict, where: str = 'config.json') -> tuple[list[int], Optional[int]]:
  """(indices of sliding-window attention layers, window) as transformers reads them.

  Qwen2/Qwen3: no window unless use_sliding_window (their configs then set sliding_window
  to None, whatever `layer_types` says); with it, `layer_types` if given (transformers >=
  4.53 writes it), else layers i >= max_window_layers. Llama has no window.
  """
  n = hf['num_hidden_layers']
  window = hf.get('sliding_window')
  types = hf.get('layer_types')
  if types is not None:
    bad = sorted({t for t in types} - {'full_attention', 'sliding_attention'})
    if bad or len(types) != n:
      raise ConfigError(f'{where}: layer_types must be {n} of full_attention / '
                        f'sliding_attention, got {types!r}')
  if hf.get('model_type') == 'llama' or not hf.get('use_sliding_window', False):
    layers = []
  elif types is not None:
    layers = [i for i, t in enumerate(types) if t == 'sliding_attention']
  else:
    layers = list(range(hf.get('max_window_layers', 28), n))
  if layers and window is None:
    raise ConfigError(f'{where}: sliding-window layers {layers} but no sliding_window')
  return layers, window


def context_limits(hf: dict, where: str = 'config.json') -> list[tuple[int, str]]:
  """(largest allowed max_len, reason) pairs from config.json."""
  kind = hf.get('model_type')
  ctx = hf.get('max_position_embeddings', DEFAULT_CONTEXT.get(kind))
  out = [] if ctx is None else [(int(ctx), f'max_position_embeddings={ctx} in {where}')]
  layers, window = sliding_layers(hf, where)
  if layers:
    out.append((int(window), f'sliding_window={window} on layers {layers} in {where} '
                             '(sliding-window attention is not implemented; it equals full '
                             'attention only while max_len <= the window)'))
  return out


def check_max_len(limits, max_len: int):
  """Raises ValueError if max_len (KV-cache slots) exceeds any of `limits`."""
  for limit, reason in limits:
    if max_len > limit:
      raise ValueError(f'max_len={max_len} exceeds the checkpoint\'s context: {reason}')


def config_from_hf(hf: dict, *, max_len: int, dtype=jnp.float32, remat: bool = False,
                   where: str = 'config.json') -> decoder.PolicyConfig:
  """PolicyConfig from a parsed config.json of either layout; `max_len` = cache slots.

  Every key that changes the forward pass is honoured (rope_theta / rope_scaling /
  rope_parameters, head_dim, attention_bias, mlp_bias, tie_word_embeddings,
  rms_norm_eps, Qwen3's q/k norms) or refused with a ConfigError naming key and value.
  Keys transformers' Llama / Qwen classes ignore are ignored here too.
  """
  kind = hf.get('model_type')
  if kind in REFUSED_MODEL_TYPES:
    raise NotImplementedError(f'{where}: model_type {kind!r} not supported '
                              f'({REFUSED_MODEL_TYPES[kind]}); supported: {MODEL_TYPES}')
  if kind not in MODEL_TYPES:
    raise NotImplementedError(f'{where}: model_type {kind!r} not supported; '
                              f'supported: {MODEL_TYPES}')
  missing = [k for k in REQUIRED if k not in hf]
  if missing:
    raise ValueError(f'{where}: required field(s) {", ".join(missing)} missing')
  for key in REQUIRED + ('num_key_value_heads', 'head_dim', 'max_position_embeddings'):
    v = hf.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
      raise ConfigError(f'{where}: {key} must be a positive integer, got {v!r}')
  foreign = [k for k in FOREIGN_FORWARD_KEYS if hf.get(k) not in (None, False)]
  if foreign:
    raise ConfigError(f'{where}: {", ".join(f"{k}={hf[k]!r}" for k in foreign)} would change '
                      f'the forward pass and is not supported for {kind}')
  act = hf.get('hidden_act', 'silu')
  if act != 'silu':
    raise ConfigError(f'{where}: hidden_act {act!r} not supported (only silu)')
  if float(hf.get('partial_rotary_factor', 1.0)) != 1.0:
    raise ConfigError(f'{where}: partial_rotary_factor={hf["partial_rotary_factor"]} '
                      '(partial RoPE) not supported')
  if int(hf.get('pretraining_tp', 1) or 1) != 1 and kind != 'llama':
    raise ConfigError(f'{where}: pretraining_tp={hf["pretraining_tp"]} not supported')
  d, heads = hf['hidden_size'], hf['num_attention_heads']
  kv = hf.get('num_key_value_heads') or heads
  head_dim = hf.get('head_dim') or DEFAULT_HEAD_DIM.get(kind)
  if head_dim is None and d % heads:
    raise ConfigError(f'{where}: hidden_size={d} not divisible by num_attention_heads={heads} '
                      'and no head_dim')
  if heads % kv:
    raise ConfigError(f'{where}: num_attention_heads={heads} not divisible by '
                      f'num_key_value_heads={kv}')
  if head_dim is not None and head_dim % 2:
    raise ConfigError(f'{where}: head_dim={head_dim} is odd (RoPE needs an even head_dim)')
  rope = rope_config(hf, where)
  sliding_layers(hf, where)  # validates layer_types / sliding_window
  attention_bias = hf.get('attention_bias', False)
  if kind == 'qwen2':  # Qwen2Attention: q/k/v biases always, none on o_proj.
    qkv_bias, o_bias = True, False
  else:  # Llama and Qwen3: attention_bias covers q, k, v and o_proj.
    qkv_bias = o_bias = bool(attention_bias)
  mlp_bias = bool(hf.get('mlp_bias', False)) if kind == 'llama' else False
  if kind != 'llama' and hf.get('mlp_bias'):
    raise ConfigError(f'{where}: mlp_bias={hf["mlp_bias"]!r} is not read by {kind}')
  explicit = None if head_dim is None or head_dim * heads == d else head_dim
  scaled = {}
  if rope['rope_type'] != 'default':
    scaled = dict(rope_type=rope['rope_type'], rope_factor=float(rope['factor']))
    if rope['rope_type'] == 'llama3':
      scaled.update(rope_low_freq_factor=float(rope['low_freq_factor']),
                    rope_high_freq_factor=float(rope['high_freq_factor']),
                    rope_original_max_len=int(rope['original_max_position_embeddings']))
  cfg = decoder.PolicyConfig(
      vocab_size=hf['vocab_size'], d_model=d, num_layers=hf['num_hidden_layers'],
      num_heads=heads, num_kv_heads=kv, d_ff=hf['intermediate_size'], max_len=max_len,
      rope_base=rope['rope_theta'], rms_eps=float(hf.get('rms_norm_eps', 1e-6)),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)), attn_bias=qkv_bias,
      o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=kind == 'qwen3', attn_head_dim=explicit,
      dtype=dtype, remat=remat, **scaled)
  check_max_len(context_limits(hf, where), max_len)
  return cfg


def _read_safetensors(files: list[str]) -> dict:
  """All tensors of the files as float32 numpy arrays; errors name the file."""
  tensors = {}
  for f in files:
    try:
      with safe_open(f, framework='flax') as st:
        for name in st.keys():
          if name in tensors:
            raise ValueError(f'{f}: tensor {name} also appears in another *.safetensors file')
          tensors[name] = np.asarray(st.get_tensor(name).astype(jnp.float32))
    except ValueError:
      raise
    except Exception as e:  # safetensors raises SafetensorError / OSError on bad files.
      raise ValueError(f'{f}: not a readable safetensors file (truncated or corrupt?): '
                       f'{type(e).__name__}: {e}') from e
  return tensors


def safetensors_files(path: pathlib.Path) -> list[str]:
  """The weight files of an HF dir; with model.safetensors.index.json, exactly its shards.

  A directory with both model.safetensors and an index is refused (the two can hold
  different weights, e.g. a sharded revision downloaded over a single-file one, and
  transformers would load model.safetensors); other files the index does not name are
  ignored, as transformers ignores them.
  """
  files = sorted(glob.glob(str(path / '*.safetensors')))
  index = path / 'model.safetensors.index.json'
  if index.is_file():
    if (path / 'model.safetensors').is_file():
      raise ValueError(f'{path} holds both model.safetensors and model.safetensors.index.json, '
                       'which may be different weights (e.g. a sharded revision downloaded over '
                       'a single-file one); remove the one that is stale')
    try:
      wanted = set(json.loads(index.read_text())['weight_map'].values())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as e:
      raise ValueError(f'{index}: not a valid safetensors index ({type(e).__name__}: {e})') from e
    absent = sorted(w for w in wanted if not (path / w).is_file())
    if absent:
      raise FileNotFoundError(f'{index} names shard(s) missing from {path}: {absent}')
    files = sorted(str(path / w) for w in wanted)
  if not files:
    raise FileNotFoundError(f'{path} has no *.safetensors files')
  return files


def load_hf_dir(path: str | os.PathLike, *, max_len: int, dtype=jnp.float32,
                remat: bool = False):
  """HF directory -> (params as float32 numpy arrays, cfg, parsed config.json).

  Fails if a tensor in the files is not consumed (see `hf_layout.to_params`). A tied
  config whose files also hold a different `lm_head.weight` loads that head untied, with
  a warning (`hf_layout.tied_head`, as transformers >= 5); cfg then says so.
  """
  path = pathlib.Path(path)
  where = str(path / 'config.json')
  hf = read_config(path / 'config.json')
  cfg = config_from_hf(hf, max_len=max_len, dtype=dtype, remat=remat, where=where)
  tensors = _read_safetensors(safetensors_files(path))
  source = f'{path} (*.safetensors)'
  cfg, redundant = hf_layout.tied_head(
      cfg, tensors, lambda: np.array_equal(tensors[hf_layout.EMBED], tensors[hf_layout.HEAD]),
      source)
  params = hf_layout.to_params(tensors, cfg, source=source, redundant=redundant)
  return params, cfg, hf


ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
                 'qwen3': 'Qwen3ForCausalLM'}


def model_type_for(cfg: decoder.PolicyConfig) -> str:
  """The HF model_type that computes `cfg`'s forward pass."""
  if cfg.qk_norm:
    return 'qwen3'
  if cfg.attn_bias and not cfg.o_bias and not cfg.mlp_bias:
    return 'qwen2'
  return 'llama'


def _check_expressible(cfg: decoder.PolicyConfig, model_type: str):
  if model_type not in MODEL_TYPES:
    raise ValueError(f'model_type must be one of {MODEL_TYPES}, got {model_type!r}')
  problems = []
  if model_type == 'qwen2':
    if not cfg.attn_bias:
      problems.append('qwen2 checkpoints have q/k/v biases; cfg.attn_bias is False')
    if cfg.o_bias or cfg.mlp_bias or cfg.qk_norm:
      problems.append('qwen2 has no o_proj / MLP biases and no q/k norms')
  else:
    if cfg.attn_bias != cfg.o_bias:
      problems.append(f'{model_type} attention_bias covers q, k, v and o_proj together, but '
                      f'cfg.attn_bias={cfg.attn_bias}, cfg.o_bias={cfg.o_bias}')
    if model_type == 'llama' and cfg.qk_norm:
      problems.append('llama has no q/k norms (cfg.qk_norm); use qwen3')
    if model_type == 'qwen3' and not cfg.qk_norm:
      problems.append('qwen3 always has q/k norms; cfg.qk_norm is False')
    if model_type == 'qwen3' and cfg.mlp_bias:
      problems.append('qwen3 has no MLP biases')
  if model_type != 'llama' and cfg.rope_type == 'llama3':
    problems.append(f'rope_type llama3 is only read by llama, not {model_type}')
  if problems:
    raise ValueError(f'cannot write cfg as {model_type}: ' + '; '.join(problems))


def hf_config(cfg: decoder.PolicyConfig, model_type: Optional[str] = None, *,
              layout: str = '4', **extra) -> dict:
  """config.json contents for `cfg` (inverse of `config_from_hf`).

  model_type: None picks it from cfg (`model_type_for`). layout '4': top-level
  rope_theta / rope_scaling (transformers 4.x; transformers 5 still reads it);
  '5': `rope_parameters` (what transformers >= 5 writes). `extra` overrides keys,
  e.g. max_position_embeddings (default cfg.max_len).
  """
  model_type = model_type or model_type_for(cfg)
  _check_expressible(cfg, model_type)
  if layout not in ('4', '5'):
    raise ValueError(f"layout must be '4' or '5', got {layout!r}")
  out = {
      'architectures': [ARCHITECTURES[model_type]],
      'model_type': model_type, 'vocab_size': cfg.vocab_size, 'hidden_size': cfg.d_model,
      'num_hidden_layers': cfg.num_layers, 'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.kv_heads, 'intermediate_size': cfg.d_ff,
      'head_dim': cfg.head_dim, 'max_position_embeddings': cfg.max_len,
      'rms_norm_eps': cfg.rms_eps, 'hidden_act': 'silu',
      'tie_word_embeddings': cfg.tie_embeddings, 'torch_dtype': 'float32',
  }
  if model_type != 'qwen2':
    out['attention_bias'] = cfg.attn_bias
  if model_type == 'llama':
    out['mlp_bias'] = cfg.mlp_bias
  if model_type in ('qwen2', 'qwen3'):
    out['use_sliding_window'] = False
  rope = {'rope_type': cfg.rope_type}
  if cfg.rope_type != 'default':
    rope['factor'] = cfg.rope_factor
  if cfg.rope_type == 'llama3':
    rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  if layout == '5':
    out['rope_parameters'] = dict(rope, rope_theta=cfg.rope_base)
  else:
    out['rope_theta'] = cfg.rope_base
    out['rope_scaling'] = None if cfg.rope_type == 'default' else rope
  out.update(extra)
  return out


def save_hf_dir(path: str | os.PathLike, params, cfg: decoder.PolicyConfig, *,
                tokenizer=None, model_type: Optional[str] = None, layout: str = '4',
                dtype: str = 'float32', shard_size: Optional[int] = None,
                **config_extra) -> pathlib.Path:
  """Writes config.json, model.safetensors (float32) and the tokenizer's files.

  LoRA params (cfg.lora_rank > 0) are merged into the base kernels first
  (`decoder.merge_lora`), so the directory holds a plain checkpoint.
  dtype: 'float32' (default) or 'bfloat16' (round to nearest even; config.json's
  torch_dtype says so). shard_size: at most this many bytes per file (a single
  larger tensor gets a file of its own): model-0000k-of-0000n.safetensors plus
  model.safetensors.index.json, as transformers writes them; one file if all fit.
  Except for the default (float32, one file), tensors are converted one layer at
  a time, so the host never holds a float32 copy of the whole model.
  """
  import dataclasses

  import jax
  import ml_dtypes

  np_dtypes = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16}
  if dtype not in np_dtypes:
    raise ValueError(f'dtype must be one of {", ".join(np_dtypes)}, got {dtype!r}')
  if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int)
                                 or shard_size <= 0):
    raise ValueError(f'shard_size must be a positive number of bytes, got {shard_size!r}')
  params, cfg = decoder.merge_lora(params, cfg)
  path = pathlib.Path(path)
  if dtype != 'float32':
    config_extra = {'torch_dtype': dtype, **config_extra}
  config = hf_config(cfg, model_type, layout=layout, **config_extra)
  if dtype == 'float32' and shard_size is None:  # The original path, byte for byte.
    tensors = hf_layout.from_params(params, cfg)
    path.mkdir(parents=True, exist_ok=True)
    (path / 'config.json').write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / 'model.safetensors'))
  else:
    def stream():  # (HF name, float32 array), globals first, then layer by layer.
      yield from hf_layout.from_params(dict(params, blocks={}),
                                       dataclasses.replace(cfg, num_layers=0)).items()
      one, pre0 = dataclasses.replace(cfg, num_layers=1), hf_layout._LAYER.format(0)
      empty = np.zeros((0, 0), np.float32)  # stand-ins for the globals, dropped below
      for i in range(cfg.num_layers):
        layer = {'embed': {'embedding': empty}, 'final_norm': {'scale': np.zeros(0, np.float32)},
                 'head': {'kernel': empty},
                 'blocks': jax.tree.map(lambda x: x[i:i + 1], params['blocks'])}
        for name, x in hf_layout.from_params(layer, one).items():
          if name.startswith(pre0):
            yield hf_layout._LAYER.format(i) + name[len(pre0):], x

    path.mkdir(parents=True, exist_ok=True)
    (path / 'config.json').write_text(json.dumps(config, indent=2))
    written, group, size = [], {}, 0  # written: (temporary file, names, bytes) per file

    def flush():
      tmp = path / f'model-{len(written) + 1:05d}.safetensors.partial'
      save_file(group, str(tmp))
      written.append((tmp, list(group), sum(x.nbytes for x in group.values())))

    for name, x in stream():
      x = np.ascontiguousarray(x.astype(np_dtypes[dtype]))
      if shard_size is not None and group and size + x.nbytes > shard_size:
        flush()
        group, size = {}, 0
      group[name] = x
      size += x.nbytes
    flush()
    if len(written) == 1:
      os.replace(written[0][0], path / 'model.safetensors')
    else:
      n, weight_map = len(written), {}
      for k, (tmp, names, _) in enumerate(written, 1):
        fname = f'model-{k:05d}-of-{n:05d}.safetensors'
        os.replace(tmp, path / fname)
        weight_map.update({name: fname for name in names})
      index = {'metadata': {'total_size': sum(w[2] for w in written)}, 'weight_map': weight_map}
      (path / 'model.safetensors.index.json').write_text(json.dumps(index, indent=2))
  if tokenizer is not None:
    tokenizer.save_hf_dir(path)
  return path
