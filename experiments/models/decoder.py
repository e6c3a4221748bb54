"""Llama-family decoder-only policy (Flax linen) with a static-shape KV cache.

One module for the toy policy trained from scratch on the JAX tasks and for
pretrained checkpoints (SmolLM2, Llama, Qwen2; see `gguf_loader` / `hf_loader`):
token embedding -> `num_layers` x [pre-RMSNorm causal self-attention with RoPE and
grouped-query heads, pre-RMSNorm SwiGLU MLP] -> final RMSNorm -> output head
(untied, or tied to the embedding). Optional q/k/v biases (Qwen2), o_proj bias
(Llama `attention_bias`), MLP biases (Llama `mlp_bias`), per-head q/k RMSNorm before
RoPE (Qwen3), an explicit head_dim (Qwen3) and scaled RoPE frequencies
(`linear`, `llama3`).
The toy default with a 14-token vocab has 393,344 parameters.

Conventions
  * Shapes: B batch rows, T tokens in a call, P prompt length, L response length,
    V vocab, S = cfg.max_len cache slots, H query heads, K = num_kv_heads, Dh head dim.
  * Layers are one `nn.scan` over stacked parameters (leading axis num_layers), so
    a 30-layer model compiles as fast as a 1-layer one.
  * Params are float32; activations and the KV cache use `cfg.dtype` (e.g. bf16);
    norms, softmax, RoPE and the output head run in float32 and logits are float32.
  * Positions are absolute token indices within a row (prompt starts at 0) and feed
    RoPE (rotate-half form, as Hugging Face Llama). Cache slot j holds position j.
  * Prompts are RIGHT-padded: row b holds its prompt at positions [0, prompt_len[b]),
    padding after. Equal-length prompts (`prompt_len=None`) are the main case.
  * With a cache, a call first writes its keys/values at `positions`, then attends
    to all slots <= the query position. Since a row always writes slot `pos` before
    querying from `pos`, slots beyond a row's current position may hold stale data
    (prompt padding, a sibling's continuation after a fork) with no effect.
"""

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from trees import packing as packing_lib


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """Static model hyper-parameters (hashable, usable as a jit static arg)."""
  vocab_size: int
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  d_ff: int = 336
  max_len: int = 64  # Cache slots: total prompt + response positions.
  rope_base: float = 10000.0
  dtype: Any = jnp.float32  # Compute dtype; params and logits are float32.
  num_kv_heads: Optional[int] = None  # Grouped-query attention; None = num_heads.
  rms_eps: float = 1e-6
  tie_embeddings: bool = False  # Output head = embedding matrix transposed.
  attn_bias: bool = False  # Biases on q, k, v (Qwen2).
  remat: bool = False  # Recompute each block in the backward pass (saves memory).
  # > 0: self-attention within a call in query chunks of this many positions, each against
  # the keys up to its own end (`causal_attention`); 0 = one dense [T, T] block.
  attn_chunk: int = 0
  # > 0: a decode step over a `CascadeCache` reads the rows' own slots only up to the end of
  # its phase, phases of this many slots (`sampling.decode_windows`; issue 41); 0 = all slots.
  decode_window: int = 256
  lora_rank: int = 0  # > 0: LoRA adapters (qwix) on every block projection.
  lora_alpha: float = 16.0
  # Pretrained-architecture options; the defaults are the toy policy / SmolLM2.
  attn_head_dim: Optional[int] = None  # Explicit head_dim (Qwen3); None = d_model / heads.
  o_bias: bool = False  # Bias on the attention output projection (Llama attention_bias).
  mlp_bias: bool = False  # Biases on gate, up and down (Llama mlp_bias).
  qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE (Qwen3).
  # RoPE frequency scaling (transformers' rope_type): 'default', 'linear' (all
  # frequencies / rope_factor) or 'llama3' (wavelength-dependent, Llama 3.1).
  rope_type: str = 'default'
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0  # llama3 only.
  rope_high_freq_factor: float = 4.0  # llama3 only.
  rope_original_max_len: int = 8192  # llama3 only: original_max_position_embeddings.

  def __post_init__(self):
    if self.attn_head_dim is None and self.d_model % self.num_heads:
      raise ValueError(f'd_model={self.d_model} not divisible by num_heads={self.num_heads}')
    if self.attn_head_dim is not None and self.attn_head_dim <= 0:
      raise ValueError(f'attn_head_dim must be positive, got {self.attn_head_dim}')
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f'rope_type {self.rope_type!r} not supported; supported: {ROPE_TYPES}')
    if self.rope_type != 'default' and not self.rope_factor > 0:
      raise ValueError(f'rope_factor must be > 0, got {self.rope_factor}')
    if self.head_dim % 2:
      raise ValueError(f'RoPE needs an even head_dim, got {self.head_dim}')
    if not (isinstance(self.attn_chunk, int) and self.attn_chunk >= 0):
      raise ValueError(f'attn_chunk must be an int >= 0 (0: no chunking), got '
                       f'{self.attn_chunk!r}')
    if not (isinstance(self.decode_window, int) and self.decode_window >= 0):
      raise ValueError(f'decode_window must be an int >= 0 (0: every own slot each step), '
                       f'got {self.decode_window!r}')
    if self.num_heads % self.kv_heads:
      raise ValueError(f'num_heads={self.num_heads} not divisible by '
                       f'num_kv_heads={self.kv_heads}')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads if self.attn_head_dim is None else self.attn_head_dim

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


@struct.dataclass
class KVCache:
  """Keys and values per layer: `k`, `v` [num_layers, B, S, K, Dh]."""
  k: jax.Array
  v: jax.Array


def init_cache(cfg: PolicyConfig, batch_size: int) -> KVCache:
  """Zero cache for `batch_size` rows: [num_layers, B, max_len, K, Dh]."""
  shape = (cfg.num_layers, batch_size, cfg.max_len, cfg.kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype))


