"""LoRA updates differentiate only the adapters (experiments.training.train_step, issue 19).

Tiny model with a 256-token vocabulary so that the frozen weights' gradients (which
the adapter-only step must not compute) are a visible share of the FLOPs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.models import decoder
from experiments.training import train_step as ts

BASE = decoder.PolicyConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                            max_len=24)
CFG = dataclasses.replace(BASE, lora_rank=2, lora_alpha=4.0)
N, P, L = 8, 6, 8
LC = ts.LossConfig(num_minibatches=2, kl_coef=0.1)
LC_MICRO = dataclasses.replace(LC, num_microbatches=2)


@pytest.fixture(scope='module')
def base_params():
  return decoder.init_params(jax.random.PRNGKey(0), BASE)


@pytest.fixture(scope='module')
def lora_params(base_params):
  params = decoder.add_lora(jax.random.PRNGKey(1), base_params, CFG)
  # Non-zero B factors, so that the adapters' gradients involve both factors.
  return jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape)
      if 'lora_b' in jax.tree_util.keystr(p) else x, params)


@pytest.fixture(scope='module')
def batch(lora_params):
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(0, 256, (N, P)), jnp.int32)
  tokens = jnp.asarray(rng.integers(0, 256, (N, L)), jnp.int32)
  mask = jnp.asarray(np.arange(L)[None] < rng.integers(1, L + 1, (N, 1)))
  old, _ = jax.jit(decoder.token_logprobs, static_argnums=1)(lora_params, CFG, prompts, tokens)
  adv = jnp.asarray(rng.normal(size=(N, 1)) * np.ones((1, L)), jnp.float32)
  return ts.Batch(prompts=prompts, tokens=tokens, mask=mask, advantages=adv * mask,
                  old_logprobs=jnp.where(mask, old + 0.05, 0.0),
                  ref_logprobs=jnp.where(mask, old, 0.0))


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


def placed(state):
  """The state committed to the device, as `loop.restore_checkpoint` returns one: the
  train steps here and the resumed one in test_lora_resume_is_exact run one program
  (uncommitted arrays would compile another)."""
  return jax.device_put(state, jax.devices()[0])


def masked_reference_tx(lr):
  """The former lora_only optimizer: full gradients, frozen leaves' updates zeroed."""
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))
  labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: 'train' if decoder.is_lora(path) else 'freeze', params)
  return optax.multi_transform({'train': inner, 'freeze': optax.set_to_zero()}, labels)


def test_split_and_merge_adapters(lora_params, base_params):
  adapters = ts.split_adapters(lora_params)
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters)]
  assert len(names) == 14 and all('lora' in n for n in names)
  want = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(lora_params)
          if decoder.is_lora(p)]
  assert names == want
  doubled = ts.with_adapters(lora_params, jax.tree.map(lambda x: 2 * x, adapters))
  assert jax.tree.structure(doubled) == jax.tree.structure(lora_params)
  for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(doubled),
                       jax.tree.leaves(lora_params)):
    np.testing.assert_array_equal(x, 2 * y if decoder.is_lora(p) else y)
  assert ts.split_adapters(base_params) == {}
  with pytest.raises(ValueError, match='no LoRA adapter leaves'):
    ts.init_state(base_params, ts.make_optimizer(1e-3, lora_only=True))
  with pytest.raises(ValueError, match='adapters not in params'):
    ts.with_adapters(lora_params, {'blocks': {'zz': {'kernel_lora_a': jnp.zeros(1)}}})


def test_optimizer_state_covers_adapters_only(lora_params):
  state = ts.init_state(lora_params, ts.make_optimizer(1e-3, lora_only=True))
  assert isinstance(state.tx, ts.AdapterOptimizer)
  n_adapters = decoder.num_params(ts.split_adapters(lora_params))
  n_state = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert n_state == 2 * n_adapters + 1  # Adam's two moments and its step count
  assert n_adapters < decoder.num_params(lora_params) / 10


