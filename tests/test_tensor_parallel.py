"""Tensor parallelism (the mesh's 'model' axis): exact against one device, and really split.

The 8-device checks run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8
(JAX fixes its device count when it starts): on mesh data 2 x fsdp 2 x model 2, a 2-layer
model with grouped-query heads and q/k/v biases must give the single-device teacher-forced
log-probs and entropies, loss and new params after one `train_step`, and sampled tokens,
while its parameters, the sampler's KV cache and the logits are split over 'model' (the
vocabulary log-softmax without gathering the vocabulary). A tied-embedding LoRA model checks
the adapters' and the tied head's splits. The refusals run in this process.
"""

import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.models import decoder
from experiments.training import train_step as ts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Sizes chosen so that no other axis has the vocabulary's size (48) or its half: an
# all-gather of logits would show as an array with a 48-wide dimension.
CFG = decoder.PolicyConfig(vocab_size=48, d_model=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, d_ff=128, max_len=16, attn_bias=True)
LORA = decoder.PolicyConfig(vocab_size=48, d_model=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, d_ff=128, max_len=16, tie_embeddings=True,
                            lora_rank=4)
B, G, PROMPT, RESPONSE = 8, 2, 6, 8
ATOL = 2e-5


def _batch(seed, n):
  """Host (numpy) arrays: placing them on the mesh or one device compiles nothing."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, CFG.vocab_size, (n, PROMPT), dtype=np.int32)
  tokens = rng.integers(0, CFG.vocab_size, (n, RESPONSE), dtype=np.int32)
  lengths = rng.integers(1, RESPONSE + 1, (n, 1))
  mask = np.arange(RESPONSE)[None] < lengths
  adv = np.where(mask, rng.normal(size=(n, RESPONSE)), 0.0).astype(np.float32)
  old = (-np.abs(rng.normal(size=(n, RESPONSE))) - 1.0).astype(np.float32)
  ref = (old + 0.1 * rng.normal(size=(n, RESPONSE))).astype(np.float32)
  return ts.Batch(prompts=prompts, tokens=tokens, mask=mask, advantages=adv,
                  old_logprobs=old, ref_logprobs=ref)


def _host(tree):
  """numpy copies of a pytree's arrays: fresh device buffers when placed (no copy program
  compiled per shape, as jnp.copy would), placed on a mesh without slicing programs."""
  return jax.tree.map(np.asarray, tree)


def _maxdiff(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def _gathered_shapes(hlo: str):
  """Result shapes of the all-gathers in a compiled (partitioned) HLO module."""
  return [tuple(int(d) for d in m.group(1).split(',') if d)
          for m in re.finditer(r'= \w+\[([\d,]*)\][^=]*? all-gather\(', hlo)]


def _close(a, b, atol=ATOL, what=''):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5, err_msg=what)


def check_placement(params, cfg, mesh):
  """Every matrix is split over 'model' on its Megatron axis (and over 'fsdp'), so a
  device holds 1 / (fsdp * model) of it; model = 1 keeps the fsdp-only specs."""
  want = {('q', 'kernel'): P(None, 'fsdp', 'model', None),
          ('k', 'kernel'): P(None, 'fsdp', 'model', None),
          ('o', 'kernel'): P(None, 'model', None, 'fsdp'),
          ('gate', 'kernel'): P(None, 'fsdp', 'model'),
          ('down', 'kernel'): P(None, 'model', 'fsdp'),
          ('embed', 'embedding'): P('model', 'fsdp')}
  if cfg.lora_rank:
    want.update({('q', 'kernel_lora_b'): P(None, 'fsdp', 'model'),
                 ('o', 'kernel_lora_a'): P(None, 'model', 'fsdp'),
                 ('down', 'kernel_lora_a'): P(None, 'model', 'fsdp')})
  else:
    want.update({('head', 'kernel'): P('fsdp', 'model'), ('q', 'bias'): P(None, 'model', 'fsdp')})
  placed = jax.device_put(_host(params), ts.param_sharding(params, mesh))
  seen = set()
  for path, x in jax.tree_util.tree_leaves_with_path(placed):
    key = tuple(k.key for k in path)[-2:]
    axes = ts.logical_axes(path)
    assert axes is not None and len(axes) == x.ndim, (key, axes)
    split = [ax for ax, name in enumerate(axes) if ts.LOGICAL_RULES.get(name) == 'model']
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    if split:
      assert spec[split[0]] == 'model', (key, spec)
      shard = x.addressable_shards[0].data.shape
      assert shard[split[0]] == x.shape[split[0]] // 2, (key, shard)
      assert np.prod(shard) * 4 == x.size, (key, shard)  # fsdp 2 x model 2
    else:
      assert 'model' not in spec, (key, spec)
    if key in want:
      assert x.sharding.spec == want[key], (key, x.sharding.spec)
      seen.add(key)
  assert seen == set(want), set(want) - seen
  fsdp_only = ts.param_specs(params, 2, 1)
  for path, spec in jax.tree_util.tree_leaves_with_path(
      fsdp_only, is_leaf=lambda s: isinstance(s, P)):
    assert spec == ts.leaf_spec(_leaf(params, path).shape, 2), (path, spec)
  return placed


def _leaf(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


def check_logprobs(params, placed, cfg, mesh):
  """Teacher-forced log-probs and entropies equal one device's; the compiled program
  never gathers a vocabulary-wide array (the log-softmax reduces over the split)."""
  batch = _batch(1, B)
  fn = jax.jit(lambda p, a, b: decoder.token_logprobs(p, cfg, a, b))
  want = fn(params, batch.prompts, batch.tokens)
  rows = ts.batch_sharding(mesh)
  args = (placed, jax.device_put(batch.prompts, rows), jax.device_put(batch.tokens, rows))
  got = fn(*args)
  _close(got, want, what='token_logprobs')
  gathered = _gathered_shapes(fn.lower(*args).compile().as_text())
  assert gathered, 'no all-gather at all: the params were not split over fsdp'
  assert not [s for s in gathered if cfg.vocab_size in s], gathered
  return _maxdiff(got[0], want[0])


def check_train_step(params, mesh):
  """One train_step (2 micro-batches, KL to the reference): loss, metrics and new params
  equal one device's, and the new params keep their 'model' split."""
  lc = ts.LossConfig(kl_coef=0.05, num_microbatches=2)
  # Adam's eps well above float noise: a gradient that is 0 in exact arithmetic (the k
  # bias: softmax ignores a shift shared by all keys) is ~1e-9 of rounding, which Adam
  # with eps 1e-8 would blow up to a step of ~lr whose sign is the noise's.
  tx = ts.make_optimizer(1e-3, eps=1e-4)
  batch = _batch(2, B * G)
  state = ts.init_state(jax.tree.map(jnp.asarray, _host(params)), tx)
  one, m1 = ts.train_step_jit(state, batch, cfg=CFG, loss_cfg=lc)
  state = ts.shard_state(_host(ts.init_state(jax.tree.map(jnp.asarray, _host(params)), tx)), mesh)
  assert state.params['blocks']['up']['kernel'].sharding.spec == P(None, 'fsdp', 'model')
  tp, m2 = ts.train_step_jit(state, ts.shard_batch(batch, mesh), cfg=CFG, loss_cfg=lc)
  _close(m2, m1, what='metrics')
  assert abs(float(m1['loss'])) > 1e-3  # a loss that can differ
  diffs = {jax.tree_util.keystr(p): _maxdiff(a, b) for (p, a), b in
           zip(jax.tree_util.tree_leaves_with_path(tp.params), jax.tree.leaves(one.params))}
  diff = max(diffs.values())
  moved = max(_maxdiff(a, b) for a, b in
              zip(jax.tree.leaves(one.params), jax.tree.leaves(params)))
  assert diff <= 1e-6 and moved > 5e-4, (diffs, moved)  # Adam moved them by ~lr = 1e-3
  for x, sh in zip(jax.tree.leaves(tp.params), jax.tree.leaves(ts.param_sharding(params, mesh))):
    assert x.sharding.is_equivalent_to(sh, x.ndim), (x.sharding, sh)
  return float(m1['loss']), diff