@struct.dataclass
class CascadeCache:
  """Two-level KV cache of groups of rows that share a prefix (Hydragen, arXiv 2402.05099).

  `prefix_k` / `prefix_v` [num_layers, B, P, K, Dh] hold B prefixes once (slot j =
  position j); `k` / `v` [num_layers, B * G, L, K, Dh] each row's own tokens, row
  b * G + g reading prefix b. A call passes `start` [B * G], each row's first own
  position: the row sees prefix slots < start and its slot i holds position start + i.
  `window` (static): a call attends over own slots [0, window) only, all of them if None
  (the decode's phases, `sampling.decode`; every query's slot must be < window).
  """
  prefix_k: jax.Array
  prefix_v: jax.Array
  k: jax.Array
  v: jax.Array
  window: Optional[int] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class TreeCache:
  """Multi-level cascade KV cache of a tree whose levels fork at static positions
  (`sampling.sample_tree_fixed`, layout 'cascade_tree'): Hydragen's shared-prefix split
  (arXiv 2402.05099) applied once per tree level, each level one more shared part.

  `prefix_k` / `prefix_v` [num_layers, B, P, K, Dh]: B prompts once, as `CascadeCache`.
  `seg_k` / `seg_v`: one array per finished tree level j, [num_layers, N_j, S_j, K, Dh], its
  N_j nodes' response segments once each; node n is the ancestor of the R / N_j consecutive
  rows from n * R / N_j (node-major rows, as `sampling.fork_tree` repeats them), and its slot
  i holds position start + (S_0 + ... + S_{j-1}) + i. `k` / `v` [num_layers, R, W, K, Dh]:
  each row's own tokens after its last fork, slot i at position start + `offset` + i. A call
  passes `start` [R] as for a `CascadeCache` (prefix slots < start visible); every segment
  slot is visible (a row that reached a fork filled its segment; one that did not is done,
  and its outputs are not used). Writes past the W own slots are dropped (a row stalled at
  its level's end rewrites the slot after it). `window` (static): a call attends over own
  slots [0, window) only, as `CascadeCache.window` (the decode's phases).
  """
  prefix_k: jax.Array
  prefix_v: jax.Array
  seg_k: tuple
  seg_v: tuple
  k: jax.Array
  v: jax.Array
  window: Optional[int] = struct.field(pytree_node=False, default=None)

  @property
  def offset(self) -> int:
    """The response index of own slot 0: the last fork's position (static)."""
    return sum(x.shape[2] for x in self.seg_k)


def init_cascade_cache(cfg: PolicyConfig, num_prefixes: int, prefix_len: int, rows: int,
                       row_len: int) -> CascadeCache:
  """Zero `CascadeCache`: num_prefixes x prefix_len shared slots, rows x row_len own ones."""
  if rows % num_prefixes:
    raise ValueError(f'{rows} rows do not split into groups of {num_prefixes} prefixes')
  pre = (cfg.num_layers, num_prefixes, prefix_len, cfg.kv_heads, cfg.head_dim)
  own = (cfg.num_layers, rows, row_len, cfg.kv_heads, cfg.head_dim)
  return CascadeCache(prefix_k=jnp.zeros(pre, cfg.dtype), prefix_v=jnp.zeros(pre, cfg.dtype),
                      k=jnp.zeros(own, cfg.dtype), v=jnp.zeros(own, cfg.dtype))


# How activations are laid out on the loop's mesh ('data', 'fsdp', 'model';
# `train_step.make_mesh`), as logical axis -> mesh axes (MaxText style): rows over
# ('data', 'fsdp') where they divide (fsdp: each device runs its rows with gathered
# weights), and with a 'model' axis > 1 Megatron's column / row splits: heads, the MLP
# width and the vocabulary over 'model', the residual stream whole on every device.
# `train_step.PARAM_AXES` places the parameters to match. Names not in the table are
# left to the compiler.
MODEL_AXIS = 'model'
ROW_AXES = ('data', 'fsdp')
ACTIVATION_RULES = {'rows': ROW_AXES, 'heads': MODEL_AXIS, 'kv_heads': MODEL_AXIS,
                    'mlp': MODEL_AXIS, 'vocab': MODEL_AXIS, 'embed': None}


def tensor_parallel_mesh(x):
  """The (abstract) mesh `x` lives on if it has a 'model' axis > 1, else None."""
  mesh = getattr(getattr(jax.typeof(x), 'sharding', None), 'mesh', None)
  if mesh is None or mesh.empty or dict(mesh.shape).get(MODEL_AXIS, 1) == 1:
    return None
  return mesh


def embed_lookup(table, tokens, dtype):
  """Rows of an embedding table [V, D] at int tokens [...] -> [..., D] in `dtype`.

  With the vocabulary split over a 'model' axis > 1 (`train_step.PARAM_AXES`), each
  'model' shard looks the tokens up in its own vocabulary range (zeros elsewhere) and
  one all-reduce over 'model' adds the parts (exact: one non-zero term), so the table
  is never gathered over 'model'. Otherwise a plain lookup (`nn.Embed`'s).
  """
  mesh = tensor_parallel_mesh(table)
  table = jnp.asarray(table, dtype)
  if mesh is None:
    return jnp.take(table, tokens, axis=0)
  # Whole rows of this shard's vocabulary (gathered over 'fsdp', as any fsdp weight is
  # before use), so the lookup's output follows the tokens' rows.
  table = jax.lax.with_sharding_constraint(
      table, NamedSharding(mesh, PartitionSpec(MODEL_AXIS, None)))

  def local(part, tok):
    v = part.shape[0]
    idx = tok - jax.lax.axis_index(MODEL_AXIS) * v
    hit = (idx >= 0) & (idx < v)
    rows = jnp.take(part, jnp.clip(idx, 0, v - 1), axis=0)
    return jax.lax.psum(jnp.where(hit[..., None], rows, jnp.zeros((), dtype)), MODEL_AXIS)

  return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(MODEL_AXIS, None),
                                                   PartitionSpec()),
                       out_specs=PartitionSpec(), axis_names={MODEL_AXIS})(table, tokens)


def constrain(x, axes: tuple):
  """`x` laid out by the logical names `axes` (one per dimension, `ACTIVATION_RULES`;
  None or a name not in it: left to the compiler, as is a dimension its mesh axes do
  not divide), on a mesh of the loop's axes with more than one device; else x as is.
  Placement only, values are unchanged.

  The mesh is read from x's abstract value (arrays placed on a mesh carry it into
  `jit`), so no mesh context is needed. Without it, an fsdp update whose rows came
  through the shuffle's gather computed every row of a micro-batch on every device,
  with activations split like the weights (measured with experiments/compile_tpu.py,
  Llama-3.1-8B, 64 rows per micro-batch on a v5e-64: 25.3 GiB of temporaries per chip).
  """
  mesh = getattr(getattr(jax.typeof(x), 'sharding', None), 'mesh', None)
  if (mesh is None or mesh.empty or mesh.size == 1
      or not {MODEL_AXIS, *ROW_AXES} <= set(mesh.axis_names)):
    return x
  sizes = dict(mesh.shape)
  spec = []
  for n, name in zip(x.shape, axes):
    target = ACTIVATION_RULES.get(name, PartitionSpec.UNCONSTRAINED)
    if target is not None and target is not PartitionSpec.UNCONSTRAINED:
      names = target if isinstance(target, tuple) else (target,)
      if any(a not in sizes for a in names) or n % int(np.prod([sizes[a] for a in names])):
        target = PartitionSpec.UNCONSTRAINED
    spec.append(target)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


