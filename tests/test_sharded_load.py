"""Sharded loading of HF directories onto a mesh (`sharded_load`) and `save_hf_dir`'s
bf16 / multi-file output (issue 19, item 6).

Reference: `hf_loader.load_hf_dir` (whole tensors through `hf_layout.to_params`);
the sharded loader must give the same bits with the training step's shardings.
The multi-device checks run this file as a script with 8 host CPU devices.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from experiments.models import decoder, hf_layout, hf_loader, sharded_load
from experiments.training import train_step as ts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    # Llama, GQA, attention (q/k/v/o) and MLP biases, untied head.
    'llama_bias_gqa': decoder.PolicyConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                           num_kv_heads=2, d_ff=48, max_len=16, attn_bias=True,
                                           o_bias=True, mlp_bias=True),
    # Qwen3: q/k norms, explicit head_dim (4 * 8 != 36), tied; d_model 36 is not divisible by
    # 8 devices, so over fsdp=8 the layer axis (norms) and head_dim (q/k/v, q/k norms) split.
    'qwen3_tied': decoder.PolicyConfig(vocab_size=72, d_model=36, num_layers=8, num_heads=4,
                                       num_kv_heads=2, d_ff=40, max_len=16, qk_norm=True,
                                       attn_head_dim=8, tie_embeddings=True),
    # Qwen2: q/k/v biases only, no GQA, untied.
    'qwen2': decoder.PolicyConfig(vocab_size=48, d_model=16, num_layers=3, num_heads=2,
                                  d_ff=24, max_len=16, attn_bias=True),
}


@functools.lru_cache(maxsize=None)
def _shapes(cfg):
  return jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), cfg))


def random_params(cfg, seed=0):
  """The decoder's param tree with every leaf random normal (biases and norms too)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), _shapes(cfg))


def write(path, name, seed=0, **kw):
  cfg = CONFIGS[name]
  params = random_params(cfg, seed)
  hf_loader.save_hf_dir(path, params, cfg, **kw)
  return params, cfg


def assert_same(got, ref):
  flat_g = dict(jax.tree_util.tree_leaves_with_path(got))
  flat_r = dict(jax.tree_util.tree_leaves_with_path(ref))
  assert sorted(map(jax.tree_util.keystr, flat_g)) == sorted(map(jax.tree_util.keystr, flat_r))
  for p, r in flat_r.items():
    g = np.asarray(flat_g[p])
    assert g.dtype == r.dtype and g.shape == r.shape, (jax.tree_util.keystr(p), g.dtype, g.shape)
    np.testing.assert_array_equal(g, r, err_msg=jax.tree_util.keystr(p))


@pytest.mark.parametrize('name', sorted(CONFIGS))
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_one_device_matches_load_hf_dir(tmp_path, name, dtype):
  write(tmp_path, name, dtype=dtype)
  ref, rcfg, rhf = hf_loader.load_hf_dir(tmp_path, max_len=16)
  got, cfg, hf = sharded_load.load_hf_dir_sharded(tmp_path, ts.make_mesh(1, jax.devices()[:1]),
                                                  max_len=16)
  assert cfg == rcfg and hf == rhf
  assert_same(got, ref)


def test_leaf_table_shapes_are_to_params_shapes():
  for cfg in CONFIGS.values():
    ref = hf_layout.to_params(hf_layout.from_params(random_params(cfg), cfg), cfg)
    table = sharded_load.leaf_table(cfg)
    flat = {tuple(k.key for k in p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(ref)}
    assert flat == {p: leaf.shape for p, leaf in table.items()}


def test_bf16_checkpoint_keeps_dtype_and_rounds(tmp_path):
  params, cfg = write(tmp_path, 'llama_bias_gqa', dtype='bfloat16')
  assert json.loads((tmp_path / 'config.json').read_text())['torch_dtype'] == 'bfloat16'
  stored = load_file(str(tmp_path / 'model.safetensors'))
  assert {x.dtype for x in stored.values()} == {np.dtype(ml_dtypes.bfloat16)}
  got, _, _ = sharded_load.load_hf_dir_sharded(tmp_path, ts.make_mesh(1, jax.devices()[:1]),
                                               max_len=16, param_dtype=None)
  want = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params)  # round to nearest even
  assert_same(got, want)
  f32, _, _ = sharded_load.load_hf_dir_sharded(tmp_path, ts.make_mesh(1, jax.devices()[:1]),
                                               max_len=16)
  assert_same(f32, jax.tree.map(lambda x: x.astype(np.float32), want))


