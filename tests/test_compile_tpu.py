"""The whole RL step AOT-compiled for TPU slices on a CPU host (experiments/compile_tpu.py).

libtpu (the test extra installs `jax[tpu]` on Linux x86_64) gives the devices of a real
slice without any TPU; every stage of the loop's step (prefill, decode loop, tree forks,
packing, old and reference log-probs, credit, packed update) is compiled by the TPU
compiler over the loop's ('data', 'fsdp', 'model') mesh. Checked: per-chip memory under a
bound the sizes give, parameters (policy and reference) and the sampler's KV cache split
as the loop asks (read back from the compiled programs' input shardings: over 'fsdp', and
on the two-host slice also over 'model', tensor parallelism), a slice of two hosts, and
the report of a step that does not fit. One compile per topology, a 2-layer model.
"""

import dataclasses
import math

import numpy as np
import pytest

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

try:
  import libtpu  # noqa: F401
except ImportError:
  libtpu = None

pytestmark = pytest.mark.skipif(
    libtpu is None, reason='libtpu is not installed: `pip install -e ".[test]"` installs '
    'jax[tpu] on Linux x86_64 (the only platform libtpu ships for)')

# libtpu reads these when it loads; set for the compiles only (see aot.quiet_libtpu).
LIBTPU_ENV = dict(TPU_ACCELERATOR_TYPE='v5litepod-4', TPU_WORKER_HOSTNAMES='localhost',
                  ALLOW_MULTIPLE_LIBTPU_LOAD='1')
MIB = 2 ** 20
# (topology, hosts, fsdp, model, RLShape fields): one host, all devices fsdp, i.i.d.
# groups, the loop's default packed attention ('auto'); two hosts, data 2 x fsdp 2 x
# model 2 (tensor parallelism), tree groups (forks and the children's decode), block-sparse
# ancestor attention ('blocks').
CASES = {
    'v5e:2x2': (1, 4, 1, dict(rows=16, group_size=4, sampler='iid')),
    'v5e:2x4': (2, 2, 2, dict(rows=32, group_size=4, sampler='tree_entropy', num_chains=2,
                              num_forks=1, num_continuations=1, pack_attention='blocks')),
}
PROMPT, RESPONSE = 8, 8


# A 2-layer Llama shape (as a config.json) whose shards fill TPU tiles ((8, 128) for
# float32, on the two minor axes) at fsdp 2 and 4, so per-chip bytes follow the
# logical sizes: 8 heads of 128, d 512, d_ff 1024, vocabulary 512 (7.6 M params).
CONFIG = dict(model_type='llama', hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=8, head_dim=128, intermediate_size=1024, vocab_size=512,
              rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


@pytest.fixture(scope='module')
def config_json(tmp_path_factory):
  import json
  path = tmp_path_factory.mktemp('model') / 'config.json'
  path.write_text(json.dumps(CONFIG))
  return str(path)


@pytest.fixture(scope='module', params=sorted(CASES))
def compiled(request, config_json):
  from experiments.training import aot
  import jax.numpy as jnp
  name = request.param
  hosts, fsdp, model, fields = CASES[name]
  with pytest.MonkeyPatch.context() as mp:
    for k, v in LIBTPU_ENV.items():
      mp.setenv(k, v)
    topo = aot.topology(name)
    cfg, _ = aot.model_config(config_json, max_len=PROMPT + RESPONSE, dtype=jnp.bfloat16)
    shape = aot.RLShape(prompt_len=PROMPT, response_len=RESPONSE, fsdp=fsdp, model=model,
                        compile_flat=False, **fields)
    result = aot.compile_rl_step(cfg, shape, topo)
  return name, hosts, result


def _stage(result, name):
  (s,) = [s for s in result.stages if s.name == name]
  return s


def _abstract_params(result):
  from experiments.models import decoder
  return jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), result.cfg))


def _nbytes(x, sharding=None):
  shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
  return math.prod(shape) * np.dtype(x.dtype).itemsize