ROPE_TYPES = ('default', 'linear', 'llama3')


def rope_inv_freq(cfg: 'PolicyConfig') -> np.ndarray:
  """Scaled RoPE inverse frequencies [Dh / 2] (float32) for cfg.rope_type != 'default'.

  As transformers' `modeling_rope_utils`: inv_freq_i = 1 / base^(2i / Dh) in float32;
  'linear' divides all by `rope_factor`; 'llama3' (Llama 3.1 paper, sec. 3.4 code)
  divides wavelengths longer than original_max_len / low_freq_factor by the factor,
  keeps those shorter than original_max_len / high_freq_factor and interpolates
  smoothly in between.
  """
  dim = cfg.head_dim
  inv = (np.float32(1.0) / (np.float32(cfg.rope_base) **
                            (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32)
                             / np.float32(dim)))).astype(np.float32)
  factor = np.float32(cfg.rope_factor)
  if cfg.rope_type == 'linear':
    return (inv / factor).astype(np.float32)
  if cfg.rope_type != 'llama3':
    raise ValueError(f'rope_inv_freq: rope_type {cfg.rope_type!r}')
  low, high = np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor)
  old = np.float32(cfg.rope_original_max_len)
  low_wavelen, high_wavelen = old / low, old / high
  wavelen = (np.float32(2 * np.pi) / inv).astype(np.float32)
  scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (np.float32(1.0) - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, base: float, inv_freq=None) -> jax.Array:
  """Rotary embedding (rotate-half form): x [B, T, H, Dh], positions [B, T].

  `inv_freq` [Dh / 2] overrides the frequencies base^(-2i / Dh) (scaled RoPE).
  """
  half = x.shape[-1] // 2
  if inv_freq is None:
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  else:
    freq = jnp.asarray(inv_freq, jnp.float32)
  ang = positions.astype(jnp.float32)[..., None] * freq  # [B, T, Dh/2]
  sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


def attention(q, keys, values, visible, cfg: 'PolicyConfig'):
  """Grouped-query softmax attention: q [B, T, H, Dh], keys/values [B, S, K, Dh],
  visible bool [B, T, S] -> [B, T, H, Dh]. Scores and softmax in float32."""
  kh, rep = cfg.kv_heads, cfg.num_heads // cfg.kv_heads
  q = q.reshape(q.shape[:2] + (kh, rep, cfg.head_dim))  # Query head = kv head * rep + r.
  scores = jnp.einsum('btkrd,bskd->bkrts', q, keys).astype(jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(cfg.head_dim))
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
  attn = jnp.einsum('bkrts,bskd->btkrd', probs, values)
  return attn.reshape(attn.shape[:2] + (cfg.num_heads, cfg.head_dim))


def causal_attention(q, k, v, positions, cfg: 'PolicyConfig'):
  """Self-attention within one call: q [B, T, H, Dh], k / v [B, T, K, Dh], positions
  [B, T]; key s is visible to query t iff positions[s] <= positions[t] -> [B, T, H, Dh].

  `cfg.attn_chunk` = C > 0 runs the queries in chunks of C, each against the keys up to the
  chunk's end only: the (T / C)(T / C + 1) / 2 causal blocks instead of all (T / C)^2, exact
  whenever positions increase along each row (a later slot is then never visible), as in
  every forward and prefill here (`forward`, `response_hidden`, `prefill`). Measured on 2
  CPU cores (d = 64, 2 layers, 32 rows of T = 1,454, a grad step): 15.2 s dense, 5.4 s at
  C = 128; at T = 320, 0.66 s -> 0.47 s (C = 64).
  """
  t = q.shape[1]
  c = cfg.attn_chunk or t
  outs = [attention(q[:, s:s + c], k[:, :s + c], v[:, :s + c],
                    positions[:, None, :s + c] <= positions[:, s:s + c, None], cfg)
          for s in range(0, t, c)]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _attention_part(scores, values, visible, cfg: 'PolicyConfig', spec: str):
  """One part of a split softmax: (sum_s e_s v_s, row max m, sum_s e_s), e_s =
  exp(score_s - m) over visible keys; scores [..., S] f32, `spec` the einsum of e and
  values. A part with no visible key has m = finfo.min and vanishes in the merge."""
  scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
  m = jnp.max(scores, axis=-1, keepdims=True)
  e = jnp.exp(scores - m)
  out = jnp.einsum(spec, e.astype(cfg.dtype), values, preferred_element_type=jnp.float32)
  return out, m, jnp.sum(e, axis=-1, keepdims=True)


def cascade_attention(q, prefix_k, prefix_v, keys, values, start, slots, cfg: 'PolicyConfig'):
  """Attention of rows over their group's shared prefix and their own keys (Hydragen,
  arXiv 2402.05099, sec. 3): q [R, T, H, Dh] of rows r = b * G + g, prefix_k / prefix_v
  [B, P, K, Dh], keys / values [R, L, K, Dh] (the rows' own slots), start [R] (prefix
  slots < start[r] are visible to row r), slots [R, T] (the queries' own slots; own slots
  <= a query's are visible) -> [R, T, H, Dh].

  The prefix part is one batched matmul per (prefix, kv head) over the G * T * H / K
  queries that share it, so each prefix is read once, not G times. The two parts merge
  exactly through their row maxima and sums (log-sum-exp): o = (a_p o_p + a_s o_s) /
  (a_p l_p + a_s l_s), a = exp(m - max(m_p, m_s)). Equals `attention` over the
  concatenated keys up to float rounding. `tree_attention` without segment levels.
  """
  return tree_attention(q, prefix_k, prefix_v, (), (), keys, values, start, slots, cfg)


