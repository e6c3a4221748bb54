"""Ahead-of-time compilation of the RL step for TPU topologies, on any host (no TPU needed).

    topo = aot.topology('v5e:4x4')                 # 16 chips on 4 hosts, from libtpu
    shape = aot.RLShape(rows=256, group_size=8, prompt_len=512, response_len=512, fsdp=4)
    result = aot.compile_rl_step(cfg, shape, topo)   # every piece lowered and compiled
    print(aot.format_report(result))

`jax.experimental.topologies.get_topology_desc` (libtpu, `pip install "jax[tpu]"`) gives
the devices of a real TPU slice, every host's included; `jax.jit(...).lower(<abstract
arrays with shardings over those devices>).compile()` then runs the TPU compiler from
this one process and yields per-chip memory (`memory_analysis`). The pieces of the RL
step are compiled as `experiments.training.rl_step` runs them, with the same public functions
(`experiments.training.forward`, `train_step`) and shardings:

  sample   the sampler's jitted stages (`experiments.rollouts.sampling`): uniforms,
           prefill (`_start`), the decode loop over the KV cache (`_decode`), and for
           tree samplers the fork policy, `_fork` and the children's decode
  pack     `forward.node_ids` and `trees.packing.pack_slots` (packed updates only)
  old_lp   `forward.rows_logprobs` with the policy (teacher-forced), flat or packed
  ref_lp   the same with the reference params
  credit   `forward.credit_fn` (the estimator, tree building included)
  update   `train_step.train_step_jit` on the batch, packed or flat rows

Each stage gets abstract inputs whose shardings are those the loop's arrays have: the
train state by `train_step.param_sharding` over ('data', 'fsdp', 'model')
(`shard_state`: fsdp, and with model > 1 the Megatron splits of `train_step.PARAM_AXES`),
prompts and batches by `batch_sharding` (rows over 'data' x 'fsdp') when the row count
divides those devices, the reference params like the policy's (`param_sharding`, as the
loop places them), the sampler traced under `jax.set_mesh(mesh)` as the loop runs it (so
`sampling.place_rows` splits the KV cache's rows over the mesh and its kv heads over
'model'), and every stage's outputs with the shardings the compiler gave the stage that
produced them.

A stage that does not fit (XLA's RESOURCE_EXHAUSTED) is recorded with the bytes the
error names, its arguments and its outputs (from `jax.eval_shape`, rows split over the
devices where they divide); the next stages compile on those outputs.

Per chip, memory of a stage = arguments + temporaries + outputs - aliased (donated)
bytes from XLA, plus the train state and reference params the loop holds while the
stage runs without taking them as arguments (e.g. Adam moments during sampling).
`cost_analysis` counts a scan or while body once, so FLOPs are analytic
(`stage_flops`) and the roofline times use vendor peak figures (`CHIPS`).

Sharding is the loop's: mesh ('data', 'fsdp', 'model') (`train_step.make_mesh`), the
decoder's activation layout (`decoder.ACTIVATION_RULES`), and tensor parallelism when
`RLShape.model` > 1.
"""

import dataclasses
import functools
import math
import os
import re
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

GIB = 2 ** 30
# Fraction of HBM a configuration may use and still count as fitting (XLA, the runtime
# and fragmentation need the rest).
FIT_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class Chip:
  """Vendor figures per chip (Google Cloud TPU documentation): HBM, peak bf16 dense
  FLOP/s and HBM bandwidth."""
  name: str
  hbm_bytes: float
  peak_flops: float
  hbm_bandwidth: float