def test_slice_and_every_stage_compiled(compiled):
  name, hosts, r = compiled
  assert r.topo.num_hosts == hosts and r.mesh.size == len(r.topo.devices)
  assert {d.platform for d in r.topo.devices} == {'tpu'}
  assert (r.mesh.shape['fsdp'], r.mesh.shape['model']) == (r.shape.fsdp, r.shape.model)
  assert (r.cfg.num_layers, r.cfg.d_model, r.cfg.head_dim) == (2, 512, 128)  # config.json
  names = [s.name for s in r.stages]
  for stage in ('prefill (_start)', 'decode (_decode)', 'node ids', 'pack (pack_slots)',
                'old log-probs', 'ref log-probs', 'credit', 'update'):
    assert stage in names, (name, names)
  if r.shape.sampler == 'tree_entropy':
    assert 'fork (_fork)' in names and 'decode children (_decode)' in names
  assert r.packed and not any(s.error for s in r.stages)


def test_parameters_sharded_in_the_compiled_programs(compiled):
  """The update's and the reference log-probs' compiled input shardings split every
  parameter over 'fsdp' as `leaf_spec` asks, and with model > 1 every one with a head,
  MLP or vocabulary axis also over 'model' (Megatron splits): each device holds exactly
  1 / fsdp of a parameter, 1 / (fsdp * model) of those."""
  from experiments.training import train_step as ts
  _, _, r = compiled
  fsdp, model = r.shape.fsdp, r.shape.model
  tree = _abstract_params(r)
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  params = jax.tree.leaves(tree)
  split = [any(ts.LOGICAL_RULES.get(a) == 'model' for a in ts.logical_axes(p)) for p in paths]
  assert all(split[i] for i, p in enumerate(paths) if 'norm' not in jax.tree_util.keystr(p))
  full = sum(_nbytes(x) for x in params)
  want = sum(_nbytes(x) / (fsdp * (model if s else 1)) for x, s in zip(params, split))
  for stage, pick in (('update', lambda a: a[0].params), ('ref log-probs', lambda a: a[0]),
                      ('old log-probs', lambda a: a[0])):
    shardings = jax.tree.leaves(pick(_stage(r, stage).input_shardings))
    assert len(shardings) == len(params)
    for p, x, sh, s in zip(paths, params, shardings, split):
      assert sh.spec == ts.leaf_spec(x.shape, fsdp, model, ts.logical_axes(p)), (stage, p)
      assert 'fsdp' in sh.spec and (('model' in sh.spec) == (s and model > 1)), (stage, p)
      assert _nbytes(x, sh) * fsdp * (model if s else 1) == _nbytes(x), (stage, p)
    assert sum(_nbytes(x, sh) for x, sh in zip(params, shardings)) == want, stage
  assert r.param_fraction == want / full
  if model > 1:
    assert r.param_fraction < 1.01 / (fsdp * model)


def test_kv_cache_rows_split_over_the_mesh(compiled):
  """The decode loop's KV cache [layers, rows, slots, kv_heads, head_dim] comes in with
  its rows over ('data', 'fsdp') (sampling.place_rows), not replicated."""
  _, _, r = compiled
  stages = ['decode (_decode)'] + (['decode children (_decode)']
                                   if r.shape.sampler == 'tree_entropy' else [])
  for stage in stages:
    cache = _stage(r, stage).input_shardings[1].cache
    heads = 'model' if r.shape.model > 1 else None  # kv heads over 'model'
    rows = NamedSharding(r.mesh, P(None, ('data', 'fsdp'), None, heads, None))
    for sh in jax.tree.leaves(cache):
      assert sh.is_equivalent_to(rows, 5), (stage, sh.spec)