@pytest.mark.parametrize('loss_cfg', [LC, LC_MICRO], ids=['one_micro', 'two_micro'])
def test_adapter_step_equals_masked_full_gradient_step(lora_params, batch, loss_cfg):
  """Same updates as differentiating everything and zeroing the frozen leaves' updates;
  the frozen leaves stay bit-identical."""
  new = placed(ts.init_state(copy(lora_params), ts.make_optimizer(1e-2, lora_only=True)))
  ref = placed(ts.init_state(copy(lora_params), masked_reference_tx(1e-2)))
  for _ in range(2):
    new, m_new = ts.train_step_jit(new, batch, cfg=CFG, loss_cfg=loss_cfg)
    ref, m_ref = ts.train_step_jit(ref, batch, cfg=CFG, loss_cfg=loss_cfg)
  moved = False
  for (p, a), b, c in zip(jax.tree_util.tree_leaves_with_path(new.params),
                          jax.tree.leaves(ref.params), jax.tree.leaves(lora_params)):
    if decoder.is_lora(p):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(p))
      moved |= bool(np.any(np.asarray(a) != np.asarray(c)))
    else:
      np.testing.assert_array_equal(a, c, err_msg=jax.tree_util.keystr(p))
  assert moved
  np.testing.assert_allclose(m_new['loss'], m_ref['loss'], rtol=1e-5, atol=1e-7)
  # grad_norm is over the adapters now (it was over every leaf, frozen ones included).
  assert float(m_new['grad_norm']) < float(m_ref['grad_norm'])


def test_adapter_gradients_equal_full_gradients_restricted(lora_params, batch):
  w = ts.token_weights(batch.mask, 'token-mean')
  loss = lambda params: ts.policy_loss(params, CFG, LC, batch, (w, w))[0]
  # Both gradients in one program (one compile): d/d(all leaves), and d/d(adapters) with
  # the frozen leaves taken as they are.
  full, only = jax.jit(lambda p: (jax.grad(loss)(p), jax.grad(
      lambda a: loss(ts.with_adapters(p, a)))(ts.split_adapters(p))))(lora_params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
               only, ts.split_adapters(full))


def _flops(state, batch):
  # train_step_jit at lr 1e-2: the LoRA and masked steps are the programs that
  # test_adapter_step_equals_masked_full_gradient_step[one_micro] compiled (donation and the
  # learning rate leave the FLOPs as they are).
  c = ts.train_step_jit.lower(state, batch, cfg=CFG, loss_cfg=LC).compile()
  cost = c.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if not cost or 'flops' not in cost:
    pytest.skip('this backend reports no cost analysis')
  return float(cost['flops'])


def test_frozen_weights_get_no_gradient_computation(lora_params, batch):
  """The compiled LoRA step does ~2/3 of full fine-tuning's FLOPs (forward + input
  gradients, no weight gradients of the frozen matmuls, no Adam over the base)."""
  lora = _flops(placed(ts.init_state(lora_params, ts.make_optimizer(1e-2, lora_only=True))),
                batch)
  masked = _flops(placed(ts.init_state(lora_params, masked_reference_tx(1e-2))), batch)
  full = _flops(placed(ts.init_state(lora_params, ts.make_optimizer(1e-2))), batch)
  assert lora < 0.75 * full, (lora, full)
  assert lora < 0.75 * masked, (lora, masked)


def _dot_outputs(jaxpr, out=None):
  """Sorted output shapes of every dot_general in a jaxpr and its sub-jaxprs (a scan or
  cond body counted once), and the number of scatter-adds."""
  out = out if out is not None else dict(dots=[], scatter_adds=0)
  for e in jaxpr.eqns:
    if e.primitive.name == 'dot_general':
      out['dots'].append(tuple(sorted(e.outvars[0].aval.shape)))
    out['scatter_adds'] += e.primitive.name == 'scatter-add'
    for v in e.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        if hasattr(sub, 'eqns'):
          _dot_outputs(sub, out)
        elif hasattr(sub, 'jaxpr') and hasattr(sub, 'consts'):
          _dot_outputs(sub.jaxpr, out)
  return out


