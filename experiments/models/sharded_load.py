"""HF checkpoint directories loaded straight onto a device mesh (issue 19, item 6).

`load_hf_dir_sharded(path, mesh, max_len=...)` gives the same params as
`hf_loader.load_hf_dir` (bit for bit, float32 by default) but as global
`jax.Array`s already placed with the training step's shardings
(`train_step.param_sharding`: `leaf_spec` over the ('data', 'fsdp') mesh), so the
loop needs no resharding. Each leaf is built from the global index of each of this
process's devices' shards (`sharding.addressable_devices_indices_map`, what
`jax.make_array_from_callback` hands its callback; see `place`): the index is mapped
back through `hf_layout.to_params`' transform (layer stacking on axis 0, [out, in]
-> [in, out] transposes, head reshapes) to a box of one HF tensor per layer, and
only that box is read with `safe_open(...).get_slice(name)[...]`, in the
checkpoint's dtype, then cast (float32 by default) and transferred, one shard at a
time. A process thus reads only the slices of its own devices, and the host never
holds a float32 copy of the whole model.

Host memory: safetensors memory-maps the files, and pages a process reads count in
its RSS as file-backed (reclaimable page cache); a column slice of a row-major
[out, in] matrix (e.g. q_proj sharded over d_model) touches every page of that
tensor. The files are mapped one leaf at a time, so at any moment the RSS above the
placed params is about one leaf's pages plus one shard (`experiments/bench_load.py`).
"""

import contextlib
import dataclasses
import json
import os
import pathlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from experiments.models import decoder, hf_layout, hf_loader

FLOAT_DTYPES = ('F64', 'F32', 'F16', 'BF16')  # safetensors dtype names we cast from.


@dataclasses.dataclass(frozen=True)
class Leaf:
  """How one param leaf is made from HF tensors, as in `hf_layout.to_params`.

  names: one HF tensor name, or one per layer (stacked on a new axis 0).
  hf_shape: each tensor's HF shape. transpose: reverse the axes (2-D [out, in]).
  split: (axis, (n, m)): after the transpose, that axis (of size n * m) is reshaped
  into two axes (n, m), e.g. q_proj's rows into (heads, head_dim).
  """
  names: tuple
  hf_shape: tuple
  stacked: bool
  transpose: bool = False
  split: Optional[tuple] = None

  @property
  def shape(self) -> tuple:
    """The param's shape: [L] if stacked, then the transposed / split HF shape."""
    t = list(self.hf_shape[::-1] if self.transpose else self.hf_shape)
    if self.split is not None:
      ax, nm = self.split
      if t[ax] != nm[0] * nm[1]:
        raise ValueError(f'{self.names[0]}: axis {ax} of {tuple(t)} is not {nm[0]} x {nm[1]}')
      t[ax:ax + 1] = list(nm)
    return ((len(self.names),) if self.stacked else ()) + tuple(t)


def leaf_table(cfg: decoder.PolicyConfig) -> dict:
  """{param path (tuple of keys): Leaf} for `cfg`; mirrors `hf_layout.to_params`."""
  d, h, k, dh, f, L = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff, cfg.num_layers
  per = lambda suffix: tuple(hf_layout._LAYER.format(i) + suffix for i in range(L))
  t = {
      ('embed', 'embedding'): Leaf(('model.embed_tokens.weight',), (cfg.vocab_size, d), False),
      ('final_norm', 'scale'): Leaf(('model.norm.weight',), (d,), False),
  }
  if not cfg.tie_embeddings:
    t[('head', 'kernel')] = Leaf(('lm_head.weight',), (cfg.vocab_size, d), False, transpose=True)
  b = lambda *keys: ('blocks',) + keys
  t[b('attn_norm', 'scale')] = Leaf(per('input_layernorm.weight'), (d,), True)
  t[b('mlp_norm', 'scale')] = Leaf(per('post_attention_layernorm.weight'), (d,), True)
  for name, heads in (('q', h), ('k', k), ('v', k)):
    t[b(name, 'kernel')] = Leaf(per(f'self_attn.{name}_proj.weight'), (heads * dh, d), True,
                                transpose=True, split=(1, (heads, dh)))
  t[b('o', 'kernel')] = Leaf(per('self_attn.o_proj.weight'), (d, h * dh), True, transpose=True,
                             split=(0, (h, dh)))
  for name, shape in (('gate', (f, d)), ('up', (f, d)), ('down', (d, f))):
    t[b(name, 'kernel')] = Leaf(per(f'mlp.{name}_proj.weight'), shape, True, transpose=True)
  if cfg.attn_bias:
    for name, heads in (('q', h), ('k', k), ('v', k)):
      t[b(name, 'bias')] = Leaf(per(f'self_attn.{name}_proj.bias'), (heads * dh,), True,
                                split=(0, (heads, dh)))
  if cfg.o_bias:
    t[b('o', 'bias')] = Leaf(per('self_attn.o_proj.bias'), (d,), True)
  if cfg.mlp_bias:
    for name, n in (('gate', f), ('up', f), ('down', d)):
      t[b(name, 'bias')] = Leaf(per(f'mlp.{name}_proj.bias'), (n,), True)
  if cfg.qk_norm:
    for name in ('q', 'k'):
      t[b(f'{name}_norm', 'scale')] = Leaf(per(f'self_attn.{name}_norm.weight'), (dh,), True)
  names = sorted(n for leaf in t.values() for n in leaf.names)
  if names != sorted(hf_layout._names(cfg)):  # the table and to_params read the same tensors
    raise AssertionError('sharded_load.leaf_table is out of step with hf_layout._names')
  return t