def test_default_save_is_unchanged_and_float32_shards_hold_the_same_tensors(tmp_path):
  params, cfg = write(tmp_path / 'one', 'qwen3_tied')
  # The default file is byte for byte what the original single-file writer produced.
  save_file(hf_layout.from_params(params, cfg), str(tmp_path / 'orig.safetensors'))
  assert (tmp_path / 'one' / 'model.safetensors').read_bytes() == \
      (tmp_path / 'orig.safetensors').read_bytes()
  one = json.loads((tmp_path / 'one' / 'config.json').read_text())
  assert one['torch_dtype'] == 'float32'
  hf_loader.save_hf_dir(tmp_path / 'many', params, cfg, shard_size=4096)
  index = json.loads((tmp_path / 'many' / 'model.safetensors.index.json').read_text())
  files = sorted(set(index['weight_map'].values()))
  assert len(files) > 2 and files[0] == f'model-00001-of-{len(files):05d}.safetensors'
  merged = {}
  for f in files:
    part = load_file(str(tmp_path / 'many' / f))
    assert all(index['weight_map'][n] == f for n in part)
    merged.update(part)
  assert index['metadata']['total_size'] == sum(x.nbytes for x in merged.values())
  whole = load_file(str(tmp_path / 'one' / 'model.safetensors'))
  assert sorted(merged) == sorted(whole)
  for n in whole:
    np.testing.assert_array_equal(merged[n], whole[n], err_msg=n)
  assert json.loads((tmp_path / 'many' / 'config.json').read_text()) == one
  assert not list((tmp_path / 'many').glob('*.partial'))


@functools.lru_cache(maxsize=None)
def _two_file_size(name):
  """The smallest shard size from half the checkpoint's bytes up that splits the bf16
  checkpoint of `name` into 2 files. Each file is filled in order up to the size, so the
  number of files never grows with the size: bisection (~15 writes, once per module)."""
  params, cfg = random_params(CONFIGS[name]), CONFIGS[name]
  with tempfile.TemporaryDirectory() as d:
    def num_files(size):
      path = pathlib.Path(d) / str(size)
      hf_loader.save_hf_dir(path, params, cfg, dtype='bfloat16', shard_size=size)
      return len(list(path.glob('*.safetensors')))
    total = 2 * sum(x.size for x in jax.tree.leaves(params))  # bfloat16 bytes
    lo, hi = total // 2, total - 1  # below the total: at least 2 files; total - 1: 2
    while lo < hi:
      mid = (lo + hi) // 2
      lo, hi = (lo, mid) if num_files(mid) <= 2 else (mid + 1, hi)
    return hi


def _two_files(tmp_path, name='llama_bias_gqa'):
  """A checkpoint split into exactly 2 files (`_two_file_size`)."""
  params, cfg = random_params(CONFIGS[name]), CONFIGS[name]
  path = tmp_path / 'two'
  hf_loader.save_hf_dir(path, params, cfg, dtype='bfloat16', shard_size=_two_file_size(name))
  files = sorted(p.name for p in path.glob('*.safetensors'))
  assert len(files) == 2, files
  return path, files


def test_two_file_checkpoint_with_index(tmp_path):
  path, files = _two_files(tmp_path)
  assert files == ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
  assert (path / 'model.safetensors.index.json').is_file()
  ref, _, _ = hf_loader.load_hf_dir(path, max_len=16)
  got, _, _ = sharded_load.load_hf_dir_sharded(path, ts.make_mesh(1, jax.devices()[:1]),
                                               max_len=16)
  assert_same(got, ref)