CHIPS = {
    'v4': Chip('TPU v4', 32 * GIB, 275e12, 1.2e12),
    'v5e': Chip('TPU v5e', 16 * GIB, 197e12, 0.82e12),
    'v5p': Chip('TPU v5p', 95 * GIB, 459e12, 2.76e12),
    'v6e': Chip('TPU v6e', 32 * GIB, 918e12, 1.64e12),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A TPU slice: `devices` (jax devices, every host's), the chip generation's figures.

  `cores_per_chip` > 1 when libtpu lists each TensorCore of a chip as a device (v4 without
  megacore): per-device HBM and peaks are then the chip's divided by it.
  """
  name: str
  devices: tuple
  chip: Chip
  cores_per_chip: int

  @property
  def num_hosts(self) -> int:
    return len({d.process_index for d in self.devices})

  @property
  def device_hbm(self) -> float:
    return self.chip.hbm_bytes / self.cores_per_chip

  @property
  def device_flops(self) -> float:
    return self.chip.peak_flops / self.cores_per_chip

  @property
  def device_bandwidth(self) -> float:
    return self.chip.hbm_bandwidth / self.cores_per_chip


def quiet_libtpu():
  """Sets the environment that keeps libtpu's start-up quiet on a machine without TPUs."""
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5litepod-16')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  # Only a compile: another process holding libtpu's lock file (a test run, another
  # compile) must not stop this one.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')


def topology(name: str) -> Topology:
  """'v5e:4x4' -> its devices (from libtpu, no TPU needed) and chip figures.

  Raises ValueError for an unknown generation, ImportError without libtpu.
  """
  gen = name.split(':')[0]
  if gen not in CHIPS:
    raise ValueError(f'topology {name!r}: unknown TPU generation {gen!r}; valid: '
                     f'{", ".join(CHIPS)} (e.g. v5e:2x2, v5p:2x2x2)')
  try:
    import libtpu  # noqa: F401  (get_topology_desc needs it)
  except ImportError as e:
    raise ImportError('compiling for a TPU topology needs libtpu: pip install '
                      '"jax[tpu]>=0.10.2"') from e
  quiet_libtpu()
  from jax.experimental import topologies
  devices = tuple(topologies.get_topology_desc(topology_name=name, platform='tpu').devices)
  chips = len({tuple(d.coords) for d in devices})
  return Topology(name, devices, CHIPS[gen], len(devices) // chips)


def make_mesh(topo: Topology, fsdp: int = 1, model: int = 1) -> Mesh:
  """The loop's ('data', 'fsdp', 'model') mesh (`train_step.make_mesh`) over the
  topology's devices; model > 1 is tensor parallelism."""
  from experiments.training import train_step as ts
  if len(topo.devices) % (fsdp * model):
    raise ValueError(f'fsdp={fsdp} x model={model} does not divide the '
                     f'{len(topo.devices)} devices of {topo.name}')
  return ts.make_mesh(fsdp, devices=topo.devices, model=model)


# ----------------------------------------------------------------------------
# Model shapes: Hugging Face config.json contents (the published configs' shape fields).

MODELS = {
    # The decoder's default toy shape (2 layers, d 128), with a 16-token vocabulary.
    'toy': dict(model_type='llama', hidden_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, intermediate_size=336,
                vocab_size=16, rope_theta=10000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False),
    'smollm2-135m': dict(model_type='llama', hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    'qwen2.5-1.5b': dict(model_type='qwen2', hidden_size=1536, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                         vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    'qwen2.5-7b': dict(model_type='qwen2', hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                       vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    'llama-3.1-8b': dict(model_type='llama', hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                         vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False,
                         rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}


def model_config(model: str, *, max_len: int, dtype=jnp.float32, remat: bool = False,
                 lora_rank: int = 0):
  """(PolicyConfig, notes) for a built-in shape name (`MODELS`) or a config.json path,
  read through `hf_loader.config_from_hf`.

  A RoPE scaling the decoder does not implement (e.g. Llama 3.1's 'llama3') changes the
  rotation frequencies only, not shapes, memory or FLOPs: it is dropped with a note.
  """
  import json
  from experiments.models import hf_loader
  if model in MODELS:
    hf = dict(MODELS[model])
  elif os.path.isfile(model) or os.path.isfile(os.path.join(model, 'config.json')):
    path = model if os.path.isfile(model) else os.path.join(model, 'config.json')
    with open(path) as f:
      hf = json.load(f)
  else:
    raise ValueError(f'model {model!r} is neither a built-in shape ({", ".join(MODELS)}) nor '
                     f'a config.json file or directory')
  notes = []
  try:
    cfg = hf_loader.config_from_hf(hf, max_len=max_len, dtype=dtype, remat=remat)
  except NotImplementedError as e:
    if 'rope' not in str(e).lower():
      raise
    hf = {k: v for k, v in hf.items() if k not in ('rope_scaling',)}
    if isinstance(hf.get('rope_parameters'), dict):
      hf['rope_parameters'] = {k: v for k, v in hf['rope_parameters'].items()
                               if k in ('rope_theta',)}
    cfg = hf_loader.config_from_hf(hf, max_len=max_len, dtype=dtype, remat=remat)
    notes.append(f'compiled without RoPE scaling ({e}); it does not change shapes, memory '
                 f'or FLOPs')
  if lora_rank:
    cfg = dataclasses.replace(cfg, lora_rank=lora_rank)
  return cfg, notes


# ----------------------------------------------------------------------------
# Shapes of one RL step.


SAMPLERS = ('iid', 'tree_entropy', 'tree_fixed')


@dataclasses.dataclass(frozen=True)
class RLShape:
  """One RL step's sizes and update settings (the loop's config, reduced to shapes).

  rows: N = B * G responses per step (B = rows / group_size prompts). sampler: 'iid',
  'tree_entropy' (num_chains chains, num_forks forks each with num_continuations
  children; G = chains * (1 + forks * continuations)) or 'tree_fixed' (`branching`, forks
  every `segment_len` tokens; G = prod(branching)). packing: 'tree', 'prompt' or
  'none'; pack_len 0 = the largest bucket, P + G * L (nothing shared beyond the prompt).
  """
  rows: int = 16
  group_size: int = 4
  prompt_len: int = 32
  response_len: int = 32
  sampler: str = 'iid'
  num_chains: int = 2
  num_forks: int = 1
  num_continuations: int = 1
  branching: tuple = (2, 2)          # tree_fixed
  segment_len: int = 4               # tree_fixed
  fsdp: int = 1
  model: int = 1                     # tensor-parallel mesh axis (heads, MLP, vocabulary)
  micro_batches: int = 1
  minibatches: int = 1
  epochs: int = 1
  packing: str = 'tree'
  pack_len: int = 0
  pack_attention: str = 'auto'       # train.pack_attention (the loop's default), see packed_layout
  ref: bool = True
  recompute_logprobs: bool = True
  ref_sharding: str = 'policy'       # as the loop places it; or 'replicated' (to compare)
  credit: str = 'grpo'
  eos_id: int = 1
  compile_flat: bool = True          # with packing, also the flat log-probs and update
  decode_layout: Optional[str] = None  # the sampler's KV cache (`sampling.LAYOUTS`); None: its default

  @property
  def num_prompts(self) -> int:
    return self.rows // self.group_size

  def __post_init__(self):
    if self.sampler not in SAMPLERS:
      raise ValueError(f'sampler {self.sampler!r}: valid are {", ".join(SAMPLERS)}')
    if self.sampler == 'tree_fixed':
      if math.prod(self.branching) != self.group_size:
        raise ValueError(f'tree_fixed with branching {self.branching} has G = '
                         f'{math.prod(self.branching)}, not group_size {self.group_size}')
      if (len(self.branching) - 1) * self.segment_len >= self.response_len:
        raise ValueError(f'tree_fixed: its last level would start at or after response_len '
                         f'{self.response_len} ({len(self.branching)} levels of '
                         f'{self.segment_len} tokens)')
    if self.sampler == 'tree_entropy':
      g = self.num_chains * (1 + self.num_forks * self.num_continuations)
      if g != self.group_size:
        raise ValueError(f'tree_entropy with {self.num_chains} chains x (1 + {self.num_forks} '
                         f'forks x {self.num_continuations}) has G = {g}, not group_size '
                         f'{self.group_size}')
    if self.rows % self.group_size:
      raise ValueError(f'rows={self.rows} not divisible by group_size={self.group_size}')
    if self.packing not in ('tree', 'prompt', 'none'):
      raise ValueError(f'packing {self.packing!r}: valid are tree, prompt, none')
    if self.ref_sharding not in ('replicated', 'policy'):
      raise ValueError(f'ref_sharding {self.ref_sharding!r}: valid are replicated, policy')
    from trees import packing as packing_lib
    if self.pack_attention not in packing_lib.ATTENTION:
      raise ValueError(f'pack_attention {self.pack_attention!r}: valid are '
                       f'{", ".join(packing_lib.ATTENTION)}')
    if self.fsdp < 1 or self.model < 1:
      raise ValueError(f'fsdp={self.fsdp} and model={self.model} must be >= 1')
    from experiments.rollouts import sampling
    layouts = [x for x in sampling.LAYOUTS
               if self.sampler == 'tree_fixed' or x not in sampling.TREE_LAYOUTS]
    if self.decode_layout not in (None, *layouts):
      raise ValueError(f'decode_layout {self.decode_layout!r}: valid are '
                       f'{", ".join(layouts)} (or None: the sampler\'s default)')

  @property
  def full_pack_len(self) -> int:
    return self.pack_len or self.prompt_len + self.group_size * self.response_len


# ----------------------------------------------------------------------------
# Abstract arrays.


def sds(x, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def plain(tree):
  """Compiled `out_info` -> ShapeDtypeStructs with their shardings (layouts dropped)."""
  return jax.tree.map(lambda x: sds(x, x.sharding), tree)


def shard_like_loop(tree, mesh: Mesh):
  """Abstract leaves of a params tree or train state, placed as the loop places them
  (`train_step.param_sharding`, `shard_state`)."""
  from experiments.training import train_step as ts
  return jax.tree.map(sds, tree, ts.param_sharding(tree, mesh))


def rows_sharding(mesh: Mesh, n: int) -> NamedSharding:
  """The loop's placement of an [n, ...] host array: rows over 'data' x 'fsdp' when
  they divide (`batch_sharding`), else replicated."""
  from experiments.training import train_step as ts
  return ts.batch_sharding(mesh) if n % ts.row_shards(mesh) == 0 else NamedSharding(mesh, P())


def full_bytes(tree) -> int:
  """Bytes of the abstract arrays in `tree`, all of them (every device's shards together)."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def chip_bytes(tree) -> int:
  """Bytes of one device's shards of the abstract arrays in `tree`."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def largest_leaves(tree, k: int = 3, prefix: str = ''):
  """[(name, global shape, dtype, per-chip bytes, spec)] of the k largest leaves per chip."""
  out = []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    b = math.prod(shape) * np.dtype(x.dtype).itemsize
    spec = getattr(x.sharding, 'spec', None)
    out.append((prefix + jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), b, spec))
  return sorted(out, key=lambda r: -r[3])[:k]


# ----------------------------------------------------------------------------
# Analytic FLOPs and HBM traffic (cost_analysis counts a scanned body once).


def matmul_params(cfg) -> dict:
  """Multiply-accumulate weights per token: 'layer' (all blocks) and 'head' (d * V)."""
  d, h, k, dh, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
  proj = [(d, h * dh), (d, k * dh), (d, k * dh), (h * dh, d), (d, f), (d, f), (f, d)]
  per = sum(a * b for a, b in proj)
  if cfg.lora_rank:
    per += sum(cfg.lora_rank * (a + b) for a, b in proj)
  return dict(layer=cfg.num_layers * per, head=d * cfg.vocab_size)


def attention_flops(cfg, queries: float, keys: float) -> float:
  """QK^T and PV over all layers: 4 * H * Dh FLOPs per (query, key) pair per layer."""
  return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * queries * keys


def forward_flops(cfg, tokens, logit_rows, pairs_executed, pairs_model):
  """(executed, model) FLOPs of one forward: 2 * weights * tokens + the head on
  `logit_rows` + attention on `pairs_*` (query, key) pairs."""
  w = matmul_params(cfg)
  dense = 2.0 * w['layer'] * tokens + 2.0 * w['head'] * logit_rows
  return (dense + attention_flops(cfg, 1, pairs_executed),
          dense + attention_flops(cfg, 1, pairs_model))


def packed_layout(shape: RLShape, pack_len: int, backend: str = 'tpu') -> tuple:
  """(attention, block, num_pairs) of the compiled packing, as `trees.packing.pack` picks
  them for a batch with nothing shared past the prompt: 'blocks' / 'auto' take block =
  `default_block(T, backend)` and the group's block pairs (`iid_block_pairs`, bucketed by
  `pair_bucket`); 'auto' falls back to 'paths' where `block_costs(backend)` rates it cheaper.
  A tree batch shares more and needs fewer pairs, so this bounds what the loop compiles."""
  from trees import packing as packing_lib
  if shape.pack_attention in ('paths', 'mask'):
    return shape.pack_attention, 0, 0
  g, p, l = shape.group_size, shape.prompt_len, shape.response_len
  costs = packing_lib.block_costs(backend)
  blk = packing_lib.default_block(pack_len, backend)
  t = max(pack_len, p + g * l)  # a shorter pack_len shares more: this bounds its pairs
  nb = -(-pack_len // blk)
  pairs = min(packing_lib.pair_bucket(packing_lib.iid_block_pairs(p, g, l, blk, t),
                                      -(-t // blk)), nb * (nb + 1) // 2)
  if shape.pack_attention == 'auto' and (
      pairs * (blk * blk + costs.overhead * blk) >= costs.paths_weight * g * (p + l) ** 2):
    return 'paths', 0, 0
  return 'blocks', blk, pairs


def packed_pairs(shape: RLShape, pack_len: int, backend: str = 'tpu') -> float:
  """(query, key) pairs the packed forward computes over the batch's groups, per layer:
  'paths' G * S^2 per group, 'mask' T^2, 'blocks' (and 'auto' where it picks blocks)
  num_pairs * block^2 of `packed_layout`."""
  b, g = shape.num_prompts, shape.group_size
  attention, blk, pairs = packed_layout(shape, pack_len, backend)
  if attention == 'paths':
    return float(b * g * (shape.prompt_len + shape.response_len) ** 2)
  if attention == 'mask':
    return float(b * pack_len ** 2)
  return float(b * pairs * blk * blk)


def teacher_forcing_flops(cfg, shape: RLShape, pack_len: Optional[int] = None) -> dict:
  """Executed FLOPs of one teacher-forced forward over the batch, split into 'dense'
  (block matmuls + vocab head) and 'attention' (QK^T and PV), for flat rows ('flat') and,
  with packing, the packed rows ('packed'); 'dense_saving' = 1 - packed / flat dense."""
  b, g, p, l = shape.num_prompts, shape.group_size, shape.prompt_len, shape.response_len
  w = matmul_params(cfg)
  n, t = b * g, p + l - 1
  split = lambda tokens, rows, pairs: dict(
      dense=2.0 * w['layer'] * tokens + 2.0 * w['head'] * rows,
      attention=attention_flops(cfg, 1, pairs))
  out = dict(flat=split(n * t, n * l, n * t * t))
  if shape.packing != 'none':
    tp = pack_len or shape.full_pack_len
    out['packed'] = split(b * tp, b * (tp - p + 1), packed_pairs(shape, tp))
    out['dense_saving'] = 1.0 - out['packed']['dense'] / out['flat']['dense']
  return out


def stage_flops(cfg, shape: RLShape, pack_len: Optional[int] = None) -> dict:
  """Analytic (executed, model) FLOPs of each piece of the RL step, whole slice.

  Executed FLOPs are what the implementation computes: attention over every cache slot
  S = P + L in prefill and decode, dense causal [T, T] scores in teacher forcing (masked
  half included; packed: `packed_pairs`), the vocab head on every prefill position.
  Model FLOPs count only visible (causal) pairs and the head where a token is scored
  (`teacher_forcing_flops` splits the forward into dense and attention). Decode loops
  are counted to their bound (every row runs L steps; tree children L from their fork).
  Training: forward + backward = 3 forwards (4 with remat; LoRA: 2, frozen weights get
  no gradient, +1 with remat), per epoch.
  """
  b, g, p, l = shape.num_prompts, shape.group_size, shape.prompt_len, shape.response_len
  s = p + l
  out = {}
  # Sampler: prefill B prompts over S slots, then R rows x L decode steps over S slots
  # (tree_fixed: each level's rows over its steps).
  pre = forward_flops(cfg, b * p, b * p, b * p * s, b * p * (p + 1) / 2)
  if shape.sampler == 'tree_fixed':
    levels = tree_levels(shape)
    steps = sum(r * (t1 - t0) for r, t0, t1 in levels)
    pairs = sum(r * (t1 - t0) * (p + (t0 + t1 + 1) / 2) for r, t0, t1 in levels)
  else:
    steps = b * g * l  # chains, then the children (from their fork: counted to L)
    pairs = steps * (p + (l + 1) / 2)
  dec = forward_flops(cfg, steps, steps, steps * s, pairs)
  pre_model = forward_flops(cfg, b * p, b, 0, b * p * (p + 1) / 2)[1]  # head: last position
  out['sample'] = (pre[0] + dec[0], pre_model + dec[1])
  # Teacher forcing over flat rows: T = P + L - 1 tokens each, head on L positions.
  n, t = b * g, s - 1
  flat = forward_flops(cfg, n * t, n * l, n * t * t, n * t * (t + 1) / 2)
  if shape.packing != 'none':
    tp = pack_len or shape.full_pack_len
    pairs = packed_pairs(shape, tp)
    # Model FLOPs stay the flat rows' (the standard accounting of the rollout tokens), so
    # the MFU bounds of packed and flat layouts compare; packing shows as a shorter time.
    packed = (forward_flops(cfg, b * tp, b * (tp - p + 1), pairs, 0)[0], flat[1])
  else:
    packed = None
  fwd = packed if packed is not None else flat
  lps = int(shape.recompute_logprobs) + int(shape.ref)
  out['logprobs'] = (lps * fwd[0], lps * fwd[1])
  mult = (2 if cfg.lora_rank else 3) + int(cfg.remat)
  model_mult = 2 if cfg.lora_rank else 3
  out['update'] = (shape.epochs * mult * fwd[0], shape.epochs * model_mult * fwd[1])
  if packed is not None:
    out['update_flat'] = (shape.epochs * mult * flat[0], shape.epochs * model_mult * flat[1])
  return out


def tree_levels(shape: RLShape) -> list:
  """tree_fixed's levels as (rows, first response index, stop): level j's B * prod(b_0..b_j)
  rows decode [j * segment_len, (j + 1) * segment_len), the last level to L."""
  n, seg = len(shape.branching), shape.segment_len
  return [(shape.num_prompts * math.prod(shape.branching[:j + 1]), j * seg,
           shape.response_len if j == n - 1 else (j + 1) * seg) for j in range(n)]


def tree_slots_read(cfg, shape: RLShape, layout: Optional[str] = None) -> int:
  """KV slots a whole tree_fixed decode reads, summed over its steps: per step each group's
  prompt once ('cascade', 'cascade_tree') or per row ('rows': P + L a row), each row's own
  slots up to the end of the step's phase (`sampling.decode_windows`: over L for 'cascade',
  over the level's own slots for 'cascade_tree'), and with 'cascade_tree' each tree node's
  segment once (one shared level per tree level) instead of once per leaf."""
  from experiments.rollouts import sampling
  layout = decode_layout(shape, layout)
  b, p, l, seg = shape.num_prompts, shape.prompt_len, shape.response_len, shape.segment_len
  levels, total = tree_levels(shape), 0
  for j, (rows, t0, t1) in enumerate(levels):
    if layout == 'rows':
      total += (t1 - t0) * rows * (p + l)
      continue
    own = sampling.tree_own_lens(len(shape.branching), seg, l)[j] if layout == 'cascade_tree' \
        else l
    offset = t0 if layout == 'cascade_tree' else 0
    ends = sampling.decode_windows(cfg, own)
    window = lambda t: min(e for e in ends if e > t - offset)  # own slots step t reads
    shared = b * p + (sum(rows_i * seg for rows_i, _, _ in levels[:j])
                      if layout == 'cascade_tree' else 0)
    total += sum(shared + rows * window(t) for t in range(t0, t1))
  return total


def cache_slots(shape: RLShape, layout: Optional[str] = None) -> tuple:
  """The sampler's KV-cache slots as ((rows, slots per row), ...): B * G rows of P + L
  ('rows'), or B prompts of P and B * G rows of L ('cascade', the default: issue 41), or
  with 'cascade_tree' (tree_fixed) B prompts of P, each tree level's nodes of segment_len but
  the last's, and B * G leaves of L - (levels - 1) * segment_len; `layout` None: the shape's
  `decode_layout`."""
  b, g, p, l = shape.num_prompts, shape.group_size, shape.prompt_len, shape.response_len
  layout = decode_layout(shape, layout)
  if layout == 'rows':
    return ((b * g, p + l),)
  if layout == 'cascade_tree':
    *inner, (rows, t0, _) = tree_levels(shape)
    return ((b, p),) + tuple((r, shape.segment_len) for r, _, _ in inner) + ((rows, l - t0),)
  return ((b, p), (b * g, l))


def mean_own_slots(cfg, length: int, layout: str) -> float:
  """Own slots a decode step reads, averaged over the L = length steps: L without phases
  ('rows', or a window of 0), else sum over phases of (steps x window) / L
  (`sampling.decode_windows`)."""
  from experiments.rollouts import sampling
  ends = sampling.decode_windows(cfg, length, layout == 'cascade')
  return sum((e - s) * e for s, e in zip((0,) + ends[:-1], ends)) / length


def decode_hbm_bytes(cfg, shape: RLShape, mesh: Mesh, param_bytes_full: float,
                     layout: Optional[str] = None) -> float:
  """HBM bytes per device of one decode (L steps), a lower bound: each step reads the
  device's 'model' slice of the weights and its share of the KV cache (rows over data x
  fsdp, kv heads over model): every prefix slot, and the rows' own slots up to the end of
  the step's phase (`mean_own_slots`)."""
  layout = decode_layout(shape, layout)
  slot = 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
  if shape.sampler == 'tree_fixed':
    return (shape.response_len * param_bytes_full / shape.model +
            tree_slots_read(cfg, shape, layout) * slot / mesh.size)
  *prefix, (rows, own) = cache_slots(shape, layout)
  slots = sum(r * n for r, n in prefix) + rows * mean_own_slots(cfg, own, layout)
  return shape.response_len * (param_bytes_full / shape.model + slots * slot / mesh.size)


def stage_hbm_bytes(cfg, shape: RLShape, mesh: Mesh, state_bytes_chip: int,
                    param_bytes_full: int) -> dict:
  """Lower bound on HBM bytes each device reads or writes per piece (activations ignored).

  Every device reads its 'model' slice of the weights (all of them when model = 1),
  all-gathered over 'fsdp', once per forward and per decode step, and its share of the KV
  cache per decode step (`decode_hbm_bytes`); an update reads the
  weights 3 (4 with remat) times per micro-batch and its shard of params, grads and Adam
  moments about 7 times.
  """
  weights = param_bytes_full / shape.model
  decode = decode_hbm_bytes(cfg, shape, mesh, param_bytes_full)
  lps = int(shape.recompute_logprobs) + int(shape.ref)
  micro = shape.minibatches * shape.micro_batches * shape.epochs
  upd = micro * (3 + int(cfg.remat)) * weights + (
      shape.minibatches * shape.epochs * 7 * state_bytes_chip / 3)
  return dict(sample=weights + decode * (2 if shape.sampler == 'tree_entropy' else 1),
              logprobs=lps * weights, update=upd, update_flat=upd)


# ----------------------------------------------------------------------------
# Compiling stages.


@dataclasses.dataclass
class Stage:
  """One compiled program: per-device memory from XLA and its compile time."""
  name: str
  piece: str
  compile_s: float
  argument: int
  temp: int
  output: int
  alias: int
  outside: int            # train state / ref params held by the loop, not arguments
  scaled: int             # bytes of the resident trees split over 'fsdp' (in the total)
  largest_args: list
  largest_temps: list = dataclasses.field(default_factory=list)
  error: str = ''         # XLA's RESOURCE_EXHAUSTED message when it did not fit
  input_shardings: Any = None  # the compiled program's, a tree like its arguments

  @property
  def total(self) -> int:
    return self.argument + self.temp + self.output - self.alias + self.outside


_BUF = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = (pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|'
                  r'f16|f32|f64)\[([\d,]*)\]')
_ITEM = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8,
             u64=8, f64=8)


def largest_buffers(hlo_text: str, k: int = 3):
  """[(instruction, dtype[shape], bytes)] of the k largest per-device arrays produced
  outside fusions in an optimized (SPMD-partitioned) HLO module: a guide to the
  temporaries XLA does not name in `memory_analysis`."""
  found, inside_fusion = {}, False
  for line in hlo_text.splitlines():
    if line and not line.startswith(' '):
      inside_fusion = line.lstrip('%').startswith(('fused', '%fused')) or ' fused' in line[:40]
      continue
    if inside_fusion:
      continue
    m = _BUF.match(line)
    if m and not any(op in line for op in (' parameter(', ' get-tuple-element(', ' bitcast(',
                                           ' constant(')):
      dims = [int(x) for x in m.group(3).split(',') if x]
      size = math.prod(dims) * _ITEM[m.group(2)]
      key = f'{m.group(2)}[{m.group(3)}]'
      if size > found.get(key, ('', 0))[1]:
        found[key] = (m.group(1), size)
  rows = sorted(((v[0], key, v[1]) for key, v in found.items()), key=lambda r: -r[2])
  return rows[:k]


class Compiler:
  """Lowers and compiles jitted functions on abstract arguments; records a `Stage` each.

  Identical (function, abstract arguments, static arguments) compile once.
  """

  def __init__(self, resident: dict, scaling=(), verbose: bool = False):
    self.stages: list[Stage] = []
    self.resident = resident   # name -> abstract tree the loop holds on the devices
    self.scaling = tuple(scaling)  # the resident trees split over 'fsdp' x 'model'
    self._cache = {}
    self.verbose = verbose

  def __call__(self, name: str, piece: str, fn, args: tuple, static: dict, takes=()):
    """Compiles fn(*args, **static) -> abstract outputs (with the compiled shardings).

    `takes`: names of `resident` trees passed as arguments (the others count as outside).
    """
    key = (id(fn), repr(jax.tree.map(
        lambda x: (x.shape, x.dtype, x.sharding) if hasattr(x, 'shape') else x, args)),
           repr(sorted(static.items())), tuple(takes))
    if key in self._cache:
      out, stage = self._cache[key]
      self.stages.append(dataclasses.replace(stage, name=name, piece=piece, compile_s=0.0))
      return out
    t0 = time.perf_counter()
    outside = sum(chip_bytes(v) for k, v in self.resident.items() if k not in takes)
    scaled = sum(chip_bytes(v) for k, v in self.resident.items() if k in self.scaling)
    arrays = [x for x in jax.tree.leaves(args) if hasattr(x, 'sharding')]
    try:
      compiled = fn.lower(*args, **static).compile()
    except jax.errors.JaxRuntimeError as e:
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      return self._failed(key, name, piece, fn, args, static, str(e), outside, scaled,
                          arrays, time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    stage = Stage(name=name, piece=piece, compile_s=dt, argument=mem.argument_size_in_bytes,
                  temp=mem.temp_size_in_bytes, output=mem.output_size_in_bytes,
                  alias=mem.alias_size_in_bytes, outside=outside, scaled=scaled,
                  largest_args=largest_leaves(arrays),
                  largest_temps=largest_buffers(compiled.as_text()),
                  input_shardings=compiled.input_shardings[0])
    if self.verbose:
      print(f'  compiled {name} in {dt:.1f} s', flush=True)
    out = plain(compiled.out_info)
    self._cache[key] = (out, stage)
    self.stages.append(stage)
    return out

  def _failed(self, key, name, piece, fn, args, static, error, outside, scaled, arrays, dt):
    """Records a stage XLA could not fit: its arguments, its outputs (eval_shape, rows
    split over the devices where they divide) and the bytes the error names."""
    mesh = next(x.sharding.mesh for x in arrays if isinstance(x.sharding, NamedSharding))
    out = jax.tree.map(lambda x: sds(x, _split_first(mesh, x.shape)),
                       jax.eval_shape(functools.partial(fn, **static), *args))
    argument, output = chip_bytes(arrays), chip_bytes(out)
    used, temp = error_bytes(error)
    temp = temp or max(used - argument - output, 0)
    msg = ' '.join(error.split())[:300]
    stage = Stage(name=name, piece=piece, compile_s=dt, argument=argument, temp=temp,
                  output=output, alias=0, outside=outside, scaled=scaled,
                  largest_args=largest_leaves(arrays), error=msg,
                  largest_temps=[(n, f'{d}{list(sh)} {spec}', b) for n, sh, d, b, spec
                                 in largest_leaves(out, prefix='output')])
    if self.verbose:
      print(f'  {name} does not fit ({dt:.1f} s): {msg}', flush=True)
    self._cache[key] = (out, stage)
    self.stages.append(stage)
    return out


def _split_first(mesh: Mesh, shape) -> NamedSharding:
  """The first axis that 'data' x 'fsdp' divide split over them (rows of a batch, or of
  a KV cache [layers, rows, ...]); replicated if none does. For outputs of a stage that
  did not compile."""
  from experiments.training import train_step as ts
  for ax, n in enumerate(shape):
    if n % ts.row_shards(mesh) == 0 and n > 1:
      spec = [None] * len(shape)
      spec[ax] = ts.ROW_AXES
      return NamedSharding(mesh, P(*spec))
  return NamedSharding(mesh, P())


_UNIT = dict(K=2 ** 10, M=2 ** 20, G=2 ** 30, T=2 ** 40)


def _bytes(num: str, unit: str) -> int:
  return int(float(num) * _UNIT.get(unit, 1))


def error_bytes(error: str):
  """(bytes used in all, bytes of temporaries) per device that an XLA:TPU
  RESOURCE_EXHAUSTED message names ('Used 26.58G of 15.75G hbm'; 'the total memory
  required for HLO temporaries (20.45G) exceeds ...'); 0 for what it does not name."""
  used = re.search(r'Used ([\d.]+)([KMGT]?) of', error)
  temp = re.search(r'temporaries \(([\d.]+)([KMGT]?)\)', error)
  return (_bytes(*used.groups()) if used else 0, _bytes(*temp.groups()) if temp else 0)


def _rep(mesh, shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def _like_rows(mesh, x, shape):
  """An eager op's output in the loop (reshape of a row-sharded array): rows over the
  devices when they divide, else replicated."""
  return jax.ShapeDtypeStruct(shape, x.dtype, sharding=rows_sharding(mesh, shape[0]))


def decode_layout(shape: RLShape, layout: Optional[str] = None) -> str:
  """`layout`, else the shape's `decode_layout`, else the sampler's default (tree_fixed's:
  'cascade_tree' where the default is 'cascade', as `sampling.sample_tree_fixed`)."""
  from experiments.rollouts import sampling
  default = sampling.DEFAULT_LAYOUT
  if shape.sampler == 'tree_fixed' and default == 'cascade':
    default = 'cascade_tree'
  return layout or shape.decode_layout or default


def compile_sampler(c: Compiler, params, cfg, shape: RLShape, mesh: Mesh, prompts, plen):
  """The sampler's stages as `sampling.sample_iid` / `sample_tree_forks` chain them (or
  `sample_tree_fixed`'s one program), the KV cache in the shape's `decode_layout`."""
  from experiments.rollouts import sampling
  b, l, g = shape.num_prompts, shape.response_len, shape.group_size
  key = _rep(mesh, (2,), jnp.uint32)
  ids = _rep(mesh, (b,), jnp.int32)
  knobs = dict(temperature=_rep(mesh, (), jnp.float32), top_k=_rep(mesh, (), jnp.int32),
               top_p=_rep(mesh, (), jnp.float32))
  n = dict(iid=g, tree_entropy=shape.num_chains).get(shape.sampler, g)
  tk = ('params',)
  u = c('uniforms', 'sample', sampling._uniforms_jit,
        (key, ids, _rep(mesh, (n,), jnp.int32)), dict(length=l))
  if shape.sampler == 'tree_fixed':  # one program, as `sampling.sample_tree_fixed` runs it
    return c('tree (_tree_fixed)', 'sample', sampling._tree_fixed, (params, prompts, u, plen,
                                                                    knobs),
             dict(cfg=cfg, branching=tuple(shape.branching), segment_len=shape.segment_len,
                  eos_id=shape.eos_id, pad_id=0, layout=decode_layout(shape)), takes=tk)
  state = c('prefill (_start)', 'sample', sampling._start, (params, prompts, u, plen),
            dict(cfg=cfg, pad_id=0, layout=decode_layout(shape)), takes=tk)
  state = c('decode (_decode)', 'sample', sampling._decode, (params, state, l, knobs),
            dict(cfg=cfg, eos_id=shape.eos_id), takes=tk)
  if shape.sampler == 'iid':
    return c('to_samples', 'sample', sampling._to_samples, (state, b), {})
  chains = c('to_samples', 'sample', sampling._to_samples, (state, b), {})
  policy = sampling.EntropyForks(shape.num_forks, shape.num_continuations)
  source, position = c('fork policy', 'sample', sampling._apply_policy, (policy, chains), {})
  k = source.shape[1]
  u2 = c('uniforms (children)', 'sample', sampling._uniforms_jit,
         (key, ids, _rep(mesh, (k,), jnp.int32)), dict(length=l))
  rows = c('children rows', 'sample', sampling._children_rows, (source, shape.num_chains), {})
  children = c('fork (_fork)', 'sample', sampling._fork,
               (state, rows, _like_rows(mesh, position, (b * k,)),
                _like_rows(mesh, u2, (b * k, l))), dict(pad_id=0))
  children = c('decode children (_decode)', 'sample', sampling._decode,
               (params, children, l, knobs), dict(cfg=cfg, eos_id=shape.eos_id), takes=tk)
  return c('finish forks', 'sample', sampling._finish_forks,
           (chains, children, source, position), {})


def abstract_state(cfg, mesh: Mesh, lr: float = 1e-6):
  """The loop's TrainState (params + AdamW state) as abstract arrays, placed as
  `shard_state` places them."""
  from experiments.models import decoder
  from experiments.training import train_step as ts
  tx = ts.make_optimizer(lr, lora_only=cfg.lora_rank > 0)
  state = jax.eval_shape(lambda: ts.init_state(decoder.init_params(jax.random.PRNGKey(0), cfg),
                                               tx))
  return shard_like_loop(state, mesh)


@dataclasses.dataclass
class Result:
  cfg: Any
  shape: RLShape
  topo: Topology
  mesh: Mesh
  stages: list
  flops: dict            # piece -> (executed, model), whole slice
  hbm: dict              # piece -> bytes per device (lower bound)
  num_params: int
  state_chip_bytes: int
  param_fraction: float  # bytes of the params on one device / all the params' bytes
  param_specs: Any
  pack_len: int
  packed: bool


def compile_rl_step(cfg, shape: RLShape, topo: Topology, verbose: bool = False) -> Result:
  """Lowers and compiles every piece of one RL step (see the module docstring).

  `cfg`: a `decoder.PolicyConfig` with max_len >= P + L. The mesh is ('data', 'fsdp',
  'model') with shape.fsdp and shape.model (`train_step.check_model_axis` refuses a
  model size the heads, MLP or vocabulary cannot split).
  """
  from experiments.models import decoder
  from experiments.training import forward, train_step as ts
  if shape.prompt_len + shape.response_len > cfg.max_len:
    raise ValueError(f'prompt_len + response_len = {shape.prompt_len + shape.response_len} > '
                     f'cfg.max_len = {cfg.max_len}')
  ts.check_model_axis(cfg, shape.model)
  mesh = make_mesh(topo, shape.fsdp, shape.model)
  state = abstract_state(cfg, mesh)
  params = state.params
  if shape.ref_sharding == 'policy':
    ref = params
  else:
    ref = jax.tree.map(lambda x: sds(x, NamedSharding(mesh, P())), params)
  need_ref = shape.ref
  resident = dict(params=params, opt_state=(state.opt_state, state.step, state.rng))
  if need_ref:
    resident['ref_params'] = ref
  scaling = ('params', 'opt_state') + (('ref_params',) if shape.ref_sharding == 'policy' else ())
  c = Compiler(resident, scaling, verbose=verbose)
  b, p = shape.num_prompts, shape.prompt_len
  prompts = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=rows_sharding(mesh, b))
  plen = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows_sharding(mesh, b))
  with jax.set_mesh(mesh):  # as the loop samples (sampling.place_rows)
    samples = compile_sampler(c, params, cfg, shape, mesh, prompts, plen)

  packed, pack_len, variants = _compile_pack(c, shape, mesh, prompts, plen, samples)
  lp_out = None
  for pk in variants:
    tag = '' if pk is not None or not packed else ' (flat)'
    piece = 'logprobs' if not tag else 'logprobs_flat'
    args = (samples.tokens, samples.mask, plen, pk)
    lp_kw = dict(cfg=cfg, chunks=shape.minibatches * shape.micro_batches)
    old = (c('old log-probs' + tag, piece, forward.rows_logprobs, (params, prompts) + args,
             lp_kw, takes=('params',)) if shape.recompute_logprobs else samples.logprobs)
    ref_lp = (c('ref log-probs' + tag, piece, forward.rows_logprobs, (ref, prompts) + args,
                lp_kw, takes=('ref_params',)) if need_ref else None)
    lp_out = (old, ref_lp) if lp_out is None else lp_out
  old, ref_lp = lp_out
  rewards = jax.ShapeDtypeStruct(samples.parent.shape, jnp.float32,
                                 sharding=samples.parent.sharding)
  est = forward.credit_fn(shape.credit, '{}', shape.sampler != 'iid')
  adv, loss_mask = c('credit', 'credit', est,
                     (samples.tokens, samples.mask, rewards, samples.parent, samples.fork,
                      old, ref_lp), {})
  _compile_update(c, cfg, shape, mesh, state, variants, packed, prompts, plen, samples,
                  loss_mask, adv, old, ref_lp)
  flops = stage_flops(cfg, shape, pack_len)
  if packed:
    flops['logprobs_flat'] = stage_flops(cfg, dataclasses.replace(shape, packing='none'))[
        'logprobs']
  full_param_bytes = full_bytes(params)
  hbm = stage_hbm_bytes(cfg, shape, mesh, chip_bytes(state), full_param_bytes)
  hbm['logprobs_flat'] = hbm['logprobs']
  return Result(cfg=cfg, shape=shape, topo=topo, mesh=mesh, stages=c.stages, flops=flops,
                hbm=hbm, num_params=decoder.num_params(params),
                state_chip_bytes=chip_bytes(state),
                param_fraction=chip_bytes(params) / full_param_bytes,
                param_specs=jax.tree.map(lambda x: x.sharding.spec, params),
                pack_len=pack_len, packed=packed)


def _compile_pack(c, shape: RLShape, mesh, prompts, plen, samples):
  """(packed, pack_len, the update's layouts: [Packing] / [Packing, None] / [None]): the
  packing stages (`forward.node_ids`, `trees.packing.pack_slots`) when packing applies, as
  `forward.packing_applies` decides it for the loop."""
  from experiments.training import forward, train_step as ts
  from trees import packing as packing_lib
  b, p = shape.num_prompts, shape.prompt_len
  split = shape.minibatches * shape.micro_batches
  packed = shape.packing != 'none' and forward.packs_evenly(b, split, ts.row_shards(mesh))
  pack_len = shape.full_pack_len
  if not packed:
    return packed, pack_len, [None]
  node = c('node ids', 'pack', forward.node_ids, (samples.tokens, samples.mask),
           dict(mode=shape.packing))
  fields = c('pack (pack_slots)', 'pack', packing_lib.pack_slots,
             (prompts, plen, samples.tokens, samples.mask, node), dict(pack_len=pack_len))
  toks, pos, path, source, logit_row, num_slots = fields  # as `packing.pack` assembles them
  attention, block, num_pairs = packed_layout(shape, pack_len)
  pk = packing_lib.Packing(tokens=toks, positions=pos, path=path, source=source,
                           logit_row=logit_row, prompt_len=plen, num_slots=num_slots,
                           num_prompt_slots=p, attention=attention, block=block,
                           num_pairs=num_pairs)
  return packed, pack_len, [pk, None] if shape.compile_flat else [pk]


def _compile_update(c, cfg, shape: RLShape, mesh, state, variants, packed, prompts, plen,
                    samples, loss_mask, adv, old, ref_lp):
  """The update stage (`train_step.train_step_jit` on `train_step.batch_from_samples`'s
  batch), packed and / or flat rows."""
  from experiments.training import train_step as ts
  b, g = shape.num_prompts, shape.group_size
  loss_cfg = ts.LossConfig(num_epochs=shape.epochs, num_minibatches=shape.minibatches,
                           num_microbatches=shape.micro_batches,
                           kl_coef=0.01 if shape.ref else 0.0)
  for pk in variants:
    batch = jax.eval_shape(ts.batch_from_samples, prompts, samples.tokens, loss_mask, adv,
                           old, ref_lp, plen, pk)
    units = b if pk is not None else b * g
    batch = jax.tree.map(lambda x: sds(x, rows_sharding(mesh, units)), batch)
    name = 'update' if pk is not None or not packed else 'update (flat)'
    c(name, 'update' if name == 'update' else 'update_flat', ts.train_step_jit, (state, batch),
      dict(cfg=cfg, loss_cfg=loss_cfg), takes=('params', 'opt_state'))


# ----------------------------------------------------------------------------
# Report.


def piece_peak(result: Result, piece: str) -> Optional[Stage]:
  stages = [s for s in result.stages if s.piece == piece]
  return max(stages, key=lambda s: s.total) if stages else None


def rl_pieces(result: Result) -> list:
  """The pieces the loop runs in one step (packed variants when packing applies)."""
  return [p for p in ('sample', 'pack', 'logprobs', 'credit', 'update')
          if piece_peak(result, p) is not None]


def roofline(result: Result, piece: str):
  """(executed FLOPs per device, HBM bytes per device, roofline seconds) of a piece."""
  ex, _ = result.flops.get(piece, (0.0, 0.0))
  n = result.mesh.size
  f_dev = ex / n
  bytes_dev = result.hbm.get(piece, 0.0)
  t = max(f_dev / result.topo.device_flops, bytes_dev / result.topo.device_bandwidth)
  return f_dev, bytes_dev, t


def step_summary(result: Result) -> dict:
  """Whole-step figures: peak per-device memory, FLOPs, roofline time, MFU bound."""
  pieces = [p for p in rl_pieces(result) if p in result.flops]
  t = sum(roofline(result, p)[2] for p in pieces)
  model = sum(result.flops[p][1] for p in pieces)
  executed = sum(result.flops[p][0] for p in pieces)
  peak = max(result.stages, key=lambda s: s.total)
  mfu = model / (t * result.mesh.size * result.topo.device_flops) if t else 0.0
  return dict(peak=peak, executed_flops=executed, model_flops=model, roofline_s=t, mfu=mfu,
              compile_s=sum(s.compile_s for s in result.stages),
              fits=(peak.total <= FIT_FRACTION * result.topo.device_hbm
                    and not any(s.error for s in result.stages)))


def model_sizes(cfg, devices: int) -> list:
  """Tensor-parallel sizes (`model` axis) a slice of `devices` can use for cfg: those
  dividing the devices that `train_step.check_model_axis` accepts, ascending."""
  from experiments.training import train_step as ts
  out = []
  for m in range(1, devices + 1):
    if devices % m == 0:
      try:
        ts.check_model_axis(cfg, m)
      except ValueError:
        continue
      out.append(m)
  return out


def suggest_mesh(result: Result) -> Optional[str]:
  """A mesh estimated to fit, from how each stage's per-device bytes scale.

  The train state and parameter arguments scale as 1 / (fsdp x model) (they are split
  over both); everything else (rows, KV cache, activations) as 1 / devices when 'model'
  shrinks or stays, and as 1 / (data x fsdp) when it grows: rows are split over 'data' x
  'fsdp' and heads, MLP width and vocabulary over 'model', but the residual stream is
  whole on each 'model' device, so the estimate assumes no activation splits over a
  larger 'model' (pessimistic for heads and vocabulary, exact for the residual). Tries
  this slice, then 2x, 4x, ... 16x the devices; on each, fsdp-only meshes first, then
  tensor-parallel sizes the model accepts (`model_sizes`), smallest first, with rows
  that divide 'data' x 'fsdp'. None if the step already fits. An estimate: compile the
  suggestion to confirm.
  """
  budget = FIT_FRACTION * result.topo.device_hbm
  n0, f0, m0 = result.mesh.size, result.shape.fsdp, result.shape.model
  rows = result.shape.rows

  def estimate(n, f, m):
    worst = 0.0
    for s in result.stages:
      rest = max(s.total - s.scaled, 0)
      worst = max(worst, s.scaled * f0 * m0 / (f * m) + rest * n0 / n * max(1.0, m / m0))
    return worst

  if max(s.total for s in result.stages) <= budget:
    return None
  for mult in (1, 2, 4, 8, 16):
    n = n0 * mult
    for m in model_sizes(result.cfg, n):
      for f in sorted(d for d in range(1, n // m + 1) if (n // m) % d == 0):
        if f * m < f0 * m0 or rows % (n // m):  # rows must split over data x fsdp
          continue
        est = estimate(n, f, m)
        if est <= budget:
          where = 'this slice' if mult == 1 else f'{n} devices ({mult}x this slice)'
          return (f'--fsdp {f} --model_axis {m} on {where}: about {est / GIB:.2f} GiB per '
                  f'device (estimate from per-device bytes scaling; compile it to confirm)')
  return ('nothing up to 16x this slice by fsdp and tensor parallelism: raise '
          '--micro_batches (activation temporaries scale with rows per micro-batch), use '
          '--lora_rank, or shorten sequences')


def known_arrays(result: Result, piece: str) -> list:
  """[(name, per-device shape, bytes)]: the large arrays a piece makes by construction,
  from the shapes alone (a guide when XLA could not compile it): float32 vocabulary
  logits of the rows (packed: slots of the groups) one device runs at once (its share
  of the vocabulary with model > 1), and the sampler's KV cache (its rows and kv heads)."""
  from experiments.training import train_step as ts
  cfg, sh = result.cfg, result.shape
  n, m = ts.row_shards(result.mesh), sh.model
  b, g, p, l = sh.num_prompts, sh.group_size, sh.prompt_len, sh.response_len
  split = sh.minibatches * sh.micro_batches if piece.startswith('update') else 1
  if result.packed and not piece.endswith('_flat'):
    units, length, what = b // split, result.pack_len, 'groups x slots'
  else:
    units, length, what = b * g // split, p + l, 'rows x tokens'
  per = -(-units // n)
  out = []
  if piece in ('logprobs', 'logprobs_flat', 'update', 'update_flat'):
    vocab = cfg.vocab_size // m
    out.append((f'vocab logits ({what}, float32)', (per, length, vocab),
                per * length * vocab * 4))
  if piece == 'sample':
    kv, item = cfg.kv_heads // m, np.dtype(cfg.dtype).itemsize
    for rows, slots in cache_slots(sh):
      rows = -(-rows // n)
      out.append(('KV cache (k and v: layers, rows, slots, kv heads, head dim)',
                  (2, cfg.num_layers, rows, slots, kv, cfg.head_dim),
                  2 * cfg.num_layers * rows * slots * kv * cfg.head_dim * item))
  return out


def _gib(x):
  return f'{x / GIB:7.3f}'


def _layout_text(shape: RLShape, pack_len: int) -> str:
  attention, blk, pairs = packed_layout(shape, pack_len)
  if attention != 'blocks':
    return attention + (' (auto)' if shape.pack_attention == 'auto' else '')
  return (f'blocks of {blk} x {pairs} pairs per group'
          + (' (auto)' if shape.pack_attention == 'auto' else ''))


def format_report(result: Result) -> str:
  r, topo, sh = result, result.topo, result.shape
  hbm = topo.device_hbm
  lines = [
      f'topology {topo.name}: {len(topo.devices)} devices ({topo.chip.name}, '
      f'{topo.cores_per_chip} per chip) on {topo.num_hosts} hosts (process_index '
      f'{sorted({d.process_index for d in topo.devices})}); mesh '
      f'{dict(r.mesh.shape)}'
      + (f" (tensor parallel: heads, kv heads, MLP width and vocabulary split {sh.model} "
         f"ways over 'model')" if sh.model > 1 else ''),
      f'model: {r.num_params / 1e6:.1f} M params, {r.cfg.num_layers} layers, d {r.cfg.d_model}, '
      f'vocab {r.cfg.vocab_size}, dtype {np.dtype(r.cfg.dtype).name}, remat {r.cfg.remat}, '
      f'lora {r.cfg.lora_rank}; train state {r.state_chip_bytes / GIB:.3f} GiB per device; '
      f'one device holds {100 * r.param_fraction:.1f}% of the parameters',
      f'step: {sh.rows} rows = {sh.num_prompts} prompts x G {sh.group_size} ({sh.sampler}), '
      f'prompt {sh.prompt_len} + response {sh.response_len}; packing '
      f'{sh.packing if r.packed else "none"}'
      + (f' (pack_len {r.pack_len}, attention {_layout_text(sh, r.pack_len)})'
         if r.packed else '') +
      f'; {sh.minibatches} minibatches x {sh.micro_batches} micro-batches x {sh.epochs} epochs',
      f'per device (HBM {hbm / GIB:.1f} GiB; vendor peaks {topo.device_flops / 1e12:.0f} '
      f'TFLOP/s bf16, {topo.device_bandwidth / 1e12:.2f} TB/s):',
      f'  {"stage":28s} {"args":>7s} {"temp":>7s} {"out":>7s} {"alias":>7s} {"held":>7s} '
      f'{"total":>7s} GiB  {"%HBM":>5s} {"compile":>8s}',
  ]
  for s in r.stages:
    lines.append(f'  {s.name:28s} {_gib(s.argument)} {_gib(s.temp)} {_gib(s.output)} '
                 f'{_gib(s.alias)} {_gib(s.outside)} {_gib(s.total)}      '
                 f'{100 * s.total / hbm:5.1f} {s.compile_s:7.1f}s'
                 + ('  does not fit (XLA)' if s.error else ''))
  lines.append('  (held: train state / reference params the loop keeps on the devices '
               'while the stage runs)')
  lines.append(f'  {"piece":14s} {"exec FLOP":>10s} {"model FLOP":>10s} '
               f'{"FLOP/dev":>9s} {"HBM B/dev":>9s} {"roofline s":>10s}')
  for p in ('sample', 'logprobs', 'logprobs_flat', 'update', 'update_flat'):
    if p not in r.flops or (p.endswith('_flat') and not r.packed):
      continue
    f_dev, b_dev, t = roofline(r, p)
    ex, mo = r.flops[p]
    if not any(st.piece == p for st in r.stages):
      continue
    lines.append(f'  {p:14s} {ex:10.3g} {mo:10.3g} {f_dev:9.3g} {b_dev:9.3g} {t:10.3g}')
  if r.packed:
    tf = teacher_forcing_flops(r.cfg, sh, r.pack_len)
    kept = lambda f: f['dense'] + f['attention']
    lines.append(
        f'  one teacher-forced forward: flat {tf["flat"]["dense"]:.3g} dense + '
        f'{tf["flat"]["attention"]:.3g} attention FLOP; packed {tf["packed"]["dense"]:.3g} + '
        f'{tf["packed"]["attention"]:.3g}; dense saving {100 * tf["dense_saving"]:.1f}%, of '
        f'which the whole forward keeps '
        f'{(1 - kept(tf["packed"]) / kept(tf["flat"])) / tf["dense_saving"]:.2f}'
        if tf['dense_saving'] > 0 else
        f'  one teacher-forced forward: flat {kept(tf["flat"]):.3g} FLOP, packed '
        f'{kept(tf["packed"]):.3g} (no dense saving at this pack_len)')
  return '\n'.join(lines + _step_lines(r))


def _step_lines(r: Result) -> list:
  """format_report's last lines: the step's peak, FLOPs and roofline, and if it does not fit,
  what does not (its largest arguments and buffers) and a mesh that would."""
  hbm = r.topo.device_hbm
  lines = []
  s = step_summary(r)
  lines.append(
      f'RL step: peak {s["peak"].total / GIB:.3f} GiB per device in {s["peak"].name!r} '
      f'({100 * s["peak"].total / hbm:.0f}% of HBM, {"fits" if s["fits"] else "does not fit"} '
      f'in {int(100 * FIT_FRACTION)}%); {s["executed_flops"]:.3g} FLOP executed, '
      f'{s["model_flops"]:.3g} model; roofline {s["roofline_s"]:.3g} s; MFU bound '
      f'{100 * s["mfu"]:.1f}%; compile {s["compile_s"]:.1f} s')
  if not s['fits']:
    p = s['peak']
    failed = [st.name for st in r.stages if st.error]
    lines.append(f'does not fit: {p.name!r} needs {p.total / GIB:.2f} GiB per device, '
                 f'{int(100 * FIT_FRACTION)}% of HBM is {FIT_FRACTION * hbm / GIB:.2f} GiB'
                 + (f'; XLA ran out of memory compiling {", ".join(failed)}' if failed else ''))
    if p.error:
      lines.append(f'  XLA: {p.error}')
    lines.append(f'  largest arguments of {p.name!r} per device:')
    for name, shape, dtype, b, spec in p.largest_args:
      lines.append(f'    {name} {dtype}{list(shape)} {spec}: {b / GIB:.3f} GiB')
    if p.largest_temps:
      lines.append(f'  largest {"outputs" if p.error else "buffers in its program"} '
                   f'(per device):')
      for name, shape, b in p.largest_temps:
        lines.append(f'    {name} {shape}: {b / GIB:.3f} GiB')
    for name, shape, b in known_arrays(r, p.piece):
      lines.append(f'  {name} per device: {list(shape)}: {b / GIB:.3f} GiB')
    lines.append(f'  suggestion: {suggest_mesh(r)}')
  return lines