def _shared_part(q, keys, values, visible, cfg: 'PolicyConfig'):
  """`_attention_part` of rows q [R, T, H, Dh] over keys / values [N, S, K, Dh] that each
  run of R / N consecutive rows shares: one batched matmul per (key row, kv head), so each
  key row is read once, not R / N times (Hydragen). visible broadcasts to
  [N, R / N, T, K, H / K, S] -> (out [R, T, K, H / K, Dh], max, sum [R, T, K, H / K, 1])."""
  r, t = q.shape[:2]
  n, kh, rep, dh = keys.shape[0], cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim
  qg = q.reshape(n, r // n, t, kh, rep, dh)  # Query head = kv head * rep + r, as `attention`.
  s = jnp.einsum('bgtkrd,bskd->bgtkrs', qg, keys).astype(jnp.float32)
  s = s / jnp.sqrt(jnp.float32(dh))
  parts = _attention_part(s, values, visible, cfg, 'bgtkrs,bskd->bgtkrd')
  return tuple(x.reshape((r,) + x.shape[2:]) for x in parts)


def tree_attention(q, prefix_k, prefix_v, seg_k, seg_v, keys, values, start, slots,
                   cfg: 'PolicyConfig'):
  """`cascade_attention` with a shared part per tree level (a `TreeCache`'s; Hydragen,
  arXiv 2402.05099, its prefix split applied at every level): q [R, T, H, Dh], prefix_k /
  prefix_v [B, P, K, Dh], seg_k / seg_v tuples of [N_j, S_j, K, Dh] (all slots visible),
  keys / values [R, W, K, Dh] (own slots <= a query's visible), start [R], slots [R, T]
  -> [R, T, H, Dh]. Each part gives (o, m, l) (`_attention_part`) and all merge exactly
  by log-sum-exp: o = sum_i a_i o_i / sum_i a_i l_i, a_i = exp(m_i - max_j m_j)."""
  r, t = q.shape[:2]
  b, p = prefix_k.shape[:2]
  kh, rep, dh = cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim
  vis_p = (jnp.arange(p) < start[:, None]).reshape(b, r // b, 1, 1, 1, p)
  parts = [_shared_part(q, prefix_k, prefix_v, vis_p, cfg)]
  parts += [_shared_part(q, k, v, jnp.bool_(True), cfg) for k, v in zip(seg_k, seg_v)]
  s_s = jnp.einsum('rtkqd,rskd->rtkqs', q.reshape(r, t, kh, rep, dh), keys)
  s_s = s_s.astype(jnp.float32) / jnp.sqrt(jnp.float32(dh))
  vis_s = (jnp.arange(keys.shape[1]) <= slots[..., None])[:, :, None, None]
  parts.append(_attention_part(s_s, values, vis_s, cfg, 'rtkqs,rskd->rtkqd'))
  m = functools.reduce(jnp.maximum, [m_i for _, m_i, _ in parts])
  a = [jnp.exp(m_i - m) for _, m_i, _ in parts]
  total = lambda xs: functools.reduce(jnp.add, xs)  # no 0 + ...: the parts' sums alone
  out = total([a_i * o_i for a_i, (o_i, _, _) in zip(a, parts)])
  out = out / total([a_i * l_i for a_i, (_, _, l_i) in zip(a, parts)])
  return out.reshape(r, t, cfg.num_heads, dh).astype(cfg.dtype)


def block_attention(q, k, v, pair_q, pair_k, mask, cfg: 'PolicyConfig'):
  """Block-sparse softmax attention over a sorted list of block pairs.

  q [B, T, H, Dh], k / v [B, T, K, Dh]; pair_q / pair_k int [B, M], the query and key
  block of each pair, sorted by pair_q (entries with pair_q = nb = ceil(T / bk) are
  unused); mask bool [B, M, bk, bk] (query, key) inside each pair. Every query block
  must have a pair in which each of its rows sees a key (its diagonal pair).
  Scores live only on the M pairs; the softmax runs per query row across its pairs
  (segment max / sum over pair_q), so the cost is M * bk^2, not T^2. The backward pass
  is written out (flash-attention style: dS = P * (dP - rowsum(dO * O))), which is
  cheaper than differentiating the segment softmax. -> [B, T, H, Dh].
  """
  return _block_attention(q, k, v, pair_q, pair_k, mask, cfg)


def _block_take(x, i):
  """x [B, n, ...], i int [B, M] -> x[b, i[b, m]] [B, M, ...] (whole blocks; clipped)."""
  return jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=0, mode='clip'))(x, i)


def _block_sum(x, i, n: int, sorted_: bool):
  """Segment sums over pairs: x [B, M, ...], i int [B, M] -> [B, n, ...] (ids >= n dropped)."""
  return jax.vmap(functools.partial(jax.ops.segment_sum, num_segments=n,
                                    indices_are_sorted=sorted_))(x, i)