def _norm(index, shape) -> tuple:
  """A device's global index (tuple of slices, maybe shorter than shape) -> (start, stop) pairs."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f'strided shard index {s} not supported')
    out.append((start, stop))
  return tuple(out)


def read_box(leaf: Leaf, box: tuple, get_slice: Callable[[str], Any]) -> np.ndarray:
  """The part `box` ((start, stop) per axis of `leaf.shape`) of the leaf, in the
  checkpoint's dtype, reading only the layers in range and, of each layer's HF
  tensor, only the rows / columns the box needs (whole heads where a head axis is split)."""
  layers = range(*box[0]) if leaf.stacked else range(1)
  rest = list(box[1:] if leaf.stacked else box)
  t_box, post = [], []  # t_box: ranges on the transposed HF tensor; post: slices after reshape
  ax = 0
  for j in range(len(leaf.hf_shape)):
    if leaf.split is not None and j == leaf.split[0]:
      (h0, h1), (d0, d1) = rest[ax], rest[ax + 1]
      m = leaf.split[1][1]
      t_box.append((h0 * m, h1 * m))
      post += [slice(None), slice(d0, d1)]
      ax += 2
    else:
      t_box.append(rest[ax])
      post.append(slice(None))
      ax += 1
  hf_box = t_box[::-1] if leaf.transpose else t_box
  index = tuple(slice(a, b) for a, b in hf_box)
  parts = []
  for i in layers:
    x = np.asarray(get_slice(leaf.names[i])[index])
    if leaf.transpose:
      x = x.T
    if leaf.split is not None:
      j = leaf.split[0]
      x = x.reshape(x.shape[:j] + (x.shape[j] // leaf.split[1][1], leaf.split[1][1])
                    + x.shape[j + 1:])
    parts.append(x[tuple(post)])
  return np.stack(parts) if leaf.stacked else parts[0]


class _Files:
  """The safetensors files of a checkpoint dir: name -> file, with header checks.

  Handles (memory maps) are open only inside `session()`; the loader opens one
  session per leaf, so the file-backed pages a process has touched are released
  (unmapped) leaf by leaf instead of accumulating to the whole file.
  """

  def __init__(self, path: pathlib.Path):
    self.files = hf_loader.safetensors_files(path)
    self.where: dict = {}
    self.handles: dict = {}
    with self.session():
      for f in self.files:
        for name in self.handles[f].keys():
          if name in self.where:
            raise ValueError(f'{f}: tensor {name} also appears in {self.where[name]}')
          self.where[name] = f
    index = path / 'model.safetensors.index.json'
    if index.is_file():
      weight_map = json.loads(index.read_text())['weight_map']  # validated by safetensors_files
      wrong = sorted(n for n, w in weight_map.items() if self.where.get(n) != str(path / w))
      if wrong:
        n = wrong[0]
        raise ValueError(f'{index}: {len(wrong)} tensor(s) not in the shard the index names, e.g. '
                         f'{n} -> {weight_map[n]} (found in: {self.where.get(n, "no file")})')

  @contextlib.contextmanager
  def session(self):
    with contextlib.ExitStack() as stack:
      for f in self.files:
        try:
          self.handles[f] = stack.enter_context(safe_open(f, framework='numpy'))
        except Exception as e:  # SafetensorError / OSError on truncated or corrupt files
          raise ValueError(f'{f}: not a readable safetensors file (truncated or corrupt?): '
                           f'{type(e).__name__}: {e}') from e
      try:
        yield self
      finally:
        self.handles = {}

  def get_slice(self, name: str):
    f = self.where[name]
    try:
      return self.handles[f].get_slice(name)
    except Exception as e:
      raise ValueError(f'{f}: cannot read tensor {name}: {type(e).__name__}: {e}') from e

  def equal(self, a: str, b: str, rows: int = 4096) -> bool:
    """Whether 2-D tensors a and b are equal, compared `rows` rows at a time."""
    sa, sb = self.get_slice(a), self.get_slice(b)
    if list(sa.get_shape()) != list(sb.get_shape()):
      return False
    n = sa.get_shape()[0]
    return all(np.array_equal(np.asarray(sa[i:min(i + rows, n)]),
                              np.asarray(sb[i:min(i + rows, n)])) for i in range(0, n, rows))

  def check(self, table: dict, cfg, source: str, redundant=()):
    """Strict accounting (as `hf_layout.to_params`) plus each tensor's shape and dtype."""
    missing = [n for n in hf_layout._names(cfg) if n not in self.where]
    if missing:
      raise ValueError(f'{source} lacks {len(missing)} tensors, e.g. {missing[:3]}')
    extra = hf_layout.unread(self.where, cfg, redundant)
    if extra:
      raise ValueError(f'{source} has {len(extra)} tensors the config does not use (so the model '
                       f'would compute something else): {extra[:8]}')
    for leaf in table.values():
      for name in leaf.names:
        sl = self.get_slice(name)
        shape, dt = tuple(sl.get_shape()), sl.get_dtype()
        if shape != tuple(leaf.hf_shape):
          raise ValueError(f'{self.where[name]}: {name}: expected shape {tuple(leaf.hf_shape)}, '
                           f'got {shape}')
        if dt not in FLOAT_DTYPES:
          raise ValueError(f'{self.where[name]}: {name} has dtype {dt}; only float tensors '
                           f'({", ".join(FLOAT_DTYPES)}) are supported (quantized checkpoint?)')

  def dtypes(self, table: dict) -> set:
    return {self.get_slice(n).get_dtype() for leaf in table.values() for n in leaf.names}


