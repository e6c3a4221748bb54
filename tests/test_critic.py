"""The learned critic (experiments/training/critic.py) and PPO in the loop (issue 24).

References: verl's clipped value loss in plain numpy; TD(λ) targets against a loop; the
value head reading the state before each token (causality, padding); micro-batching equal
to one batch; a quick PPO run whose critic learns, is checkpointed and restores.
"""

import dataclasses
import functools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import credit
from experiments.models import decoder
from experiments.training import critic as critic_lib
from groups import grpo_ref
from experiments.training import train_step as ts

CFG = decoder.PolicyConfig(vocab_size=11, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                           max_len=12)


def np_value_loss(v, old, ret, mask, clip, agg):
  """verl `compute_value_loss` in numpy (token-mean / seq-mean-token-mean)."""
  v, old, ret = (np.asarray(x, np.float64) for x in (v, old, ret))
  mask = np.asarray(mask, bool)
  l1 = (v - ret) ** 2
  if clip:
    l2 = (old + np.clip(v - old, -clip, clip) - ret) ** 2
    loss, frac = np.maximum(l1, l2), (np.abs(v - old) > clip) & (l2 > l1)
  else:
    loss, frac = l1, np.zeros_like(l1, bool)
  if agg == 'token-mean':
    agg_loss = loss[mask].mean()
  else:  # seq-mean-token-mean over rows with a token
    rows = [loss[i][mask[i]].mean() for i in range(len(mask)) if mask[i].any()]
    agg_loss = float(np.sum(rows)) / len(mask)
  return 0.5 * agg_loss, frac[mask].mean()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.2, 0.5]),
       st.sampled_from(['token-mean', 'seq-mean-token-mean']))