def check_sampler(params, placed, mesh):
  """i.i.d. samples under the mesh (as the loop samples) equal one device's; the KV
  cache has its rows over ('data', 'fsdp') and its kv heads over 'model'."""
  from experiments.rollouts import sampling
  prompts = np.random.default_rng(3).integers(0, CFG.vocab_size, (B, PROMPT), dtype=np.int32)
  kw = dict(eos_id=1, pad_id=0)
  want = sampling.sample_iid(params, CFG, jax.random.PRNGKey(4), prompts, G, RESPONSE, **kw)
  rows = ts.batch_sharding(mesh)
  # The state the sampler's prefill (`sampling._start`) hands its decode loop, recorded
  # during the call: that call's own KV cache (no separate prefill to compile).
  started, real_start = [], sampling._start
  sampling._start = lambda *a, **k: started.append(real_start(*a, **k)) or started[-1]
  try:
    with jax.set_mesh(mesh):
      got = sampling.sample_iid(placed, CFG, jax.random.PRNGKey(4),
                                jax.device_put(prompts, rows), G, RESPONSE, **kw)
  finally:
    sampling._start = real_start
  (state,) = started
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  _close(got.logprobs, want.logprobs, what='sampled log-probs')
  want_cache = NamedSharding(mesh, P(None, ('data', 'fsdp'), None, 'model', None))
  for x, shape in ((state.cache.k, (2, B * G // 4, RESPONSE, 1, 16)),
                   (state.cache.v, (2, B * G // 4, RESPONSE, 1, 16)),
                   (state.cache.prefix_k, (2, B // 4, PROMPT, 1, 16)),
                   (state.cache.prefix_v, (2, B // 4, PROMPT, 1, 16))):
    assert x.sharding.is_equivalent_to(want_cache, 5), x.sharding
    assert x.addressable_shards[0].data.shape == shape  # each group's prompt held once


def main(params_path=None):
  """The 8-device checks; `params_path`: a pickle of CFG's params (the test process's
  `params` fixture, so this process compiles no initializer for them)."""
  assert jax.device_count() == 8, jax.devices()
  mesh = ts.make_mesh(2, model=2)
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'model': 2}
  if params_path:
    with open(params_path, 'rb') as f:
      params = pickle.load(f)
  else:
    params = decoder.init_params(jax.random.PRNGKey(0), CFG)
  placed = check_placement(params, CFG, mesh)
  lp_diff = check_logprobs(params, placed, CFG, mesh)
  loss, param_diff = check_train_step(params, mesh)
  check_sampler(params, placed, mesh)
  lora = decoder.init_params(jax.random.PRNGKey(5), LORA)
  lora = jax.tree_util.tree_map_with_path(  # non-zero B adapters: the LoRA path matters
      lambda p, x: np.asarray(x) + np.float32(0.05) if decoder.is_lora(p) else x, lora)
  lora_diff = check_logprobs(lora, check_placement(lora, LORA, mesh), LORA, mesh)
  print(f'OK logprobs {lp_diff:.2e} loss {loss:.4f} params {param_diff:.2e} '
        f'lora logprobs {lora_diff:.2e}')


@pytest.fixture(scope='module')
def params():
  """CFG's params: the 8-device subprocess's (pickled) and test_prefill's."""
  return decoder.init_params(jax.random.PRNGKey(0), CFG)


def test_model_axis_on_eight_devices_equals_one_device(params, tmp_path):
  with open(tmp_path / 'params.pkl', 'wb') as f:
    pickle.dump(_host(params), f)
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  env.pop('JAX_COORDINATOR_ADDRESS', None)
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path / 'params.pkl')],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert 'OK' in proc.stdout, proc.stdout


def test_refusals_name_the_sizes():
  with pytest.raises(ValueError, match=r'model=4 .*num_kv_heads=2'):
    ts.check_model_axis(CFG, 4)
  with pytest.raises(ValueError, match=r'model=3 .*num_heads=4.*vocab_size=48'):
    ts.check_model_axis(CFG, 3)
  ts.check_model_axis(CFG, 2)
  with pytest.raises(ValueError, match='does not divide'):
    ts.make_mesh(1, devices=jax.devices()[:1], model=2)
  with pytest.raises(ValueError, match=r"model=3 does not divide the 'heads' axis \(4\)"):
    ts.leaf_spec((2, 64, 4, 16), 1, 3, ('layers', 'embed', 'heads', 'head_dim'))
  # Without logical axes (step, rng) a leaf is never split over 'model'.
  assert ts.leaf_spec((2,), 2, 2, None) == P('fsdp')


def test_prefill_writes_the_repeated_cache(params):
  """`decoder.prefill` into a cache of B * n rows equals the B-row prefill repeated."""
  prompts = jax.random.randint(jax.random.PRNGKey(1), (3, PROMPT), 0, CFG.vocab_size)
  prefill = jax.jit(decoder.prefill, static_argnums=1)  # as the sampler runs it; op by op is slow
  _, small = prefill(params, CFG, prompts)
  _, big = prefill(params, CFG, prompts, decoder.init_cache(CFG, 3 * 4))
  for a, b in ((big.k, small.k), (big.v, small.v)):
    np.testing.assert_allclose(np.asarray(a), np.repeat(np.asarray(b), 4, axis=1), atol=1e-6)
  with pytest.raises(ValueError, match='multiple of the prompts'):
    decoder.prefill(params, CFG, prompts, decoder.init_cache(CFG, 4))


def test_loop_refuses_model_axis_before_the_warm_start(tmp_path):
  """A --config.mesh.model the model cannot split is refused by `loop.sft`, before any
  SFT step (not after the warm start, when the RL run builds its mesh)."""
  from experiments.training import loop
  from tests.test_loop import quick_cfg
  cfg = quick_cfg()
  cfg.mesh.model = 3  # the quick model has 2 heads
  with pytest.raises(ValueError, match=r'mesh model=3 .*num_heads=2'):
    loop.sft(cfg, str(tmp_path))
  assert not os.path.exists(tmp_path / 'checkpoints') or not os.listdir(tmp_path / 'checkpoints')


def test_suggest_mesh_does_not_assume_activations_split_over_model():
  """aot.suggest_mesh on a made-up result (no compile): 12 GiB of resident params and 10
  GiB of activations per device on 4 devices (fsdp 4, 16 GiB chips, 14.4 GiB budget).
  fsdp cannot grow past 4 devices here, so the fit needs more devices; a larger 'model'
  axis is not credited with splitting the activations (the residual stream stays whole)."""
  import types
  from experiments.training import aot
  gib = aot.GIB
  stage = aot.Stage(name='update', piece='update', compile_s=0.0, argument=12 * gib,
                    temp=10 * gib, output=0, alias=0, outside=0, scaled=12 * gib,
                    largest_args=[])
  result = types.SimpleNamespace(
      topo=types.SimpleNamespace(device_hbm=16 * gib), mesh=types.SimpleNamespace(size=4),
      shape=types.SimpleNamespace(fsdp=4, model=1, rows=256), stages=[stage], cfg=CFG)
  text = aot.suggest_mesh(result)
  f, m, n = map(int, re.match(r'--fsdp (\d+) --model_axis (\d+) on (\d+) devices', text).groups())
  assert n == 8 and f * m == 8, text  # params 12 -> 6 GiB, activations 10 -> 5 (m = 1)
  est = 12 * 4 / (f * m) + 10 * 4 / n * max(1, m)
  assert est <= 0.9 * 16 and f'{est:.2f} GiB' in text, (text, est)
  # 4 rows cannot split over 8 data x fsdp devices; model 2 keeps 1 row per device, whose
  # 10 GiB of activations are not assumed halved (that estimate, 6 + 5 GiB, fit).
  result.shape.rows = 4
  assert aot.suggest_mesh(result).startswith('nothing up to 16x'), aot.suggest_mesh(result)
  stage.temp = 1 * gib  # fits already
  assert aot.suggest_mesh(result) is None


if __name__ == '__main__':
  main(*sys.argv[1:])