def _block_layout(x, bk: int, groups: int = 1):
  """x [B, T, heads, Dh] -> blocks [B, nb, K, groups, bk, Dh] (heads = K * groups; zero
  padded to nb * bk slots); groups = 1 drops that axis. Heads lead each block, so the
  per-pair products are plain batched matmuls."""
  b, t, h, dh = x.shape
  nb = -(-t // bk)
  x = jnp.pad(x, ((0, 0), (0, nb * bk - t), (0, 0), (0, 0)))
  x = x.reshape(b, nb, bk, h // groups, groups, dh).transpose(0, 1, 3, 4, 2, 5)
  return x if groups > 1 else x[:, :, :, 0]


def _block_unlayout(x, t: int):
  """[B, n >= nb, K, r, bk, Dh] -> [B, t, K * r, Dh] (the first nb blocks)."""
  b, _, kh, rep, bk, dh = x.shape
  nb = -(-t // bk)
  return x[:, :nb].transpose(0, 1, 4, 2, 3, 5).reshape(b, nb * bk, kh * rep, dh)[:, :t]


def _block_forward(q, k, v, pair_q, pair_k, mask, cfg):
  """(out [B, T, H, Dh], residuals): the segment softmax over the pairs."""
  t = q.shape[1]
  bk = mask.shape[-1]
  nb = -(-t // bk)
  rep = cfg.num_heads // cfg.kv_heads
  qm = _block_take(_block_layout(q, bk, rep), pair_q)  # [B, M, K, r, bk, Dh]
  km = _block_take(_block_layout(k, bk), pair_k)  # [B, M, K, bk, Dh]
  vm = _block_take(_block_layout(v, bk), pair_k)
  if rep == 1:
    qm = qm[:, :, :, None]
  scores = jnp.einsum('bmkrqd,bmkcd->bmkrqc', qm, km).astype(jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(cfg.head_dim))
  scores = jnp.where(mask[:, :, None, None], scores, jnp.finfo(jnp.float32).min)
  seg_max = jax.vmap(functools.partial(jax.ops.segment_max, num_segments=nb + 1,
                                       indices_are_sorted=True))
  row_max = seg_max(jnp.max(scores, axis=-1), pair_q)  # [B, nb + 1, K, r, bk]
  e = jnp.exp(scores - _block_take(row_max, pair_q)[..., None])
  denom = _block_sum(jnp.sum(e, axis=-1), pair_q, nb + 1, True)
  probs = e / _block_take(denom, pair_q)[..., None]  # [B, M, K, r, bk, bk]
  out = jnp.einsum('bmkrqc,bmkcd->bmkrqd', probs.astype(cfg.dtype), vm,
                   preferred_element_type=jnp.float32)
  out = _block_sum(out, pair_q, nb + 1, True)  # [B, nb + 1, K, r, bk, Dh]; nb: unused pairs
  return _block_unlayout(out, t).astype(cfg.dtype), (qm, km, vm, probs, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _block_attention(q, k, v, pair_q, pair_k, mask, cfg):
  return _block_forward(q, k, v, pair_q, pair_k, mask, cfg)[0]


def _block_attention_fwd(q, k, v, pair_q, pair_k, mask, cfg):
  out, res = _block_forward(q, k, v, pair_q, pair_k, mask, cfg)
  return out, (res, pair_q, pair_k, mask)


def _block_attention_bwd(cfg, saved, d_out):
  (qm, km, vm, probs, out), pair_q, pair_k, mask = saved
  t = d_out.shape[1]
  bk = mask.shape[-1]
  nb = -(-t // bk)
  rep = cfg.num_heads // cfg.kv_heads
  d_o = _block_layout(d_out.astype(jnp.float32), bk, rep)
  if rep == 1:
    d_o = d_o[:, :, :, None]
  d_o = jnp.pad(d_o, ((0, 0), (0, 1)) + ((0, 0),) * 4)  # block nb: zeros, for unused pairs
  d_om = _block_take(d_o, pair_q)  # [B, M, K, r, bk, Dh]
  row_m = _block_take(jnp.sum(d_o * out, axis=-1), pair_q)  # rowsum(dO * O) [B, M, K, r, bk]
  d_p = jnp.einsum('bmkrqd,bmkcd->bmkrqc', d_om.astype(cfg.dtype), vm,
                   preferred_element_type=jnp.float32)
  d_s = (probs * (d_p - row_m[..., None]) / jnp.sqrt(jnp.float32(cfg.head_dim))).astype(
      cfg.dtype)
  f32 = dict(preferred_element_type=jnp.float32)
  d_qm = jnp.einsum('bmkrqc,bmkcd->bmkrqd', d_s, km, **f32)
  d_km = jnp.einsum('bmkrqc,bmkrqd->bmkcd', d_s, qm, **f32)
  d_vm = jnp.einsum('bmkrqc,bmkrqd->bmkcd', probs.astype(cfg.dtype), d_om.astype(cfg.dtype),
                    **f32)
  d_q = _block_unlayout(_block_sum(d_qm, pair_q, nb + 1, True), t)
  kv = lambda x: _block_unlayout(_block_sum(x, pair_k, nb, False)[:, :, :, None], t)
  return (d_q.astype(cfg.dtype), kv(d_km).astype(cfg.dtype), kv(d_vm).astype(cfg.dtype),
          None, None, None)


_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


def packed_attention(q, k, v, pack, cfg: 'PolicyConfig'):
  """Ancestor-only attention over packed trees (`trees.packing`).

  q [B, T, H, Dh], k / v [B, T, K, Dh] at the packed slots. `pack.mode` 'paths'
  gathers each response's root-to-leaf path [S] of queries, keys and values, runs
  causal attention along it (the flat batch's computation for that row) and reads
  each slot's output from one response through it; 'mask' runs dense [T, T]
  attention under `trees.packing.ancestor_mask`; 'blocks' runs `block_attention`
  over the packing's needed block pairs (mask and pairs computed once, outside the
  layers).
  """
  if pack.block_mask is not None:
    return block_attention(q, k, v, pack.pair_q, pack.pair_k, pack.block_mask, cfg)
  if pack.mask is not None:
    return attention(q, k, v, pack.mask, cfg)
  b, t = q.shape[:2]
  g, s_len = pack.path.shape[1:]
  flat_path = pack.path.reshape(b, g * s_len)
  along = lambda x: jnp.take_along_axis(x, flat_path[:, :, None, None], axis=1).reshape(
      (b * g, s_len) + x.shape[2:])
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((s_len, s_len), bool)), (b * g, s_len, s_len))
  out = attention(along(q), along(k), along(v), causal, cfg)  # [B * G, S, H, Dh]
  out = out.reshape((b, g * s_len) + out.shape[2:])
  return jnp.take_along_axis(out, pack.source[:, :, None, None], axis=1)


@struct.dataclass
class PackedAttention:
  """Index arrays the layers need for packed trees: `path` [B, G, S], `source`
  [B, T] (see `trees.packing.Packing`), an optional dense `mask` [B, T, T], or the
  block pairs `pair_q`, `pair_k` [B, M] and their `block_mask` [B, M, bk, bk]."""
  path: jax.Array
  source: jax.Array
  mask: Optional[jax.Array] = None
  pair_q: Optional[jax.Array] = None
  pair_k: Optional[jax.Array] = None
  block_mask: Optional[jax.Array] = None


def cached_attention(q, k, v, positions, cache, layer, start, cfg: 'PolicyConfig'):
  """(attention output [B, T, H, Dh], cache) of one layer's call; see `Block`.

  No cache: within the call. A `KVCache` with n > 1 times the call's rows (a
  `prefill`'s): each row's keys and values go to slots [0, T) of n rows, the call attends
  within itself. A `KVCache` of the call's rows: write at `positions`, attend over all
  slots. A `CascadeCache` without `start`: the call's rows are its prefixes, written at
  slots [0, T) (a prefill), attending within the call; with `start` [B]: the rows' own
  keys written at slots positions - start, `cascade_attention` over prefix and own slots.
  A `TreeCache` (with `start`): own slots positions - start - offset, `tree_attention`.
  Caches [layers, rows, slots, K, Dh] keep rows over ('data', 'fsdp'), kv heads over 'model'.
  """
  if cache is None:  # Attend within the call: key s visible iff pos[s] <= pos[t].
    return causal_attention(q, k, v, positions, cfg), None
  put = lambda c, a, n: jax.lax.dynamic_update_slice(  # slots [0, T) of n copies of rows
      c, jnp.repeat(a.astype(c.dtype), n, axis=0, total_repeat_length=c.shape[1])[None],
      (layer, 0, 0, 0, 0))
  rows = jnp.arange(q.shape[0])[:, None]
  set_ = lambda c, a, slots: c.at[layer, rows, slots].set(a.astype(c.dtype))
  place = lambda c: jax.tree.map(lambda x: constrain(x, (None, 'rows', None, 'kv_heads', None)),
                                 c)
  if isinstance(cache, TreeCache) and start is None:
    raise ValueError('a TreeCache is prefilled as a CascadeCache (sampling.start)')
  if isinstance(cache, CascadeCache) and start is None:
    cache = cache.replace(prefix_k=put(cache.prefix_k, k, 1), prefix_v=put(cache.prefix_v, v, 1))
    return causal_attention(q, k, v, positions, cfg), place(cache)
  if isinstance(cache, (CascadeCache, TreeCache)):
    tree = isinstance(cache, TreeCache)
    slots = positions - start[:, None] - (cache.offset if tree else 0)
    cache = place(cache.replace(k=set_(cache.k, k, slots), v=set_(cache.v, v, slots)))
    own = slice(None, cache.window)  # the phase's filled slots (all when window is None)
    at = lambda xs: tuple(x[layer] for x in xs)
    return tree_attention(q, cache.prefix_k[layer], cache.prefix_v[layer],
                          at(cache.seg_k) if tree else (), at(cache.seg_v) if tree else (),
                          cache.k[layer][:, own], cache.v[layer][:, own], start, slots,
                          cfg), cache
  if cache.k.shape[1] != q.shape[0]:  # n = cache rows / call rows; a prefill starts at 0
    n = cache.k.shape[1] // q.shape[0]
    cache = KVCache(k=put(cache.k, k, n), v=put(cache.v, v, n))
    return causal_attention(q, k, v, positions, cfg), place(cache)
  cache = KVCache(k=set_(cache.k, k, positions), v=set_(cache.v, v, positions))
  visible = jnp.arange(cache.k.shape[2])[None, None, :] <= positions[:, :, None]
  return attention(q, cache.k[layer], cache.v[layer], visible, cfg), place(cache)


class Block(nn.Module):
  """Pre-norm decoder block, scanned over layers.

  carry = (x [B, T, D], cache or None, layer index); updates that layer's slice of
  the stacked cache in place (a dynamic update on the carried buffer); see
  `cached_attention` for the cache kinds (a `prefill`'s repeated rows, a decode's, a
  `CascadeCache`'s prefixes or own rows, the latter with `start` [B]). With `pack` (a
  `PackedAttention`, no cache) the T tokens are packed trees and attention is
  ancestor-only. With a 'model' mesh axis > 1, `constrain` lays the activations out as
  Megatron's column / row splits (`ACTIVATION_RULES`).
  """
  cfg: PolicyConfig

  @nn.compact
  def __call__(self, carry, positions, pack=None, start=None):
    x, cache, layer = carry
    cfg = self.cfg
    def dense(feats, name, axis=-1, bias=False):
      layer_ = nn.DenseGeneral(feats, axis=axis, use_bias=bias, dtype=cfg.dtype, name=name)
      # In cfg.dtype: qwix adds the LoRA path (float32 adapters) to the output, which would
      # otherwise promote a bfloat16 residual stream to float32 (and break the layer scan).
      return lambda h: layer_(h).astype(cfg.dtype)
    kh = cfg.kv_heads

    inv_freq = None if cfg.rope_type == 'default' else rope_inv_freq(cfg)

    h = RMSNorm(cfg.rms_eps, name='attn_norm')(x)
    # Rows over ('data', 'fsdp'); heads over 'model' (column-parallel q / k / v).
    heads, kv_heads = ('rows', None, 'heads', None), ('rows', None, 'kv_heads', None)
    q = constrain(dense((cfg.num_heads, cfg.head_dim), 'q', bias=cfg.attn_bias)(h),
                  heads)  # [B, T, H, Dh]
    k = constrain(dense((kh, cfg.head_dim), 'k', bias=cfg.attn_bias)(h), kv_heads)  # [B, T, K, Dh]
    if cfg.qk_norm:  # Qwen3: per-head RMSNorm over Dh, before RoPE.
      q = RMSNorm(cfg.rms_eps, name='q_norm')(q)
      k = RMSNorm(cfg.rms_eps, name='k_norm')(k)
    q = rope(q, positions, cfg.rope_base, inv_freq)
    k = rope(k, positions, cfg.rope_base, inv_freq)
    v = constrain(dense((kh, cfg.head_dim), 'v', bias=cfg.attn_bias)(h), kv_heads)
    if pack is not None:
      attn = packed_attention(q, k, v, pack, cfg)
    else:
      attn, cache = cached_attention(q, k, v, positions, cache, layer, start, cfg)
    # Row-parallel o: its input heads split, its output summed over 'model' (whole rows).
    attn = constrain(attn, heads)
    stream = ('rows', None, 'embed')
    x = constrain(x + dense(cfg.d_model, 'o', axis=(-2, -1), bias=cfg.o_bias)(attn), stream)

    h = RMSNorm(cfg.rms_eps, name='mlp_norm')(x)
    mb = cfg.mlp_bias
    gate, up = dense(cfg.d_ff, 'gate', bias=mb)(h), dense(cfg.d_ff, 'up', bias=mb)(h)
    act = constrain(nn.silu(gate) * up, ('rows', None, 'mlp'))  # column-parallel gate / up
    x = constrain(x + dense(cfg.d_model, 'down', bias=mb)(act), stream)  # row-parallel down
    return (x, cache, layer + 1), None


class Transformer(nn.Module):
  """tokens, positions [B, T] (+ optional KVCache) -> final hidden [B, T, D] f32, cache.

  `logits` maps hidden states to float32 logits; `__call__` does both.
  """
  cfg: PolicyConfig

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name='embed')
    block = nn.remat(Block) if cfg.remat else Block
    self.blocks = nn.scan(
        block, variable_axes={'params': 0}, split_rngs={'params': True},
        in_axes=nn.broadcast, length=cfg.num_layers)(cfg, name='blocks')
    self.final_norm = RMSNorm(cfg.rms_eps, name='final_norm')
    if not cfg.tie_embeddings:
      self.head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=jnp.float32, name='head')

  def hidden(self, tokens, positions, cache=None, pack=None, start=None):
    if tensor_parallel_mesh(self.embed.embedding) is None:
      x = self.embed(tokens)
    else:  # the table's vocabulary split over 'model': look up without gathering it
      x = embed_lookup(self.embed.embedding, tokens, self.cfg.dtype)
    x = constrain(x, ('rows', None, 'embed'))
    (x, cache, _), _ = self.blocks((x, cache, jnp.int32(0)), positions, pack, start)
    return self.final_norm(x).astype(jnp.float32), cache

  def logits(self, h):
    """[..., D] -> float32 logits [..., V], the vocabulary split over 'model' (if any)."""
    if self.cfg.tie_embeddings:
      logits = h.astype(jnp.float32) @ self.embed.embedding.astype(jnp.float32).T
    else:
      logits = self.head(h.astype(jnp.float32))
    return constrain(logits, ('rows',) + (None,) * (logits.ndim - 2) + ('vocab',))

  def __call__(self, tokens, positions, cache=None, start=None):
    h, cache = self.hidden(tokens, positions, cache, None, start)
    return self.logits(h), cache


@functools.lru_cache(maxsize=None)
def model(cfg: PolicyConfig) -> nn.Module:
  """The Flax module for cfg: `Transformer`, with qwix LoRA adapters if cfg.lora_rank > 0.

  LoRA (Hu et al. 2021): W x + (alpha / rank) B A x on the q/k/v/o/gate/up/down
  kernels of every block; B starts at zero, so a fresh adapter leaves the model
  unchanged. Adapter leaves are named '*_lora_a' / '*_lora_b' (see `is_lora`).
  """
  base = Transformer(cfg)
  if not cfg.lora_rank:
    return base
  import qwix  # only needed with adapters
  provider = qwix.LoraProvider([qwix.LoraRule(module_path='.*blocks.*', rank=cfg.lora_rank,
                                              alpha=cfg.lora_alpha)])
  return qwix.apply_lora_to_model(base, provider, methods=('__call__', 'hidden', 'logits'))


def is_lora(path) -> bool:
  """Whether a params key path (from tree_map_with_path) is a LoRA adapter leaf."""
  return 'lora' in str(getattr(path[-1], 'key', path[-1]))


@functools.lru_cache(maxsize=None)
def _jitted_init(cfg: PolicyConfig):
  """The model's init, jitted once per config (a fresh jit would be traced on every call)."""
  return jax.jit(lambda key: model(cfg).init(key, *[jnp.zeros((1, 1), jnp.int32)] * 2)['params'])


def init_params(key: jax.Array, cfg: PolicyConfig):
  """Fresh parameter pytree (the 'params' collection)."""
  return _jitted_init(cfg)(key)


def add_lora(key: jax.Array, params, cfg: PolicyConfig):
  """Pretrained `params` (no adapters) plus fresh LoRA adapters for cfg.lora_rank > 0."""
  new = init_params(key, cfg)
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}

  def pick(path, x):
    if is_lora(path):
      return x
    k = jax.tree_util.keystr(path)
    if k not in flat or flat[k].shape != x.shape:
      raise ValueError(f'params lack {k} of shape {x.shape}')
    return jnp.asarray(flat[k])
  return jax.tree_util.tree_map_with_path(pick, new)


def merge_lora(params, cfg: PolicyConfig):
  """(params without adapters, cfg with lora_rank 0): W + (alpha / rank) A B folded in.

  For a kernel W [L, *in, *out] with adapters A [L, prod(in), r], B [L, r, prod(out)]
  (qwix's layout, stacked over layers), the merged kernel computes the same forward.
  """
  base_cfg = dataclasses.replace(cfg, lora_rank=0)
  if not cfg.lora_rank:
    return params, base_cfg
  scale = cfg.lora_alpha / cfg.lora_rank

  def merge(node):
    if not isinstance(node, dict):
      return node
    out = {k: merge(v) for k, v in node.items() if 'lora' not in k}
    if 'kernel_lora_a' in node:
      w = jnp.asarray(node['kernel'], jnp.float32)
      a = jnp.asarray(node['kernel_lora_a'], jnp.float32)
      b = jnp.asarray(node['kernel_lora_b'], jnp.float32)
      delta = jnp.einsum('lir,lro->lio', a, b, precision=jax.lax.Precision.HIGHEST)
      out['kernel'] = w + scale * delta.reshape(w.shape)
    return out

  merged = merge(jax.tree.map(lambda x: x, params))
  leftover = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(merged)
              if is_lora(p)]
  if leftover:
    raise ValueError(f'merge_lora: adapters not merged: {leftover}')
  return merged, base_cfg