def test_value_loss_matches_verl_in_numpy(seed, clip, agg):
  rng = np.random.default_rng(seed)
  shape = (4, 6)
  v, old, ret = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
  mask = np.arange(6) < rng.integers(1, 7, (4, 1))
  loss, frac = critic_lib.value_loss(v, old, ret, mask, clip, agg)
  want_loss, want_frac = np_value_loss(v, old, ret, mask, clip, agg)
  assert float(loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
  assert float(frac) == pytest.approx(want_frac, abs=1e-6)
  if clip:  # V = V_old: clipping changes nothing
    assert float(critic_lib.value_loss(old, old, ret, mask, clip, agg)[0]) == pytest.approx(
        np_value_loss(old, old, ret, mask, 0.0, agg)[0], rel=1e-5)


def test_targets_are_gae_plus_values_and_monte_carlo_at_lambda_1():
  rng = np.random.default_rng(0)
  mask = np.arange(5) < np.array([[5], [3], [1]])
  values = rng.normal(size=(3, 5)).astype(np.float32)
  rewards = np.array([1.0, 0.0, 2.0], np.float32)
  mc = critic_lib.targets(rewards, values, mask, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(mc, np.where(mask, rewards[:, None], 0.0), atol=1e-6)
  gamma, lam = 0.9, 0.7
  got = np.asarray(critic_lib.targets(rewards, values, mask, gamma=gamma, lam=lam))
  for i in range(3):  # loop: G^λ_t = r_t + γ((1 − λ) V_{t+1} + λ G^λ_{t+1}), V, G = 0 after
    n, g_next, v_next = int(mask[i].sum()), 0.0, 0.0
    for t in reversed(range(n)):
      r = rewards[i] if t == n - 1 else 0.0
      g = r + gamma * ((1 - lam) * v_next + lam * g_next)
      assert got[i, t] == pytest.approx(g, abs=1e-5)
      g_next, v_next = g, float(values[i, t])
  adv = credit.get('gae')(credit.Rollouts(tokens=np.zeros((3, 5), np.int32), mask=mask,
                                          rewards=rewards, values=values), gamma=gamma, lam=lam)
  np.testing.assert_allclose(got, np.where(mask, np.asarray(adv) + values, 0.0), atol=1e-5)


def test_ppo_estimator_is_whitened_gae_with_verls_defaults():
  rng = np.random.default_rng(1)
  mask = np.arange(6) < rng.integers(1, 7, (2, 4, 1))
  r = credit.Rollouts(tokens=np.zeros((2, 4, 6), np.int32), mask=mask,
                      rewards=rng.normal(size=(2, 4)).astype(np.float32),
                      values=rng.normal(size=(2, 4, 6)).astype(np.float32))
  raw = np.asarray(credit.get('gae')(r, gamma=1.0, lam=1.0), np.float64)
  x = raw[mask]  # whitened over every unmasked token of the batch (population std)
  want = np.where(mask, (raw - x.mean()) / (x.std() + 1e-8), 0.0)
  np.testing.assert_allclose(credit.get('ppo')(r), want, atol=1e-5)
  assert credit.needs('ppo') == credit.needs('gae') == ('values',)


@pytest.fixture(scope='module')
def policy():
  return decoder.init_params(jax.random.PRNGKey(0), CFG)


# The value forward as the loop runs it, jitted (op by op it compiles a hundred programs).
value_forward = functools.partial(critic_lib.values_jit, cfg=CFG)


def test_values_read_the_state_before_each_token(policy):
  params = critic_lib.init_params(policy, CFG)
  v0 = value_forward(params, prompts=jnp.ones((1, 3), jnp.int32),
                     responses=jnp.ones((1, 4), jnp.int32))
  assert 0 < float(jnp.abs(v0).max()) < 0.1  # a small random head: V ≈ 0 at the start
  params['value_head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1), (CFG.d_model,))
  prompts = jnp.asarray([[3, 4, 5]], jnp.int32)
  resp = jnp.asarray([[6, 7, 8, 9]], jnp.int32)
  v = np.asarray(value_forward(params, prompts=prompts, responses=resp))[0]
  changed = np.asarray(value_forward(params, prompts=prompts, responses=resp.at[0, 2].set(1)))[0]
  np.testing.assert_allclose(v[:3], changed[:3], atol=1e-6)  # V(s_t) sees responses[:t]
  assert abs(v[3] - changed[3]) > 1e-6
  # A right-padded prompt with its length gives the same values as the unpadded prompt.
  padded = value_forward(params, prompts=jnp.asarray([[3, 4, 5, 0, 0]], jnp.int32),
                         responses=resp, prompt_len=jnp.asarray([3], jnp.int32))
  np.testing.assert_allclose(np.asarray(padded)[0], v, atol=1e-5)
  with pytest.raises(ValueError, match='LoRA'):
    critic_lib.init_params(policy, dataclasses.replace(CFG, lora_rank=2))


def _batch(rng, n=8, p=3, l=5):
  mask = np.arange(l) < rng.integers(1, l + 1, (n, 1))
  return critic_lib.CriticBatch(
      prompts=jnp.asarray(rng.integers(0, 11, (n, p)), jnp.int32),
      tokens=jnp.asarray(rng.integers(0, 11, (n, l)), jnp.int32), mask=jnp.asarray(mask),
      old_values=jnp.zeros((n, l), jnp.float32),
      returns=jnp.asarray(np.where(mask, rng.normal(size=(n, 1)), 0.0), jnp.float32))


def test_critic_step_fits_returns_and_micro_batches_are_exact(policy):
  batch = _batch(np.random.default_rng(2))
  tx = ts.make_optimizer(3e-3)
  one = critic_lib.CriticConfig(cliprange_value=0.0)
  two = critic_lib.CriticConfig(cliprange_value=0.0, num_microbatches=2)
  # Jitted, as the loop runs it; the whole batch's program also takes the 60 steps below.
  step = jax.jit(lambda s: critic_lib.critic_step(s, batch, cfg=CFG, ccfg=one))
  s1, m1 = step(critic_lib.init_state(policy, CFG, tx))
  s2, m2 = jax.jit(lambda s: critic_lib.critic_step(s, batch, cfg=CFG, ccfg=two))(
      critic_lib.init_state(policy, CFG, tx))
  assert float(m1['vf_loss']) == pytest.approx(float(m2['vf_loss']), rel=1e-5)
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  state, losses = s1, [float(m1['vf_loss'])]  # step 1 of 60
  for _ in range(59):
    state, m = step(state)
    losses.append(float(m['vf_loss']))
  assert losses[-1] < 0.2 * losses[0], losses[::10]
  with pytest.raises(ValueError, match='not divisible'):
    critic_lib.critic_step(state, batch, cfg=CFG,
                           ccfg=critic_lib.CriticConfig(num_minibatches=3))
  with pytest.raises(ValueError, match='cliprange_value'):
    critic_lib.CriticConfig(cliprange_value=-1.0)


@pytest.mark.slow  # ~15 s; the critic's path and checkpoint exactly: test_golden's ppo_warmup
def test_quick_ppo_run_trains_and_checkpoints_its_critic(tmp_path):
  """PPO through the loop on the quick scratch config: the critic's loss is logged, its
  state saved with the step and restored (not the initial one)."""
  from configs import ppo
  from experiments.training import loop
  from tests.test_loop import quick_cfg
  cfg = quick_cfg()
  with cfg.unlocked():
    cfg.critic = ppo.get_config().critic
    cfg.critic.lr = 1e-2
  cfg.rl.steps, cfg.rl.ckpt_every = 2, 2
  from tests.test_loop import init_params
  init = init_params(cfg)
  loop.train(cfg, str(tmp_path), init, method='ppo:iid', progress=False)
  rows = [r for r in loop.read_metrics(str(tmp_path / 'metrics.jsonl')) if 'reward' in r]
  assert len(rows) == 2 and all(np.isfinite(r['critic/vf_loss']) for r in rows)
  assert all(r['critic_s'] > 0 for r in rows)
  pcfg = loop.build_problem(cfg).pcfg
  o, mesh = cfg.optimizer, ts.make_mesh(1)
  template, _, gamma_lam = critic_lib.from_config(loop.with_method(cfg, 'ppo:iid'), init,
                                                  pcfg, 0, mesh)
  assert gamma_lam == (1.0, 1.0)  # the ppo estimator's γ and λ
  state = ts.init_state(init, ts.make_optimizer(o.lr, o.warmup_steps, o.weight_decay,
                                                o.grad_clip, o.b1, o.b2))
  mngr = loop._manager(str(tmp_path / 'checkpoints'))
  meta = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
      meta=ocp.args.JsonRestore()))['meta']
  with warnings.catch_warnings():
    warnings.simplefilter('error', RuntimeWarning)  # a checkpoint set aside would warn
    _, meta2, aux = loop.restore_checkpoint(mngr, state, meta['fingerprint'],
                                            meta['config'], dict(critic=template))
  restored = aux['critic']
  updates = 2 * cfg.loss.num_epochs * cfg.loss.num_minibatches  # one per critic minibatch
  assert meta2['rl_step'] == 2 and int(restored.step) == updates
  head = np.asarray(restored.params['value_head']['kernel'])
  assert not np.allclose(head, template.params['value_head']['kernel'])  # trained, restored
  # Resuming the finished run restores policy and critic (no new rows).
  with warnings.catch_warnings():
    warnings.simplefilter('error', RuntimeWarning)
    loop.train(cfg, str(tmp_path), init, method='ppo:iid', progress=False)
  assert len(loop.read_metrics(str(tmp_path / 'metrics.jsonl'))) == len(rows) + 1


@pytest.mark.slow  # ~20 s: the script end to end (compiles a critic and four estimators)
def test_critic_quality_script_runs(tmp_path):
  """experiments/critic_quality.py end to end on a tiny budget: the nonparametric rows and a
  critic row per budget, finite, written to its workdir."""
  import json
  from experiments import critic_quality
  s = critic_quality.main(['--budgets', '256', '--seeds', '1', '--eval_prompts', '16',
                           '--group_size', '4', '--targets', 'returns,tree',
                           '--workdir', str(tmp_path)])
  assert set(s['nonparametric']) == set(critic_quality.NONPARAMETRIC)
  assert list(s['critic']) == [256] and list(s['critic_tree']) == [256]
  assert all(np.isfinite(m['corr'][0]) for m in s['nonparametric'].values())
  assert np.isfinite(s['critic'][256]['corr'][0])
  saved = json.load(open(tmp_path / 'critic_quality.json'))
  assert saved['runs'][0]['critic']['256']['tokens'] > 0
  assert (tmp_path / 'critic_quality.png').exists()


def test_tree_targets_are_prefix_means():
  """The critic's 'tree' labels (loop and critic_quality): V(s_t) = mean reward of the group's responses that share the
  first t tokens (plain loops over one random group)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 2, (1, 6, 4)).astype(np.int32)
  mask = np.arange(4) < rng.integers(1, 5, (1, 6, 1))
  rewards = rng.random((1, 6)).astype(np.float32)
  got = np.asarray(critic_lib.tree_targets(tokens, mask, rewards))[0]
  for g in range(6):
    for t in range(int(mask[0, g].sum())):
      same = [h for h in range(6) if mask[0, h, :t].sum() == t and mask[0, h].sum() >= t
              and (tokens[0, h, :t] == tokens[0, g, :t]).all()]
      np.testing.assert_allclose(got[g, t], np.mean(rewards[0, same]), rtol=1e-6)


def test_critic_targets_option_keeps_old_fingerprints_and_refuses_unknown():
  from configs import ppo as ppo_config
  from experiments.training import loop
  base, tree = ppo_config.get_config(), ppo_config.get_config('tree')
  assert base.critic.targets == 'td_lambda' and tree.critic.targets == 'tree'
  fp = lambda c: loop.fingerprint(loop.run_config(loop.with_method(c, 'ppo:iid'), 0))[0]
  old = base.copy_and_resolve_references()
  del old.critic['targets']  # a config from before the option
  assert fp(base) == fp(old) and fp(tree) != fp(base)
  old.critic.loss, old.critic.critic_warmup = 'mse', 0  # the defaults keep them too
  assert fp(old) == fp(base)
  pum = ppo_config.get_config('pum')
  assert (pum.critic.targets, pum.critic.loss) == ('tree', 'rank') and fp(pum) != fp(tree)
  with pytest.raises(ValueError, match='critic targets'):
    critic_lib.CriticConfig(targets='returns')


def test_advantage_targets_and_the_advantage_model_estimator():
  rng = np.random.default_rng(0)
  mask = np.arange(5) < rng.integers(0, 6, (2, 4))[..., None]
  rewards = rng.integers(0, 2, (2, 4)).astype(np.float32)
  got = np.asarray(critic_lib.advantage_targets(jnp.asarray(mask), jnp.asarray(rewards)))
  want = np.where(mask, (rewards - rewards.mean(-1, keepdims=True))[..., None], 0.0)
  np.testing.assert_allclose(got, want, atol=1e-6)
  # A model whose outputs equal its labels gives R − μ on every token (Dr. GRPO's A).
  r = credit.Rollouts(tokens=jnp.zeros(mask.shape, jnp.int32), mask=jnp.asarray(mask),
                      rewards=jnp.asarray(rewards), values=jnp.asarray(want))
  full = np.where(mask, (rewards - rewards.mean(-1, keepdims=True))[..., None], 0.0)
  np.testing.assert_allclose(credit.get('advantage_model')(r), full, atol=1e-6)
  np.testing.assert_allclose(credit.get('dr_grpo')(r), full, atol=1e-6)
  # The score is read before the last token, then centred over the group.
  v = rng.normal(size=mask.shape).astype(np.float32)
  for center in (True, False):
    adv = np.asarray(credit.get('advantage_model')(r.replace(values=jnp.asarray(v)),
                                                   center=center))
    for b in range(2):
      n = mask[b].sum(-1)
      score = np.array([v[b, g, n[g] - 1] if n[g] else 0.0 for g in range(4)])
      score = score - score.mean() if center else score
      np.testing.assert_allclose(adv[b], np.where(mask[b], score[:, None], 0.0), atol=1e-6)
  with pytest.raises(ValueError, match='values'):
    credit.get('advantage_model')(r.replace(values=None))


def test_advantage_targets_go_with_the_advantage_model_only():
  from configs import ppo as ppo_config
  from experiments.training import loop
  cfg = ppo_config.get_config('advantage')
  assert cfg.critic.targets == 'advantage'
  init = {'w': jnp.zeros(1)}
  with pytest.raises(ValueError, match="goes with credit 'advantage_model'"):
    critic_lib.from_config(loop.with_method(cfg, 'ppo:iid'), init, None, 0, None)
  plain = ppo_config.get_config()
  with pytest.raises(ValueError, match="goes with credit 'advantage_model'"):
    critic_lib.from_config(loop.with_method(plain, 'advantage_model:iid'), init, None, 0, None)


@pytest.mark.parametrize('method,variant', [
    pytest.param('advantage_model', 'advantage', marks=pytest.mark.slow),  # ~30 s each
    pytest.param('pum', 'pum', marks=pytest.mark.slow)])  # (the rank loss: a quick unit test)
def test_quick_learned_model_runs_train_their_model(tmp_path, method, variant):
  from configs import ppo
  from experiments.training import loop
  from tests.test_loop import init_params, quick_cfg
  cfg = quick_cfg(default_task=method == 'pum')  # pum reads scratch_add's step ends
  init = init_params(cfg)
  if method == 'pum':  # a start that solves some (tree values that differ: pairs to rank)
    cfg.task.kwargs, cfg.sft.steps = {'num_digits': 1}, 300
    init, _ = loop.sft(cfg, str(tmp_path / 'sft'))
  with cfg.unlocked():
    cfg.critic = ppo.get_config(variant).critic
    cfg.critic.lr = 1e-2
  cfg.rl.steps, cfg.rl.ckpt_every = 3, 3
  loop.train(cfg, str(tmp_path), init, method=f'{method}:iid', progress=False)
  rows = [r for r in loop.read_metrics(str(tmp_path / 'metrics.jsonl')) if 'reward' in r]
  assert len(rows) == 3 and all(np.isfinite(r['critic/vf_loss']) for r in rows)
  assert rows[-1]['critic/vf_loss'] != rows[0]['critic/vf_loss']


def test_rank_loss_matches_a_loop_and_is_fit_by_the_critic_step(policy):
  rng = np.random.default_rng(4)
  v = rng.normal(size=(3, 5)).astype(np.float32)
  ret = rng.integers(0, 3, (3, 5)).astype(np.float32) / 2
  mask = np.arange(5) < np.array([[5], [3], [0]])
  total, count = 0.0, 0
  for i in range(3):
    for t in range(5):
      for u in range(t + 1, 5):
        if mask[i, t] and mask[i, u] and ret[i, t] != ret[i, u]:
          y = np.sign(ret[i, t] - ret[i, u])
          total += np.log1p(np.exp(-y * (v[i, t] - v[i, u])))
          count += 1
  got = float(critic_lib.rank_loss(jnp.asarray(v), jnp.asarray(ret), jnp.asarray(mask)))
  assert got == pytest.approx(total / count, rel=1e-5)
  # The critic step with loss 'rank' descends that loss, whole or in micro-batches.
  batch = _batch(np.random.default_rng(2))
  batch = batch.replace(returns=jnp.where(batch.mask, jnp.asarray(  # varying along each row
      np.random.default_rng(3).integers(0, 4, batch.mask.shape) / 3, jnp.float32), 0.0))
  tx = ts.make_optimizer(3e-3)
  one = critic_lib.CriticConfig(cliprange_value=0.0, loss='rank')
  two = critic_lib.CriticConfig(cliprange_value=0.0, loss='rank', num_microbatches=2)
  # Jitted, as the loop runs it; the whole batch's program also takes the 40 steps below.
  step = jax.jit(lambda s: critic_lib.critic_step(s, batch, cfg=CFG, ccfg=one))
  s1, m1 = step(critic_lib.init_state(policy, CFG, tx))
  _, m2 = jax.jit(lambda s: critic_lib.critic_step(s, batch, cfg=CFG, ccfg=two))(
      critic_lib.init_state(policy, CFG, tx))
  assert float(m1['vf_loss']) == pytest.approx(float(m2['vf_loss']), rel=1e-5)
  v0 = value_forward(critic_lib.init_state(policy, CFG, tx).params, prompts=batch.prompts,
                     responses=batch.tokens, prompt_len=batch.prompt_len)
  first = float(critic_lib.rank_loss(v0, batch.returns, batch.mask))
  assert float(m1['vf_loss']) == pytest.approx(first, rel=1e-5)
  state = s1  # step 1 of 40
  for _ in range(39):
    state, m = step(state)
  assert float(m['vf_loss']) < 0.7 * first
  with pytest.raises(ValueError, match='critic loss'):
    critic_lib.CriticConfig(loss='huber')


def ref_pum(rewards, mask, ends, values, coef):
  a = grpo_ref(rewards)
  out = np.where(mask, a[..., None], 0.0)
  steps = {}
  for b, g in np.ndindex(rewards.shape):
    n, start = int(mask[b, g].sum()), 0
    for t in range(n - 1):  # a step end on the last token closes the answer
      if ends[b, g, t]:
        steps[(b, g, start, t + 1)] = values[b, g, t + 1] - values[b, g, start]
        start = t + 1
  for b in range(rewards.shape[0]):
    keys = [k for k in steps if k[0] == b]
    x = np.array([steps[k] for k in keys])
    if len(x) < 2 or x.max() <= x.min():
      continue
    z = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
    for (bb, g, s, e), zz in zip(keys, z):
      out[bb, g, s:e] += coef * zz
  return out


# Jitted (coef traced; one program each, the shapes are fixed): op by op every example
# dispatches their primitives one at a time.
_ESTIMATORS = {name: jax.jit(credit.get(name)) for name in ('pum', 'prorag', 'grpo')}


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_pum_and_prorag_match_reference(seed):
  rng = np.random.default_rng(seed)
  mask = np.arange(7) < rng.integers(0, 8, (2, 3))[..., None]
  ends = (rng.random((2, 3, 7)) < 0.35) & mask
  rewards = rng.integers(0, 2, (2, 3)).astype(np.float32)
  values = rng.normal(size=(2, 3, 7)).astype(np.float32)
  r = credit.Rollouts(tokens=jnp.zeros((2, 3, 7), jnp.int32), mask=jnp.asarray(mask),
                      rewards=jnp.asarray(rewards), values=jnp.asarray(values),
                      step_ends=jnp.asarray(ends))
  for name in ('pum', 'prorag'):  # one formula, two models (ranked / regressed)
    np.testing.assert_allclose(_ESTIMATORS[name](r, coef=0.5),
                               ref_pum(rewards, mask, ends, values, 0.5), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(_ESTIMATORS[name](r, coef=0.0), _ESTIMATORS['grpo'](r), atol=1e-6)


def test_critic_warmup_steps_leave_the_policy_alone(tmp_path):
  from configs import ppo
  from experiments.training import loop
  from tests.test_loop import init_params, quick_cfg
  cfg = quick_cfg()
  with cfg.unlocked():
    cfg.critic = ppo.get_config().critic
    cfg.critic.critic_warmup = 2
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 3, 3, 1
  loop.train(cfg, str(tmp_path), init_params(cfg), method='ppo:iid', progress=False)
  rows = loop.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r.get('critic_warmup') for r in rows[1:]] == [1.0, 1.0, None]
  assert 'loss' not in rows[1] and 'loss' not in rows[2] and np.isfinite(rows[3]['loss'])
  assert all(np.isfinite(r['critic/vf_loss']) for r in rows[1:])
  assert rows[1]['greedy_acc'] == rows[2]['greedy_acc'] == rows[0]['greedy_acc']
  with pytest.raises(ValueError, match='critic_warmup'):
    critic_lib.CriticConfig(critic_warmup=-1)
