"""Tests for experiments.training.train_step (tiny model: d=32, 1 layer)."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.models import decoder
from experiments.training import train_step as ts

CFG = decoder.PolicyConfig(vocab_size=14, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                          max_len=16)
N, P, L = 8, 6, 5


_PARAMS = {}
_logprobs = jax.jit(decoder.token_logprobs, static_argnums=1)
_policy_loss = jax.jit(ts.policy_loss, static_argnums=(1, 2))


def init_params(seed=0):
  if seed not in _PARAMS:
    _PARAMS[seed] = decoder.init_params(jax.random.PRNGKey(seed), CFG)
  return jax.tree.map(jnp.copy, _PARAMS[seed])


def make_batch(seed=0, params=None):
  rng = np.random.default_rng(seed)
  prompts = jnp.asarray(rng.integers(0, 12, (N, P)), jnp.int32)
  tokens = jnp.asarray(rng.integers(0, 12, (N, L)), jnp.int32)
  lengths = rng.integers(1, L + 1, (N,))
  mask = jnp.asarray(np.arange(L)[None] < lengths[:, None])
  adv = jnp.asarray(rng.normal(size=(N, 1)) * np.ones((1, L)), jnp.float32) * mask
  if params is None:
    old = jnp.zeros((N, L))
  else:
    old, _ = _logprobs(params, CFG, prompts, tokens)
  return ts.Batch(prompts=prompts, tokens=tokens, mask=mask, advantages=adv,
                  old_logprobs=jnp.where(mask, old, 0.0), ref_logprobs=jnp.where(mask, old, 0.0))


def fresh_state(lr=1e-2, seed=0):
  params = init_params(seed)
  return ts.init_state(params, ts.make_optimizer(lr, 0), seed=seed)


LC = ts.LossConfig(num_epochs=2, num_minibatches=2, kl_coef=0.1, agg='seq-mean-token-mean')
LC_MICRO = dataclasses.replace(LC, num_microbatches=2)


def test_loss_decreases_clips_and_microbatches_match():
  state0 = fresh_state(lr=1e-2)
  batch = make_batch(params=state0.params)
  runs = {}
  for lc in (LC, LC_MICRO):
    state, losses = jax.tree.map(jnp.copy, state0), []
    for _ in range(4):
      state, m = ts.train_step_jit(state, batch, cfg=CFG, loss_cfg=lc)
      losses.append(float(m['loss']))
    runs[lc.num_microbatches] = (state, losses, m)
  state, losses, m = runs[1]
  assert losses[-1] < losses[0] - 0.1, losses
  assert int(state.step) == 16
  assert float(m['clip_frac']) > 0.0
  assert float(m['approx_kl']) > 0.0
  assert float(m['kl_ref']) > 0.0
  for k in ('loss', 'pg_loss', 'clip_frac', 'approx_kl', 'entropy', 'grad_norm'):
    assert np.isfinite(float(m[k])), k
  # Gradient accumulation over 2 micro-batches == one minibatch (same updates).
  np.testing.assert_allclose(runs[2][1], losses, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(runs[2][0].params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, b, atol=1e-5)


HAND = [
    ('token-mean', 7 / 3),
    ('seq-mean-token-mean', (1.5 + 4.0) / 2),
    ('seq-mean-token-sum', 7 / 2),
    ('seq-mean-token-sum-norm', 7 / 6),
]


def test_aggregation_semantics_hand_example():
  # Per-token losses [[1, 2, -], [4, -, -]]: ratio 1 and advantage -l give pg = l.
  mask = jnp.array([[True, True, False], [True, False, False]])
  l = jnp.array([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
  for agg, expected in HAND:
    w = ts.token_weights(mask, agg)
    assert float(jnp.sum(w * jnp.where(mask, l, 0.0))) == pytest.approx(expected, rel=1e-6)
  params = init_params(0)
  prompts = jnp.zeros((2, P), jnp.int32)
  tokens = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
  old, _ = _logprobs(params, CFG, prompts, tokens)
  mb = ts.Batch(prompts=prompts, tokens=tokens, mask=mask, advantages=-l, old_logprobs=old)
  for agg, expected in HAND:  # policy_loss only sees the weights: one compiled program
    w = ts.token_weights(mask, agg)
    loss, _ = _policy_loss(params, CFG, ts.LossConfig(), mb,
                           (w, ts.token_weights(mask, 'token-mean')))
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_clip_higher_and_dual_clip():
  params = init_params(0)
  prompts = jnp.zeros((1, P), jnp.int32)
  tokens = jnp.array([[1, 2, 3, 4]], jnp.int32)
  logp, _ = _logprobs(params, CFG, prompts, tokens)
  # log-ratios: +1 (r=e), -1 (r=1/e), +2 (r=e^2), 0
  old = logp - jnp.array([[1.0, -1.0, 2.0, 0.0]])
  adv = jnp.array([[1.0, -1.0, -1.0, 1.0]])
  mask = jnp.ones((1, 4), bool)
  lc = ts.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, agg='seq-mean-token-sum')
  mb = ts.Batch(prompts=prompts, tokens=tokens, mask=mask, advantages=adv, old_logprobs=old)
  w = ts.token_weights(mask, lc.agg)
  loss, aux = _policy_loss(params, CFG, lc, mb, (w, ts.token_weights(mask, 'token-mean')))
  # t0: A>0, r=e -> clipped at 1.28 -> -1.28; t1: A<0, r=1/e -> max(1/e, 0.8) = 0.8;
  # t2: A<0, r=e^2 -> max(e^2, 0.8)=e^2, dual clip min(e^2, 3) = 3; t3: -1.
  expected = -1.28 + 0.8 + 3.0 - 1.0
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  assert float(aux['clip_frac']) == pytest.approx(0.5)


def test_microbatch_losses_and_grads_sum_to_full_batch_for_every_mode():
  params = init_params(0)
  batch = make_batch(seed=2)
  batch = batch.replace(old_logprobs=batch.old_logprobs - 0.3 * batch.mask)
  lc = ts.LossConfig()
  grad = jax.jit(jax.value_and_grad(ts.policy_loss, has_aux=True), static_argnums=(1, 2))
  wm = ts.token_weights(batch.mask, 'token-mean')
  rows = jnp.arange(N)[:, None]
  for agg in ts.AGG_MODES:  # weights normalised by the whole batch's counts
    w = ts.token_weights(batch.mask, agg)
    (full, _), g_full = grad(params, CFG, lc, batch, (w, wm))
    # Micro-batch i = rows [i N/2, (i+1) N/2): zero weight elsewhere (rows are independent),
    # which keeps one compiled program for all calls.
    parts = []
    for i in range(2):
      keep = (rows >= i * N // 2) & (rows < (i + 1) * N // 2)
      parts.append(grad(params, CFG, lc, batch, (w * keep, wm * keep)))
    np.testing.assert_allclose(parts[0][0][0] + parts[1][0][0], full, rtol=1e-5)
    g_sum = jax.tree.map(jnp.add, parts[0][1], parts[1][1])
    for a, b in zip(jax.tree.leaves(g_sum), jax.tree.leaves(g_full)):
      np.testing.assert_allclose(a, b, atol=1e-6)


def test_sft_step_increases_demo_loglik():
  state = fresh_state(lr=1e-2)
  batch = make_batch(seed=3)
  sft_loss = jax.jit(ts.sft_loss, static_argnums=1)
  before = -float(sft_loss(state.params, CFG, batch.prompts, batch.tokens, batch.mask))
  for _ in range(5):
    state, m = ts.sft_step_jit(state, batch.prompts, batch.tokens, batch.mask, cfg=CFG)
  after = -float(sft_loss(state.params, CFG, batch.prompts, batch.tokens, batch.mask))
  assert after > before + 0.1


def test_bad_loss_config_errors():
  with pytest.raises(ValueError, match='token-mean'):
    ts.LossConfig(agg='mean')
  with pytest.raises(ValueError, match='k3'):
    ts.LossConfig(kl_estimator='k4')


SCRIPT = textwrap.dedent('''
    import sys
    import jax, numpy as np
    assert jax.device_count() == 8, jax.devices()
    from tests_helper import CFG, LC, make_batch, fresh_state, ts
    # 8 devices as data=4 x fsdp=2: data-parallel batch and fsdp-sharded params at once.
    mesh = ts.make_mesh(fsdp=2, devices=jax.devices())
    state = ts.shard_state(fresh_state(lr=1e-2), mesh)
    batch = ts.shard_batch(make_batch(seed=4, params=state.params), mesh)
    batch = batch.replace(old_logprobs=batch.old_logprobs - 0.1 * batch.mask)
    state, m = ts.train_step_jit(state, batch, cfg=CFG, loss_cfg=LC)
    assert len(batch.tokens.sharding.device_set) == 8
    assert not all(l.sharding.is_fully_replicated for l in jax.tree.leaves(state.params))
    np.savez(sys.argv[1], np.asarray(m['loss']), *map(np.asarray, jax.tree.leaves(state.params)))
    print('OK', float(m['loss']))
''')


def test_eight_devices_match_one(tmp_path):
  """One train_step (2 epochs x 2 minibatches, KL) on 8 devices (a subprocess) equals the
  one-device step, run here: the program test_loss_decreases_clips_and_microbatches_match
  compiled (LC; the 'token-mean' loss on a mesh: test_tensor_parallel's train step)."""
  helper = tmp_path / 'tests_helper.py'
  helper.write_text(open(__file__).read().split('\nSCRIPT = ')[0])
  (tmp_path / 'run.py').write_text(SCRIPT)
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  env.pop('JAX_COORDINATOR_ADDRESS', None)
  proc = subprocess.run([sys.executable, str(tmp_path / 'run.py'), str(tmp_path / 'eight.npz')],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'OK' in proc.stdout
  state = fresh_state(lr=1e-2)
  batch = make_batch(seed=4, params=state.params)
  batch = batch.replace(old_logprobs=batch.old_logprobs - 0.1 * batch.mask)
  state, m = ts.train_step_jit(state, batch, cfg=CFG, loss_cfg=LC)
  eight = np.load(tmp_path / 'eight.npz')
  loss, *params = (eight[f'arr_{i}'] for i in range(len(eight.files)))
  np.testing.assert_allclose(loss, float(m['loss']), atol=1e-5)
  leaves = jax.tree.leaves(state.params)
  assert len(params) == len(leaves)
  # Adam at lr 1e-2 turns reduction-order rounding of near-zero gradients into
  # parameter differences up to ~3e-5 (one element in 2048 with stacked layers).
  for a, b in zip(params, leaves):
    np.testing.assert_allclose(a, b, atol=1e-4)