def test_missing_shard_names_index_and_file(tmp_path):
  path, files = _two_files(tmp_path)
  os.remove(path / files[1])
  with pytest.raises(FileNotFoundError, match=rf'model.safetensors.index.json.*{files[1]}'):
    sharded_load.load_hf_dir_sharded(path, ts.make_mesh(1, jax.devices()[:1]), max_len=16)


def test_index_pointing_at_the_wrong_shard_is_refused(tmp_path):
  path, files = _two_files(tmp_path)
  index_path = path / 'model.safetensors.index.json'
  index = json.loads(index_path.read_text())
  name = next(n for n, f in index['weight_map'].items() if f == files[0])
  index['weight_map'][name] = files[1]
  index_path.write_text(json.dumps(index))
  with pytest.raises(ValueError, match=rf'index.json.*{name} -> {files[1]}'):
    sharded_load.load_hf_dir_sharded(path, ts.make_mesh(1, jax.devices()[:1]), max_len=16)


def test_truncated_shard_names_file(tmp_path):
  path, files = _two_files(tmp_path)
  data = (path / files[0]).read_bytes()
  (path / files[0]).write_bytes(data[:len(data) - 10])
  with pytest.raises(ValueError, match=rf'{files[0]}: not a readable safetensors file'):
    sharded_load.load_hf_dir_sharded(path, ts.make_mesh(1, jax.devices()[:1]), max_len=16)


def test_unread_wrong_shape_and_int_tensors_are_refused(tmp_path):
  params, cfg = write(tmp_path, 'qwen2')
  mesh = ts.make_mesh(1, jax.devices()[:1])
  tensors = load_file(str(tmp_path / 'model.safetensors'))
  extra = dict(tensors, **{'model.layers.0.self_attn.o_proj.bias': np.zeros(16, np.float32)})
  save_file(extra, str(tmp_path / 'model.safetensors'))
  with pytest.raises(ValueError, match=r'does not use.*o_proj.bias'):
    sharded_load.load_hf_dir_sharded(tmp_path, mesh, max_len=16)
  bad = dict(tensors, **{'model.norm.weight': np.zeros(15, np.float32)})
  save_file(bad, str(tmp_path / 'model.safetensors'))
  with pytest.raises(ValueError, match=r'model.safetensors: model.norm.weight: expected shape'):
    sharded_load.load_hf_dir_sharded(tmp_path, mesh, max_len=16)
  ints = dict(tensors, **{'model.norm.weight': np.zeros(16, np.int8)})
  save_file(ints, str(tmp_path / 'model.safetensors'))
  with pytest.raises(ValueError, match=r'model.norm.weight has dtype I8'):
    sharded_load.load_hf_dir_sharded(tmp_path, mesh, max_len=16)
  del tensors['model.layers.2.mlp.up_proj.weight']
  save_file(tensors, str(tmp_path / 'model.safetensors'))
  with pytest.raises(ValueError, match=r'lacks 1 tensors.*layers.2.mlp.up_proj'):
    sharded_load.load_hf_dir_sharded(tmp_path, mesh, max_len=16)


def test_save_hf_dir_bad_arguments(tmp_path):
  params, cfg = random_params(CONFIGS['qwen2']), CONFIGS['qwen2']
  with pytest.raises(ValueError, match='dtype must be one of'):
    hf_loader.save_hf_dir(tmp_path, params, cfg, dtype='float16')
  with pytest.raises(ValueError, match='shard_size must be a positive'):
    hf_loader.save_hf_dir(tmp_path, params, cfg, shard_size=0)