def num_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))


def apply(params, cfg: PolicyConfig, tokens, positions, cache=None, start=None):
  """Forward: tokens, positions [B, T] -> (logits [B, T, V] f32, cache or None); `start`
  [B] with a `CascadeCache` (see there) when the call writes the rows' own slots."""
  if start is None:
    return model(cfg).apply({'params': params}, tokens, positions, cache)
  return model(cfg).apply({'params': params}, tokens, positions, cache, start)


def forward(params, cfg: PolicyConfig, tokens):
  """Causal forward without cache: tokens [B, T] -> logits [B, T, V] f32."""
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return apply(params, cfg, tokens, pos)[0]


def prefill(params, cfg: PolicyConfig, prompts, cache: Optional[KVCache] = None):
  """Runs prompts [B, P] into an empty cache -> (logits [B, P, V], cache).

  cache: None for a fresh cache of B rows, or an empty (`init_cache`) cache of B * n
  rows, e.g. already placed on a mesh, that receives each prompt's keys and values n
  times: row b * n + j <- prompt b (the sampler's n responses per prompt). Each layer
  then writes its keys and values, repeated, straight into that cache (no B-row cache
  is built and copied), and the prompts attend within the call. Or an empty
  `CascadeCache` with B prefixes of P slots: the prompts become its prefixes, once.
  """
  b, p = prompts.shape
  if p > cfg.max_len:
    raise ValueError(f'prompt length {p} > max_len {cfg.max_len}')
  if cache is None:
    cache = init_cache(cfg, b)
  elif isinstance(cache, CascadeCache):
    if cache.prefix_k.shape[1:3] != (b, p):
      raise ValueError(f'a prefill of {b} x {p} prompts into {cache.prefix_k.shape[1:3]} '
                       f'prefix slots')
  elif cache.k.shape[1] % b:
    raise ValueError(f'a prefill of {b} prompts into a cache of {cache.k.shape[1]} rows: '
                     f'the rows must be a multiple of the prompts')
  pos = jnp.broadcast_to(jnp.arange(p), (b, p))
  return apply(params, cfg, prompts, pos, cache)