def place(leaf: Leaf, sharding, get_slice, out_dtype) -> jax.Array:
  """The leaf as a global jax.Array with `sharding`, built from this process's devices only.

  What `jax.make_array_from_callback(leaf.shape, sharding, cb)` does, with `cb` =
  `read_box` of the device's global index, except that each distinct shard is read
  once (replicas over 'data' share it), cast and transferred before the next one is
  read: make_array_from_callback gathers all of a leaf's host shards first (measured:
  a whole float32 leaf, 0.8 GiB for a 1B model's stacked MLP kernel).
  """
  by_box: dict = {}
  indices = sharding.addressable_devices_indices_map(leaf.shape)
  for device, index in indices.items():
    by_box.setdefault(_norm(index, leaf.shape), []).append(device)
  on_device = {}
  for box, devices in by_box.items():
    host = read_box(leaf, box, get_slice).astype(out_dtype, copy=False)
    for device in devices:
      on_device[device] = jax.device_put(host, device)
    jax.block_until_ready([on_device[d] for d in devices])
    del host
  return jax.make_array_from_single_device_arrays(
      leaf.shape, sharding, [on_device[d] for d in indices])


_SAFETENSORS_NP = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
                   'BF16': jnp.bfloat16}


def load_hf_dir_sharded(path: str | os.PathLike, mesh: jax.sharding.Mesh, *, max_len: int,
                        param_dtype: Any = jnp.float32, dtype: Any = jnp.float32,
                        remat: bool = False, shardings: Any = None):
  """HF directory -> (params as global jax.Arrays on `mesh`, cfg, parsed config.json).

  max_len / dtype (compute dtype) / remat: as `hf_loader.load_hf_dir`.
  param_dtype: dtype placed on the devices, float32 by default (what the loop trains
  with, bit-identical to `load_hf_dir`); None keeps the checkpoint's dtype (all its
  weights must then share one). shardings: a params-shaped pytree of shardings;
  default `train_step.param_sharding` over `mesh` (the loop's, no resharding needed).
  Errors name the file: missing shards, corrupt files, wrong shapes, unread tensors.
  A tied config with a different stored head loads it untied (`hf_layout.tied_head`).
  """
  from experiments.training import train_step as ts  # not at import: keeps models/ light

  path = pathlib.Path(path)
  where = str(path / 'config.json')
  hf = hf_loader.read_config(path / 'config.json')
  cfg = hf_loader.config_from_hf(hf, max_len=max_len, dtype=dtype, remat=remat, where=where)
  files, source = _Files(path), f'{path} (*.safetensors)'
  with files.session():
    cfg, redundant = hf_layout.tied_head(
        cfg, files.where, lambda: files.equal(hf_layout.EMBED, hf_layout.HEAD), source)
    table = leaf_table(cfg)
    files.check(table, cfg, source=source, redundant=redundant)
    kinds = files.dtypes(table)
  if param_dtype is None:
    if len(kinds) != 1:
      raise ValueError(f'{path}: param_dtype=None keeps the checkpoint dtype, but its weights '
                       f'mix {sorted(kinds)}; pass a param_dtype')
    out_dtype = np.dtype(_SAFETENSORS_NP[next(iter(kinds))])
  else:
    out_dtype = np.dtype(param_dtype)
  abstract = _unflatten({p: jax.ShapeDtypeStruct(l.shape, out_dtype) for p, l in table.items()})
  if shardings is None:
    shardings = ts.param_sharding(abstract, mesh)
  flat_sh = dict(_flatten(shardings))
  if set(flat_sh) != set(table):
    raise ValueError(f'shardings tree has leaves {sorted(flat_sh)}, params have {sorted(table)}')
  params = {}
  for p, leaf in table.items():
    with files.session():
      params[p] = place(leaf, flat_sh[p], files.get_slice, out_dtype)
  return _unflatten(params), cfg, hf


def _flatten(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flatten(v, prefix + (k,))
  else:
    yield prefix, tree


def _unflatten(flat: dict) -> dict:
  out: dict = {}
  for p, v in flat.items():
    node = out
    for k in p[:-1]:
      node = node.setdefault(k, {})
    node[p[-1]] = v
  return out