def main(workdir):
  """8 host devices: for each config and mesh, the loaded params are bit-identical to
  load_hf_dir, placed with the training step's shardings, each device holding 1/fsdp
  of every split leaf, and the callbacks read only those slices."""
  import pathlib
  assert jax.device_count() == 8, jax.devices()
  reads = []
  orig = sharded_load._Files.get_slice

  def counting(self, name):
    sl = orig(self, name)

    class Counted:
      def __getitem__(self, index):
        x = sl[index]
        reads.append((name, x.size))
        return x

      def __getattr__(self, attr):
        return getattr(sl, attr)
    return Counted()
  sharded_load._Files.get_slice = counting
  checked = {'split_layers': 0, 'split_head_dim': 0}
  for name in sorted(CONFIGS):
    path = pathlib.Path(workdir) / name
    write(path, name, dtype='bfloat16', shard_size=6000)
    assert len(list(path.glob('*.safetensors'))) > 1
    ref, _, _ = hf_loader.load_hf_dir(path, max_len=16)
    for data, fsdp in ((1, 8), (2, 4)):
      mesh = ts.make_mesh(fsdp)
      reads.clear()
      got, _, _ = sharded_load.load_hf_dir_sharded(path, mesh, max_len=16)
      assert_same(got, ref)
      table = sharded_load.leaf_table(CONFIGS[name])
      want_sh = ts.param_sharding(ref, mesh)
      per_tensor = {}
      for n, size in reads:
        per_tensor.setdefault(n, []).append(size)
      for (p, x), sh in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want_sh)):
        key = tuple(k.key for k in p)
        spec = ts.leaf_spec(x.shape, fsdp)
        assert x.sharding.spec == spec == sh.spec and x.sharding.mesh == mesh, (key, x.sharding)
        parts = tuple(spec) + (None,) * (x.ndim - len(spec))
        shard = tuple(n // fsdp if s == 'fsdp' else n for n, s in zip(x.shape, parts))
        assert len(x.addressable_shards) == 8
        assert all(s.data.shape == shard for s in x.addressable_shards), (key, shard)
        leaf = table[key]
        axis = next((i for i, s in enumerate(parts) if s == 'fsdp'), None)
        n_shards = 1 if axis is None else fsdp
        done = [sum(per_tensor.get(n, [])) for n in leaf.names]
        per_layer = int(np.prod(leaf.hf_shape))
        t_axis = axis - leaf.stacked if axis is not None else None
        if axis is not None and leaf.stacked and axis == 0:
          checked['split_layers'] += 1
        if leaf.split is not None and t_axis == leaf.split[0] + 1:
          # head_dim split: whole heads are read, then sliced (each shard reads its heads' rows).
          checked['split_head_dim'] += 1
          continue
        # One read per distinct shard (replicas over 'data' share it); together they read each
        # tensor exactly once, so no device read more than its own slice.
        assert done == [per_layer] * len(leaf.names), (key, done)
        reads_each = 1 if leaf.stacked and axis == 0 else n_shards  # a layer split: 1 read each
        assert all(len(per_tensor[n]) == reads_each for n in leaf.names), (key, per_tensor)
      assert not all(x.sharding.is_fully_replicated for x in jax.tree.leaves(got))
  assert checked['split_layers'] and checked['split_head_dim'], checked
  # pretrained.load(mesh=...) (what the loop's problems call on > 1 device): the same
  # values, already placed with the update step's shardings, for an HF dir and the GGUF.
  from experiments.models import pretrained
  sharded_load._Files.get_slice = orig
  mesh = ts.make_mesh(4)
  for source in (os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'qwen3'), 'smollm2'):
    want = pretrained.load(source, max_len=16)
    got = pretrained.load(source, max_len=16, mesh=mesh)
    assert got.cfg == want.cfg
    assert_same(got.params, want.params)
    for x in jax.tree.leaves(got.params):
      assert x.sharding.mesh == mesh and x.sharding.spec == ts.leaf_spec(x.shape, 4), x.sharding
  print('OK', checked)


def test_eight_devices_fsdp(tmp_path):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  env.pop('JAX_COORDINATOR_ADDRESS', None)
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'OK' in proc.stdout


if __name__ == '__main__':
  main(sys.argv[1])