def decode_step(params, cfg: PolicyConfig, cache, tokens, positions, start=None):
  """One token per row: tokens, positions [B] -> (next-token logits [B, V], cache).

  cache: a `KVCache`, or a `CascadeCache` / `TreeCache` with `start` [B] (the rows'
  positions of own slot 0, less a `TreeCache`'s offset).
  """
  args = (cache,) if start is None else (cache, start)
  logits, cache = apply(params, cfg, tokens[:, None], positions[:, None], *args)
  return logits[:, 0], cache


def log_softmax_entropy(logits):
  """logits [..., V] -> (log-probs [..., V], entropy [...]) in float32.

  Only reductions over V (a max, two sums): with the vocabulary split over 'model'
  each device reduces its slice and XLA adds the partial results.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return logp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def pick_logprob(logp, tokens):
  """logp[..., tokens] of log-probs [..., V] at int tokens [...], as a masked sum over V
  rather than a gather: with the vocabulary split over 'model' each device sums its own
  slice and one all-reduce of [...] values adds them, so no [rows, L, V] array is
  gathered. Exact (one non-zero term)."""
  hit = jnp.arange(logp.shape[-1]) == tokens[..., None]
  return jnp.sum(jnp.where(hit, logp, 0.0), axis=-1)


def response_hidden(params, cfg: PolicyConfig, prompts, responses, prompt_len=None):
  """Final hidden states [B, L, D] f32 at the positions that predict each response token
  (the state before token t: prompt + responses[:t]); one causal forward over prompt +
  response. Arguments as `token_logprobs`."""
  b, p = prompts.shape
  l = responses.shape[1]
  if prompt_len is None:
    seq = jnp.concatenate([prompts, responses], axis=1)
    idx = jnp.broadcast_to(p - 1 + jnp.arange(l), (b, l))
  else:  # Pack as prompt[:len] + response + (ignored tail) per row.
    j = jnp.arange(p + l)[None, :]
    plen = prompt_len.astype(jnp.int32)[:, None]
    from_prompt = jnp.take_along_axis(
        prompts, jnp.broadcast_to(jnp.minimum(j, p - 1), (b, p + l)), 1)
    from_resp = jnp.take_along_axis(responses, jnp.clip(j - plen, 0, l - 1), 1)
    seq = jnp.where(j < plen, from_prompt, from_resp)
    idx = plen - 1 + jnp.arange(l)[None, :]
  pos = jnp.broadcast_to(jnp.arange(seq.shape[1] - 1), (b, seq.shape[1] - 1))
  h, _ = model(cfg).apply({'params': params}, seq[:, :-1], pos, method='hidden')
  return jnp.take_along_axis(h, idx[..., None], axis=1)


def token_logprobs(params, cfg: PolicyConfig, prompts, responses, prompt_len=None):
  """Teacher-forced log p(response token) and policy entropy at each response step.

  One full causal forward pass over prompt + response (differentiable).

  Args:
    prompts: [B, P] int32, right-padded if `prompt_len` is given.
    responses: [B, L] int32. Entries after EOS only affect outputs at their own
      (masked-out) positions, never earlier ones.
    prompt_len: optional [B] int32 true prompt lengths (>= 1); None = all P.
  Returns:
    logprobs [B, L] f32: log p(responses[:, t] | prompt, responses[:, :t]).
    entropy [B, L] f32: entropy of that next-token distribution.
  """
  # Logits only where a response token is predicted (the vocab can be 150k wide).
  h = response_hidden(params, cfg, prompts, responses, prompt_len)  # [B, L, D]
  logits = model(cfg).apply({'params': params}, h, method='logits')  # [B, L, V]
  logp, entropy = log_softmax_entropy(logits)  # vocab-split with a 'model' axis
  return pick_logprob(logp, responses.astype(jnp.int32)), entropy


def packed_token_logprobs(params, cfg: PolicyConfig, packing, responses):
  """`token_logprobs` of B groups of G responses from one forward over their packed trees.

  packing: a `trees.packing.Packing` of the groups (prompt + unique tokens, [B, T]).
  responses: [B, G, L] int32, the responses that were packed.
  Returns logprobs, entropy [B, G, L] f32, equal to `token_logprobs` on the B * G
  flat rows (up to float rounding) at unmasked tokens. With attention 'blocks', a
  group that needs more block pairs than `packing.num_pairs` gets NaN log-probs
  (`pack` checks concrete inputs on the host).
  """
  mask = packing_lib.ancestor_mask(packing) if packing.attention == 'mask' else None
  attn = PackedAttention(path=packing.path, source=packing.source, mask=mask)
  fits = None
  if packing.attention == 'blocks':
    pair_q, pair_k, count = packing_lib.block_pairs(packing)
    fits = count <= packing.pair_capacity
    attn = attn.replace(pair_q=pair_q, pair_k=pair_k,
                        block_mask=packing_lib.block_mask(packing, pair_q, pair_k))
  m = model(cfg)
  h, _ = m.apply({'params': params}, packing.tokens, packing.positions, None, attn,
                 method='hidden')  # [B, T, D]
  p = packing.num_prompt_slots
  last_prompt = jnp.take_along_axis(h, (packing.prompt_len - 1)[:, None, None], axis=1)
  rows = jnp.concatenate([last_prompt, h[:, p:]], axis=1)  # [B, T - P + 1, D]
  b, g, l = responses.shape
  # Only the rows some token is scored from (each parent once) reach the vocab head.
  logits = m.apply({'params': params}, rows, method='logits')
  logp, entropy = log_softmax_entropy(logits)  # [B, U, V], [B, U]
  row = packing.logit_row.reshape(b, g * l)
  lp = logp[jnp.arange(b)[:, None], row, responses.reshape(b, g * l).astype(jnp.int32)]
  ent = jnp.take_along_axis(entropy, row, axis=1)
  if fits is not None:  # missing pairs would give wrong values: make them loud instead
    lp, ent = (jnp.where(fits[:, None], x, jnp.nan) for x in (lp, ent))
  return lp.reshape(b, g, l), ent.reshape(b, g, l)
