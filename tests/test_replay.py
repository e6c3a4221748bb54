"""The prompt pool, R3's replay store and off-policy GRPO's lagged sampler
(experiments/training/replay.py, issue 23): inject/update against a plain-Python reference,
the loop's use of them, exact resume with the store and the lagged params checkpointed, and
lag 1 = on-policy GRPO; AVATAR's Temporal Advantage Shaping against a plain-Python reading."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
from credit import replay as replay_credit
from experiments.rollouts.sampling import Samples
from experiments.training import loop, replay, samplers
from groups import outcome_rollouts
from tests.test_loop import quick_cfg, strip

B, G, L, N = 4, 3, 5, 6


def random_batch(seed):
  rng = np.random.default_rng(seed)
  mask = np.arange(L) < rng.integers(1, L + 1, (B, G, 1))
  samples = Samples(tokens=rng.integers(0, 9, (B, G, L)).astype(np.int32),
                    logprobs=-rng.random((B, G, L)).astype(np.float32),
                    entropy=rng.random((B, G, L)).astype(np.float32), mask=mask,
                    parent=np.full((B, G), -1, np.int32), fork=np.zeros((B, G), np.int32))
  rewards = (rng.random((B, G)) < rng.choice([0.1, 0.5, 0.9])).astype(np.float32)
  rewards[0] = 0.0  # one all-fail and one all-success group in every draw
  rewards[1] = 1.0
  store = replay.init_store(N, L, 14)
  store = store.replace(tokens=jnp.asarray(rng.integers(0, 9, (N, 2, L)), jnp.int32),
                        mask=jnp.asarray(np.arange(L) < rng.integers(1, L + 1, (N, 2, 1))),
                        logprobs=jnp.asarray(-rng.random((N, 2, L)), jnp.float32),
                        entropy=jnp.asarray(rng.random((N, 2, L)), jnp.float32),
                        reward=jnp.asarray(np.tile([1.0, 0.0], (N, 1)), jnp.float32),
                        has=jnp.asarray(rng.random((N, 2)) < 0.6))
  ids = rng.permutation(N)[:B].astype(np.int32)
  return samples, rewards, store, ids


@pytest.mark.parametrize('two_sided', [False, True])
@pytest.mark.parametrize('seed', range(4))
def test_inject_and_update_match_reference(seed, two_sided):
  samples, rewards, store, ids = random_batch(seed)
  got, got_r, replayed = replay.inject(store, ids, samples, rewards, 1.0, two_sided)
  st = jax.tree.map(np.asarray, store)
  for b in range(B):
    slot = 0 if rewards[b].max() < 1.0 else 1
    lacks = rewards[b].max() < 1.0 or (two_sided and rewards[b].min() >= 1.0)
    use = lacks and st.has[ids[b], slot]
    for g in range(G):
      mine = use and g == G - 1
      src = ((st.tokens[ids[b], slot], st.mask[ids[b], slot], st.logprobs[ids[b], slot],
              st.entropy[ids[b], slot]) if mine else
             (samples.tokens[b, g], samples.mask[b, g], samples.logprobs[b, g],
              samples.entropy[b, g]))
      for x, want in zip((got.tokens, got.mask, got.logprobs, got.entropy), src):
        np.testing.assert_array_equal(np.asarray(x)[b, g], want)
      assert bool(replayed[b, g]) == mine
      assert float(got_r[b, g]) == (st.reward[ids[b], slot] if mine else rewards[b, g])
  new = jax.tree.map(np.asarray, replay.update(store, ids, got, got_r, replayed, 1.0, 7,
                                               two_sided))
  for p in range(N):
    for slot in (0, 1):
      if p not in ids or (slot == 1 and not two_sided):
        for name in ('tokens', 'mask', 'has', 'step'):
          np.testing.assert_array_equal(getattr(new, name)[p, slot], getattr(st, name)[p, slot])
        continue
      b = int(np.flatnonzero(ids == p)[0])
      fresh = [g for g in range(G) if (got_r[b, g] >= 1.0) == (slot == 0) and not replayed[b, g]]
      if fresh:  # the group's first fresh success (failure) is stored, at step 7
        np.testing.assert_array_equal(new.tokens[p, slot], np.asarray(got.tokens)[b, fresh[0]])
        np.testing.assert_array_equal(new.logprobs[p, slot],
                                      np.asarray(got.logprobs)[b, fresh[0]])
        assert new.has[p, slot] and new.step[p, slot] == 7
        assert new.reward[p, slot] == got_r[b, fresh[0]]
      else:
        np.testing.assert_array_equal(new.tokens[p, slot], st.tokens[p, slot])
        assert new.has[p, slot] == st.has[p, slot] and new.step[p, slot] == st.step[p, slot]


def test_pool_draws_distinct_prompts_of_the_pool():
  cfg = quick_cfg()
  problem = loop.JaxProblem(cfg)
  problem.set_pool(16, 3)
  d = problem.draw(jax.random.key(1), 5, 8)
  ids = np.asarray(d.prompt_ids)
  assert len(set(ids.tolist())) == 8 and ids.max() < 16
  np.testing.assert_array_equal(np.asarray(d.prompts), np.asarray(problem.pool[0])[ids])
  with pytest.raises(ValueError, match='prompt_pool'):
    problem.draw(jax.random.key(1), 5, 17)


@pytest.fixture(scope='module')
def warm(tmp_path_factory):
  """One-digit scratch_add after a short SFT: about half the responses are right, so some
  groups all fail and some prompt of the pool has a stored success to replay."""
  cfg = quick_cfg(default_task=True)
  cfg.task.kwargs = {'num_digits': 1}
  cfg.sft.steps = 300
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 4, 2, 2
  cfg.rl.prompt_pool = 8  # = prompts_per_step: every prompt comes back every step
  params, info = loop.sft(cfg, str(tmp_path_factory.mktemp('sft')))
  assert 0.05 < info['greedy_acc'] < 0.95, info
  # Packed trees of one length, the largest (P + G * L): every run of these groups compiles
  # the update once, where the automatic buckets grow (and recompile) as the trees do.
  cfg.train.pack_len = full_pack_len(cfg, cfg.sampler.group_size)
  return cfg, params


def full_pack_len(cfg, group_size: int) -> int:
  task = loop.build_task(cfg)
  return task.prompt_len + group_size * task.response_len


def _run_rows(cfg, path, params, method):
  run(cfg, path, params, method)
  return path / 'metrics.jsonl'


def run(cfg, path, params, method, steps=None):
  c = cfg.copy_and_resolve_references()
  if steps is not None:
    c.rl.steps = steps
  return loop.train(c, str(path), params, method=method)


# avatar's two-sided store: the inject/update reference above and the family's quick run.
# grpo:knapsack: its path exactly in test_golden's grpo_knapsack (every pass's loop state
# resumes through one path: test_extension).
@pytest.mark.parametrize('method', ['r3:iid', pytest.param('avatar:iid', marks=pytest.mark.slow),
                                    'grpo:lagged',
                                    pytest.param('grpo:knapsack', marks=pytest.mark.slow)])
def test_resume_restores_the_replay_store_and_the_lagged_policy(warm, tmp_path, method):
  cfg, p0 = warm
  cfg = cfg.copy_and_resolve_references()
  cfg.sampler.lag = 3  # resumed at step 2: the behaviour policy is step 0's, from the checkpoint
  if method == 'grpo:knapsack':
    cfg.train.pack_len = full_pack_len(cfg, cfg.sampler.max_group)  # groups padded to it
  straight = run(cfg, tmp_path / 'a', p0, method)
  run(cfg, tmp_path / 'b', p0, method, steps=2)
  resumed = run(cfg, tmp_path / 'b', p0, method)
  for x, y in zip(jax.tree.leaves(straight['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows = loop.read_metrics(tmp_path / 'a' / 'metrics.jsonl')
  assert strip(rows) == strip(loop.read_metrics(tmp_path / 'b' / 'metrics.jsonl'))
  if method == 'grpo:knapsack':  # pass rates (loop state) made the groups' sizes differ
    train = [r for r in rows if 'reward' in r]
    assert train[0]['group_size_min'] == train[0]['group_size_max'] == 4  # none seen yet
    assert any(r['group_size_min'] < r['group_size_max'] for r in train[1:])
    return
  if method != 'grpo:lagged':  # the store was used, and replayed responses are not "generated"
    train = [r for r in rows if 'reward' in r]
    assert sum(r['replayed_groups'] for r in train) > 0
    assert all(r['generated_tokens'] < r['response_len'] * 8 * 4 for r in train
               if r['replayed_groups'] > 0)


def test_lag_one_is_on_policy_grpo_and_a_longer_lag_samples_the_old_policy(warm, tmp_path,
                                                                          monkeypatch):
  cfg, p0 = warm
  cfg = cfg.copy_and_resolve_references()
  iid = strip(loop.read_metrics(_run_rows(cfg, tmp_path / 'iid', p0, 'grpo:iid')))
  cfg.sampler.lag = 1
  lag1 = strip(loop.read_metrics(_run_rows(cfg, tmp_path / 'lag1', p0, 'grpo:lagged')))
  same = lambda rows: [{k: v for k, v in r.items() if k != 'method'} for r in rows]
  assert same(lag1) == same(iid)
  # Knapsack RL's first step: no prompt seen yet, G each, i.i.d. groups row for row (the
  # run stops there: its later steps are not compared).
  ks_cfg = cfg.copy_and_resolve_references()
  ks_cfg.train.pack_len = full_pack_len(cfg, cfg.sampler.max_group)  # groups padded to it
  run(ks_cfg, tmp_path / 'ks', p0, 'grpo:knapsack', steps=1)
  ks = strip(loop.read_metrics(tmp_path / 'ks' / 'metrics.jsonl'))
  for key in ('reward', 'generated_tokens', 'frac_groups_with_signal', 'response_len'):
    assert ks[1][key] == iid[1][key], key
  assert ks[1]['loss'] == pytest.approx(iid[1]['loss'], rel=1e-4, abs=1e-6)
  # lag 3: steps 0-2 sample with the initial policy, step 3 with the policy after 3 updates.
  seen, real = [], loop.sample
  monkeypatch.setattr(samplers, 'sample', lambda params, *a, **k: (
      seen.append(jax.tree.map(np.asarray, params)), real(params, *a, **k))[1])
  cfg.sampler.lag = 3
  out = run(cfg, tmp_path / 'lag3', p0, 'grpo:lagged')
  assert len(seen) == 4
  equal = lambda x, y: all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(x),
                                                                 jax.tree.leaves(y)))
  assert all(equal(seen[i], p0) for i in range(3))
  assert not equal(seen[3], p0) and not equal(out['params'], p0)


def test_replay_and_lag_refuse_what_they_cannot_do(warm, tmp_path):
  cfg, p0 = warm
  no_pool = cfg.copy_and_resolve_references()
  no_pool.rl.prompt_pool = 0
  with pytest.raises(ValueError, match='rl.prompt_pool'):
    run(no_pool, tmp_path / 'x', p0, 'r3:iid')
  with pytest.raises(ValueError, match="i.i.d. groups"):
    run(cfg, tmp_path / 'y', p0, 'r3:tree_entropy')
  with pytest.raises(ValueError, match="sampler 'knapsack'.*rl.prompt_pool"):
    run(no_pool, tmp_path / 'k', p0, 'grpo:knapsack')
  with pytest.raises(ValueError, match="'tempo' does not support groups of varying size"):
    run(cfg, tmp_path / 'k2', p0, 'tempo:knapsack')
  with pytest.raises(ValueError, match="replay_logprobs"):
    bad = cfg.copy_and_resolve_references()
    bad.credit.hparams = {'replay_logprobs': 'stale'}
    run(bad, tmp_path / 'z', p0, 'r3:iid')


@pytest.mark.slow  # ~16 s; the replay path exactly: test_golden's r3_pool
def test_replay_family_script_runs_quick(tmp_path):
  from configs import replay as replay_config
  from configs import tempo as tempo_config
  from experiments.training import compare
  cfg = tempo_config.shrink(replay_config.get_config(), defaults=replay_config.get_config())
  cfg.quick, cfg.progress = False, False
  cfg.rl.steps, cfg.eval.every = 2, 2
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['avatar:iid', 'grpo:iid', 'grpo:lagged', 'r3:iid']
  for m in summary['methods']:
    rows = loop.read_metrics(tmp_path / m.replace(':', '_') / 'seed0' / 'metrics.jsonl')
    assert [r['step'] for r in rows] == [0, 1, 2] and all(np.isfinite(r['loss']) for r in rows[1:])


def test_rwft_weights_every_token_by_its_reward():
  mask, rewards, r = outcome_rollouts(2, length=5)
  for b in (0.0, 0.25):
    want = np.where(mask, (rewards - b)[..., None], 0.0)
    np.testing.assert_allclose(credit.get('rwft')(r, baseline=b), want, atol=1e-7)


def tas_reference(mask_row, tas):
  """AVATAR's TAS weights for one response, in plain Python: the k-th of its n tokens on
  the mask gets 1 + tas (2k/(n-1) - 1)^2 (k/(n-1) read as 0 when n = 1), rescaled to mean 1."""
  on = [t for t, m in enumerate(mask_row) if m]
  n = len(on)
  raw = {t: 1 + tas * (2 * (k / (n - 1) if n > 1 else 0.0) - 1) ** 2 for k, t in enumerate(on)}
  total = sum(raw.values())
  return [raw[t] * n / total if t in raw else 0.0 for t in range(len(mask_row))]


# One compiled shape [2, 3, 7] for every example; masks with holes (agent turns) included.
@settings(deadline=None, max_examples=25)
@given(bits=st.lists(st.booleans(), min_size=42, max_size=42),
       rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=6, max_size=6),
       tas=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_tas_matches_reference_and_keeps_each_responses_summed_advantage(bits, rewards, tas):
  mask = np.array(bits).reshape(2, 3, 7)
  r = credit.Rollouts(tokens=jnp.zeros(mask.shape, jnp.int32), mask=jnp.asarray(mask),
                      rewards=jnp.asarray(np.array(rewards, np.float32).reshape(2, 3)))
  w = np.asarray(replay_credit.tas_weights(mask, tas))
  want = [[tas_reference(mask[b, g], tas) for g in range(3)] for b in range(2)]
  np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6)
  base = np.asarray(credit.get('grpo')(r))
  got = np.asarray(credit.get('tas')(r, tas=tas))
  np.testing.assert_allclose(got, base * w, rtol=1e-5, atol=1e-6)
  # TAS moves credit within a response: its sum over the response is GRPO's.
  np.testing.assert_allclose(got.sum(-1), base.sum(-1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(credit.get('avatar')(r, tas=tas)), got, atol=1e-7)
  if tas == 0.0:  # no shaping: GRPO exactly, and AVATAR is R³'s estimator
    np.testing.assert_array_equal(got, base)
    np.testing.assert_array_equal(np.asarray(credit.get('avatar')(r, tas=0.0)),
                                  np.asarray(credit.get('r3')(r)))


def test_tas_upweights_the_first_and_last_tokens_and_refuses_bad_strengths():
  w = np.asarray(replay_credit.tas_weights(np.arange(9) < 5, 1.0))
  # n = 5: raw 2, 1.25, 1, 1.25, 2 (mean 1.5); ends 2x the middle token
  np.testing.assert_allclose(w, [4 / 3, 5 / 6, 2 / 3, 5 / 6, 4 / 3, 0, 0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(replay_credit.tas_weights(np.zeros(4, bool), 1.0), 0.0)
  np.testing.assert_allclose(replay_credit.tas_weights(np.arange(4) < 1, 2.0), [1, 0, 0, 0])
  for bad in (-0.5, float('nan'), float('inf')):
    with pytest.raises(ValueError, match='tas'):
      replay_credit.tas_weights(np.ones(3, bool), bad)


def test_a_hyperparameter_one_method_lacks_is_refused_before_any_work(tmp_path):
  from configs import replay as replay_config
  from experiments.training import compare
  cfg = replay_config.get_config('tas')
  cfg.credit.hparams = {'tas': 0.0}
  with pytest.raises(ValueError, match="'grpo' takes no hyperparameter tas"):
    compare.check_comparison(cfg)  # credit.hparams goes to every method, GRPO included
  with pytest.raises(ValueError, match="'grpo' takes no hyperparameter tas"):
    loop.train(cfg, str(tmp_path), None, method='grpo:iid')
  cfg.methods = 'tas:iid,avatar:iid'
  compare.check_comparison(cfg)  # both take it
  assert not (tmp_path / 'checkpoints').exists()
  # Per-method hyperparameters: GRPO beside two strengths of the same estimator.
  cfg.credit.hparams = {}
  cfg.methods = 'grpo:iid,avatar[tas=0]:iid,avatar[tas=0.5]:iid'
  compare.check_comparison(cfg)
  runs = [loop.with_method(cfg, m) for m in ('grpo:iid', 'avatar[tas=0.5]:iid')]
  assert [dict(r.credit.hparams) for r in runs] == [{}, {'tas': 0.5}]
  cfg.methods = 'grpo[tas=1]:iid,avatar:iid'
  with pytest.raises(ValueError, match="'grpo' takes no hyperparameter tas"):
    compare.check_comparison(cfg)
  cfg.methods, cfg.credit.hparams = 'tas[tas=0]:iid,tas:iid', {'tas': 2.0}
  compare.check_comparison(cfg)  # the method's own value over the shared one
  assert loop.with_method(cfg, 'tas[tas=0]:iid').credit.hparams['tas'] == 0
  cfg.methods = 'tas[tas=0]:iid,tas[tas=0]:iid'
  with pytest.raises(ValueError, match=r'repeats tas\[tas=0\]:iid'):
    compare.check_comparison(cfg)
  # The turn estimators' registered adapters expose their turn functions' hyperparameters.
  credit.check_hparams('gigpo', {'gamma': 0.9, 'omega': 0.5})
  with pytest.raises(ValueError, match="'gigpo' takes no hyperparameter tas"):
    credit.check_hparams('gigpo', {'gamma': 0.9, 'tas': 1.0})