def test_jaxpr_has_no_frozen_weight_gradient_matmuls(lora_params, batch):
  """Each frozen matmul x @ W costs the full step a forward, a dx and a dW dot_general;
  the adapter-only step drops exactly the dW ones (one per frozen kernel: 7 projections
  in the scanned block body + the head) and the embedding's scatter-add gradient, and
  no dot_general of its backward has a frozen kernel's shape."""
  def trace(tx):
    state = ts.init_state(lora_params, tx)
    return _dot_outputs(jax.make_jaxpr(
        lambda s: ts.train_step(s, batch, cfg=CFG, loss_cfg=LC))(state).jaxpr)
  lora = trace(ts.make_optimizer(1e-3, lora_only=True))
  full = trace(ts.make_optimizer(1e-3))
  kernels = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(lora_params)
             if not decoder.is_lora(p) and jax.tree_util.keystr(p).endswith("['kernel']")]
  assert len(kernels) == 8
  # Per-layer shapes (the blocks' kernels are stacked over layers and scanned).
  shapes = {tuple(sorted(x.shape[1:] if 'blocks' in jax.tree_util.keystr(p) else x.shape))
            for p, x in kernels}
  assert len(full['dots']) - len(lora['dots']) == len(kernels), (len(full['dots']),
                                                               len(lora['dots']))
  assert full['scatter_adds'] - lora['scatter_adds'] == 1  # the embedding gradient
  assert shapes <= set(full['dots'])
  assert not shapes & set(lora['dots']), shapes & set(lora['dots'])


def test_sft_step_trains_adapters_only(lora_params, batch):
  state = ts.init_state(copy(lora_params), ts.make_optimizer(1e-2, lora_only=True))
  losses = []
  for _ in range(3):
    state, m = ts.sft_step_jit(state, batch.prompts, batch.tokens, batch.mask, cfg=CFG)
    losses.append(float(m['loss']))
  assert losses[-1] < losses[0]
  for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params),
                       jax.tree.leaves(lora_params)):
    if not decoder.is_lora(p):
      np.testing.assert_array_equal(a, b)


def test_lora_resume_is_exact(lora_params, batch, tmp_path):
  """Two train steps straight == one, orbax checkpoint, restore, one more (bitwise)."""
  from experiments.training import loop
  tx = ts.make_optimizer(1e-2, lora_only=True)
  straight = placed(ts.init_state(copy(lora_params), tx, seed=3))
  for _ in range(2):
    straight, _ = ts.train_step_jit(straight, batch, cfg=CFG, loss_cfg=LC)
  first, _ = ts.train_step_jit(placed(ts.init_state(copy(lora_params), tx, seed=3)), batch,
                               cfg=CFG, loss_cfg=LC)
  mngr = loop._manager(str(tmp_path / 'ckpt'))
  loop.save_checkpoint(mngr, 1, first, dict(fingerprint='fp', config={}))
  template = ts.init_state(copy(lora_params), tx, seed=0)
  restored, meta = loop.restore_checkpoint(mngr, template, 'fp', {})
  mngr.close()
  # One optimizer step per minibatch.
  assert meta['fingerprint'] == 'fp' and int(restored.step) == LC.num_minibatches
  resumed, _ = ts.train_step_jit(restored, batch, cfg=CFG, loss_cfg=LC)
  assert jax.tree.structure(resumed.opt_state) == jax.tree.structure(straight.opt_state)
  jax.tree.map(np.testing.assert_array_equal,
               (resumed.params, resumed.opt_state, resumed.step, resumed.rng),
               (straight.params, straight.opt_state, straight.step, straight.rng))


def test_lora_with_bfloat16_compute(lora_params, batch):
  """qwix's float32 adapters on a bfloat16 model: the residual stream stays bfloat16
  (it once became float32 and broke the layer scan), and the forward matches the
  merged model's within bfloat16 rounding."""
  cfg16 = dataclasses.replace(CFG, dtype=jnp.bfloat16)
  merged, base16 = decoder.merge_lora(lora_params, cfg16)

  @jax.jit  # the three forwards in one program (eagerly each op compiles on its own)
  def forwards(lora_params, merged):
    run = lambda p, c: decoder.token_logprobs(p, c, batch.prompts, batch.tokens)[0]
    return (run(lora_params, cfg16), run(merged, base16),
            run(lora_params, dataclasses.replace(cfg16, lora_rank=0)))

  lp, want, base = forwards(lora_params, merged)
  err, without = np.abs(lp - want).max(), np.abs(base - want).max()
  assert np.all(np.isfinite(lp)) and err < 0.1 and err < without / 10, (err, without)
  state = ts.init_state(lora_params, ts.make_optimizer(1e-3, lora_only=True))
  _, m = ts.train_step_jit(state, batch, cfg=cfg16, loss_cfg=LC)
  assert np.isfinite(float(m['loss']))