def test_per_chip_memory_under_a_bound(compiled):
  """Every stage's per-chip total stays below what the sizes allow: the train state split
  over fsdp x model, the reference params likewise, the KV cache over all devices (rows
  over data x fsdp, kv heads over model), plus 8 MiB of slack (XLA's buffers of a toy
  step); the update's arguments are its state shard and batch."""
  _, _, r = compiled
  n, split = r.mesh.size, r.shape.fsdp * r.shape.model
  params = jax.tree.leaves(_abstract_params(r))
  param_bytes = sum(_nbytes(x) for x in params)
  state_full = 3 * param_bytes  # params + Adam's two moments (float32)
  # + step, rng; 1 % for the norm scales, which 'model' does not split
  assert r.state_chip_bytes <= 1.01 * state_full / split + 4096
  rows = r.shape.rows
  tokens = rows * (r.shape.prompt_len + r.shape.response_len)
  cache = (2 * r.cfg.num_layers * tokens * r.cfg.kv_heads * r.cfg.head_dim * 2) / n
  bound = 1.01 * (state_full + param_bytes) / split + cache + 8 * MIB
  for s in r.stages:
    assert 0 < s.total <= bound, (s.name, s.total, bound)
  # The update's arguments: its train-state shard and the batch (1 % for the tile padding
  # of the norm scales); replicated parameters would exceed it.
  upd = _stage(r, 'update')
  assert upd.argument <= 1.01 * state_full / split + 64 * tokens / n + 64 * 1024
  assert upd.argument > state_full / split
  from experiments.training import aot
  summary = aot.step_summary(r)
  assert summary['fits'] and summary['peak'].total < 0.01 * r.topo.device_hbm


def test_report_and_a_step_that_does_not_fit(compiled):
  from experiments.training import aot
  name, _, r = compiled
  text = aot.format_report(r)
  assert f'topology {name}' in text and 'fits in 90%' in text and 'does not fit' not in text
  for line in ('prefill (_start)', 'decode (_decode)', 'old log-probs', 'update'):
    assert line in text
  attention, block, pairs = aot.packed_layout(r.shape, r.pack_len)
  assert attention == ('blocks' if r.shape.pack_attention == 'blocks' else 'paths')
  assert (f'attention blocks of {block} x {pairs} pairs' in text) == (attention == 'blocks')
  assert 'one teacher-forced forward: flat' in text
  # The same programs on a chip of 1 MiB: the report names the arrays and a mesh.
  chip = dataclasses.replace(r.topo.chip, hbm_bytes=1 * MIB)
  small = dataclasses.replace(r, topo=dataclasses.replace(r.topo, chip=chip))
  assert not aot.step_summary(small)['fits']
  text = aot.format_report(small)
  assert 'does not fit' in text and 'largest arguments' in text and 'suggestion:' in text
  n, m, b = r.mesh.size // r.shape.model, r.shape.model, r.shape.num_prompts  # rows: n parts
  (logits,) = aot.known_arrays(r, 'logprobs')  # packed: the groups' slots on one device
  assert logits[1] == (-(-b // n), r.pack_len, 512 // m)
  assert logits[2] == 4 * math.prod(logits[1])
  prefix, own = aot.known_arrays(r, 'sample')  # cascade: each prompt once, each row's own
  assert prefix[1] == (2, 2, -(-b // n), PROMPT, 8 // m, 128)
  assert own[1] == (2, 2, r.shape.rows // n, RESPONSE, 8 // m, 128)


def test_out_of_memory_stage_is_recorded_not_raised():
  """A program XLA cannot fit (RESOURCE_EXHAUSTED) becomes a stage with the bytes the
  error names, and abstract outputs for the next stages."""
  from experiments.training import aot
  import jax.numpy as jnp
  with pytest.MonkeyPatch.context() as mp:
    for k, v in LIBTPU_ENV.items():
      mp.setenv(k, v)
    topo = aot.topology('v5e:2x2')
    mesh = aot.make_mesh(topo, 1)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
    c = aot.Compiler({})
    out = c('tile', 'sample', jax.jit(lambda x: jnp.tile(x, (5000, 1)) + 1), (x,), {})
  (s,) = c.stages
  assert 'RESOURCE_EXHAUSTED' in s.error and s.total > topo.device_hbm
  assert out.shape == (5000 * 1024, 1024)
  assert aot.error_bytes('Used 26.58G of 15.75G hbm') == (int(26.58 * 2 ** 30), 0)
  assert aot.error_bytes('HLO temporaries (20.45G) exceeds') == (0, int(20.45 * 2 ** 30))
