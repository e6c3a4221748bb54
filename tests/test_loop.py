"""Tests for the RL loop, checkpoints/resume, config errors and the tempo script (quick config)."""

import glob
import json
import os

import jax
import numpy as np
import pytest

from configs import tempo as tempo_config
from experiments.training import loop, samplers
from experiments.models import decoder
from experiments import tempo as tempo_script
import test_tracking
from test_tracking import offline_wandb  # noqa: F401  (a fixture)

TIMING = ('wall_s', 'sample_s', 'logprob_s', 'credit_s', 'update_s', 'step_s',
          'sampled_tokens_per_s', 'train_tokens_per_s', 'credit_frac')


def quick_cfg(default_task: bool = False):
  """The quick config; on 3-digit addition (5-token answers: cheap compiles and steps)
  unless `default_task` (the main job's scratch_add)."""
  cfg = tempo_config.shrink(tempo_config.get_config())
  cfg.quick = False  # already shrunk
  cfg.progress = False
  cfg.sft.steps = 10
  if not default_task:
    cfg.task.name, cfg.task.kwargs = 'addition', {'num_digits': 3}
  return cfg


_INIT = {}


def init_params(cfg):
  task = loop.build_task(cfg)
  pcfg = loop.policy_config(cfg, task)
  if pcfg not in _INIT:
    _INIT[pcfg] = decoder.init_params(jax.random.PRNGKey(0), pcfg)
  return _INIT[pcfg]


def strip(rows):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


# Seeds 0 and 3: on this config their runs' packed trees fit the same pack-length buckets
# (seed 1's first step needs a shorter one), so seed 3's runs compile no update of their
# own (each bucket is a train-step program); any two seeds make the same checks.
SEEDS = (0, 3)


def test_quick_comparison_writes_metrics_plots_checkpoints_and_paired_intervals(
    tmp_path, offline_wandb, final_plots_only):
  """The main job's script on 3 methods x 2 seeds (one SFT start, programs shared across the
  runs): every sink, checkpoint and plot; generated tokens in the rows (forks' copied
  prefixes excluded), accuracy at matched generated tokens, paired intervals vs GRPO on the
  method's own sampler."""
  cfg = quick_cfg(default_task=True)
  cfg.log.sinks = 'jsonl,tensorboard,wandb'  # not fingerprinted: the same runs as without
  cfg.seeds, cfg.methods = SEEDS, 'grpo:iid,grpo:tree_entropy,tempo:tree_entropy'
  cfg.rl.steps, cfg.eval.num_prompts = 2, 16
  summary = tempo_script.run_experiment(cfg, str(tmp_path))
  methods = ('grpo:iid', 'grpo:tree_entropy', 'tempo:tree_entropy')
  assert tuple(summary['methods']) == methods
  ends = {}
  for m in methods:
    for seed in SEEDS:
      d = tmp_path / m.replace(':', '_') / f'seed{seed}'
      rows = loop.read_metrics(d / 'metrics.jsonl')
      assert [r['step'] for r in rows] == list(range(cfg.rl.steps + 1))
      for k in ('wall_s', 'method', 'reward', 'loss', 'clip_frac', 'approx_kl', 'entropy',
                'grad_norm', 'greedy_acc', f'pass@{cfg.eval.pass_k}', 'sample_s', 'credit_s',
                'update_s', 'sampled_tokens_per_s', 'train_tokens_per_s'):
        assert k in rows[-1], k
      assert os.listdir(d / 'checkpoints')
      scalars = test_tracking.tensorboard_scalars(d / 'tensorboard')
      assert sorted(scalars) == [r['step'] for r in rows]
      assert scalars[rows[-1]['step']]['reward'] == pytest.approx(rows[-1]['reward'], rel=1e-7)
      assert glob.glob(str(d / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
      gen = [r['generated_tokens'] for r in rows[1:]]
      rows_per_step = cfg.rl.prompts_per_step * cfg.sampler.group_size
      sampled = [r['response_len'] * rows_per_step for r in rows[1:]]  # mean length x rows
      if m.endswith('tree_entropy'):  # forks' copied prefixes excluded
        assert all(0 < g < s for g, s in zip(gen, sampled)), m
      else:
        assert gen == pytest.approx(sampled), m
      assert [r['generated_tokens_total'] for r in rows[1:]] == pytest.approx(np.cumsum(gen))
      ends[m, seed] = rows[-1]['generated_tokens_total']
  assert os.listdir(tmp_path / 'sft' / 'checkpoints')
  saved = json.load(open(tmp_path / 'summary.json'))
  matched = saved['matched_tokens']
  assert matched['budget_generated_tokens'] == min(ends.values())
  for m in methods:
    assert len(matched['acc'][m]['per_seed']) == 2
    assert all(0 <= r['acc_at_budget'] <= 1 for r in saved['methods'][m])
  paired = saved['paired']['by_method']
  assert {m: e['baseline'] for m, e in paired.items()} == {
      'grpo:tree_entropy': 'grpo:iid', 'tempo:tree_entropy': 'grpo:tree_entropy'}
  e = paired['tempo:tree_entropy']
  assert e['seeds'] == list(SEEDS) and e['budget_generated_tokens'] == min(
      ends[m, s] for m in ('grpo:tree_entropy', 'tempo:tree_entropy') for s in SEEDS)
  for key in ('final_acc', 'acc_at_budget'):
    for how in ('t', 'bootstrap'):
      st = e[key][how]
      assert st['n'] == 2 and st['method'] == how and st['lo'] <= st['mean'] <= st['hi']
  assert len(saved['plots']) == 3  # the final report's (the partial ones drew none here)
  for f in ('curves_vs_step.png', 'curves_vs_wall.png', 'curves_vs_generated_tokens.png'):
    assert (tmp_path / f).stat().st_size > 0
  table = tempo_script.format_table(saved, cfg.eval.pass_k)
  assert 'acc@' in table and 'paired-t' in table and 'tempo:tree_entropy' in table


@pytest.mark.slow  # ~28 s; resume and interrupts: test_resume, test_golden's resume_grpo_iid
def test_resume_equals_uninterrupted_and_interrupt_saves(tmp_path, monkeypatch):
  cfg = quick_cfg()
  cfg.methods = 'tempo:tree_entropy'
  p0 = init_params(cfg)
  straight = loop.train(cfg, str(tmp_path / 'a'), p0, method='tempo:tree_entropy')

  half = cfg.copy_and_resolve_references()
  half.rl.steps = 2
  loop.train(half, str(tmp_path / 'b'), p0, method='tempo:tree_entropy')
  resumed = loop.train(cfg, str(tmp_path / 'b'), p0, method='tempo:tree_entropy')
  for x, y in zip(jax.tree.leaves(straight['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows_a = loop.read_metrics(tmp_path / 'a' / 'metrics.jsonl')
  rows_b = loop.read_metrics(tmp_path / 'b' / 'metrics.jsonl')
  assert strip(rows_a) == strip(rows_b)

  # Ctrl-C while sampling step 3 saves step 2; rerunning finishes like run 'a'.
  calls = {'n': 0}
  real_sample = loop.sample

  def flaky_sample(*a, **k):
    calls['n'] += 1
    if calls['n'] == 3:
      raise KeyboardInterrupt
    return real_sample(*a, **k)

  c = cfg.copy_and_resolve_references()
  c.rl.ckpt_every = 100
  monkeypatch.setattr(samplers, 'sample', flaky_sample)
  with pytest.raises(KeyboardInterrupt):
    loop.train(c, str(tmp_path / 'c'), p0, method='tempo:tree_entropy')
  monkeypatch.setattr(samplers, 'sample', real_sample)
  assert os.listdir(tmp_path / 'c' / 'checkpoints') == ['2']
  again = loop.train(c, str(tmp_path / 'c'), p0, method='tempo:tree_entropy')
  for x, y in zip(jax.tree.leaves(straight['params']), jax.tree.leaves(again['params'])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert strip(loop.read_metrics(tmp_path / 'c' / 'metrics.jsonl')) == strip(rows_a)

  # A checkpoint from an incompatible config is refused with a clear message.
  bad = cfg.copy_and_resolve_references()
  bad.loss.eps_high = 0.5
  with pytest.raises(ValueError, match=r'incompatible checkpoint.*loss\.eps_high'):
    loop.train(bad, str(tmp_path / 'b'), p0, method='tempo:tree_entropy')


def test_config_errors_list_valid_choices():
  cfg = quick_cfg()
  bad = cfg.copy_and_resolve_references()
  bad.credit.name = 'nope'
  with pytest.raises(ValueError, match='unknown credit estimator.*grpo.*tempo'):
    loop.check_config(bad)
  with pytest.raises(ValueError, match='valid names'):
    loop.parse_methods('tempo:iid,nope:iid')
  with pytest.raises(ValueError, match='unknown sampler.*tree_entropy'):
    loop.parse_methods('tempo:beam')
  # 'credit:sampler[:policy loss]': the loss part sets loss.policy_loss for that method only.
  assert loop.parse_methods('grpo,grpo:iid:apa') == [('grpo', 'iid', '', ()),
                                                     ('grpo', 'iid', 'apa', ())]
  assert loop.method_name('grpo', 'iid', 'apa') == 'grpo:iid:apa'
  # 'credit[key=value,...]': the method's own credit.hparams (Python literals, sorted keys).
  parsed = loop.parse_methods('tas[tas=0.5,]:iid:apa,avatar[tas=0, scale_by_std=False]')
  assert parsed == [('tas', 'iid', 'apa', (('tas', 0.5),)),
                    ('avatar', 'iid', '', (('scale_by_std', False), ('tas', 0)))]
  assert [loop.method_name(*m) for m in parsed] == ['tas[tas=0.5]:iid:apa',
                                                    'avatar[scale_by_std=False,tas=0]:iid']
  for bad, why in [('tas[tas=0', 'unbalanced'), ('tas[tas]:iid', 'key=value'),
                   ('tas[tas=0,tas=1]', 'each key once'), ('tas[tas=x]', 'literals'),
                   ('grpo:iid[tas=1]', 'right after the estimator'),
                   ('tas[tas=0]iid', 'right after the estimator')]:
    with pytest.raises(ValueError, match=why):
      loop.parse_methods(bad)
  assert loop.with_method(cfg, 'grpo:iid:apa').loss.policy_loss == 'apa'
  assert loop.with_method(cfg, 'grpo:iid').loss.policy_loss == cfg.loss.policy_loss == 'clip'
  with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*rgra"):
    loop.parse_methods('grpo:iid:ppo2')
  bad = cfg.copy_and_resolve_references()
  bad.task.name = 'chess'
  with pytest.raises(ValueError, match='unknown task.*addition'):
    loop.check_config(bad)
  bad = cfg.copy_and_resolve_references()
  bad.rl.unlock()
  bad.rl.stepz = 3
  with pytest.raises(ValueError, match=r"unknown config field 'rl.stepz'.*prompts_per_step"):
    loop.check_config(bad)
  bad = cfg.copy_and_resolve_references()
  bad.loss.agg = 'mean'
  with pytest.raises(ValueError, match='seq-mean-token-sum-norm'):
    loop.check_config(bad)


def test_unknown_command_line_field_names_the_valid_ones():
  from configs import tempo as tempo_config
  from experiments import tempo as tempo_script
  reference = tempo_config.get_config()
  message = tempo_script.unknown_override(['--config.rl.foo=1'], reference)
  assert message.startswith("unknown config field 'rl.foo'") and 'prompts_per_step' in message
  assert 'sampler' in tempo_script.unknown_override(['--config.bogus=2'], reference)
  assert tempo_script.unknown_override(['--config.rl.steps=3', '--workdir=/x'], reference) is None


PAPERS = {'spo': ('spo_tree', 'spo_chain'), 'treerl': ('treerl',), 'treepo': ('treepo',),
          'tree_grpo': ('tree_grpo',), 'qae': ('qae',), 'ngrpo': ('ngrpo',),
          'passk': ('passk',), 'frpo': ('frpo',), 'ppo': ('ppo', 'tempo'),
          'milestones': ('beacon', 'rebel')}


@pytest.mark.parametrize('paper', sorted(PAPERS))
def test_paper_configs_compare_with_grpo_on_the_same_budget(paper):
  import importlib
  cfg = importlib.import_module(f'configs.{paper}').get_config()
  loop.check_config(cfg)
  methods = loop.parse_methods(cfg.methods)
  assert ('grpo', 'iid', '', ()) in methods
  assert set(PAPERS[paper]) <= {name for name, *_ in methods}
  sizes = {loop.group_size(loop.with_method(cfg, loop.method_name(*m)).sampler) for m in methods}
  assert sizes == {8}
  script = importlib.import_module(f'experiments.{paper}')
  assert 'compare' in script.main.__module__


# Slow: the golden matrix runs these paths (tempo_tree_fixed, spo_chain_tree_cutpoints, and
# progrpo_kl for the reference log-probs, in the default suite's subset).
@pytest.mark.slow
def test_quick_run_of_tree_and_reference_methods(tmp_path):
  """spo_tree / spo_chain (loss masks, cutpoint and fixed trees) and frpo (needs
  reference log-probs with kl_coef = 0) through the shared loop."""
  cfg = quick_cfg()
  cfg.rl.steps = 2
  cfg.methods = 'spo_tree:tree_fixed,spo_chain:tree_cutpoints,frpo:iid'
  cfg.credit.hparams = {}
  summary = tempo_script.run_experiment(cfg, str(tmp_path))
  assert set(summary['methods']) == set(cfg.methods.split(','))
  for m in cfg.methods.split(','):
    rows = loop.read_metrics(tmp_path / m.replace(':', '_') / 'seed0' / 'metrics.jsonl')
    assert [r['step'] for r in rows] == [0, 1, 2]
    assert all(np.isfinite(r['loss']) for r in rows[1:])


def test_fingerprint_ignores_the_sampler_fields_a_run_does_not_read():
  a, b = tempo_config.get_config(), tempo_config.get_config()
  b.sampler.score, b.sampler.branching = 'nll', (4, 2)
  fp = lambda c, name: loop.fingerprint(loop.run_config(loop.with_method(c, name), 0))[0]
  assert fp(a, 'grpo:iid') == fp(b, 'grpo:iid')
  assert fp(a, 'grpo:tree_entropy') != fp(b, 'grpo:tree_entropy')
  assert fp(a, 'grpo:tree_fixed') != fp(b, 'grpo:tree_fixed')
  assert fp(a, 'grpo:iid') != fp(a, 'tempo:iid')
  assert loop.fingerprint(loop.run_config(a, 0))[0] != loop.fingerprint(loop.run_config(a, 1))[0]
  # configs/ppo.py's critic section is part of a PPO run's config only.
  from configs import ppo
  p = ppo.get_config()
  assert fp(p, 'grpo:iid') == fp(a, 'grpo:iid') and fp(p, 'tempo:iid') == fp(a, 'tempo:iid')
  q = ppo.get_config()
  q.critic.lr = 1e-3
  assert fp(p, 'ppo:iid') != fp(q, 'ppo:iid')


def test_paired_matched_tokens_are_read_at_each_pairs_own_budget():
  """A method whose runs generate fewer tokens (a tree sampler) lowers the comparison's
  budget, not another pair's: TEMPO vs GRPO is read where both reached, with or without it."""
  from experiments.training import compare

  def run(seed, end, accs):  # eval rows at 0, end/2, end generated tokens
    rows = [dict(step=i, generated_tokens_total=end * i / 2, greedy_acc=a)
            for i, a in enumerate(accs)]
    return dict(seed=seed, final_acc=accs[-1]), rows

  runs = {'grpo:iid': [run(0, 1000, (0.5, 0.6, 0.7)), run(1, 1100, (0.5, 0.5, 0.8))],
          'tempo:iid': [run(0, 1000, (0.5, 0.7, 0.9)), run(1, 1050, (0.5, 0.6, 0.6))],
          'grpo:tree_entropy': [run(0, 600, (0.5, 0.6, 0.6)), run(1, 640, (0.5, 0.7, 0.7))]}

  def paired(methods):
    results = {m: [r for r, _ in runs[m]] for m in methods}
    rows = {m: [rw for _, rw in runs[m]] for m in methods}
    budget = compare.matched_budget(rows)
    for m in methods:
      for r, rw in zip(results[m], rows[m]):
        r['acc_at_budget'] = compare.acc_at(rw, budget)
    return compare.paired_stats(results, 'grpo:iid', rows=rows), budget

  two, budget2 = paired(['grpo:iid', 'tempo:iid'])
  three, budget3 = paired(['grpo:iid', 'tempo:iid', 'grpo:tree_entropy'])
  assert (budget2, budget3) == (1000, 600)
  assert two['tempo:iid'] == three['tempo:iid']  # the third method moves nothing of the pair
  e = three['tempo:iid']
  assert e['budget_generated_tokens'] == 1000
  # seed 1 at 1000 tokens: GRPO 0.5 + 0.3 * (1000 - 550) / 550, TEMPO 0.6 (flat after 525)
  want = np.mean([0.9 - 0.7, 0.6 - (0.5 + 0.3 * 450 / 550)])
  assert e['acc_at_budget']['t']['mean'] == pytest.approx(want)
  assert three['grpo:tree_entropy']['budget_generated_tokens'] == 600
  assert three['grpo:tree_entropy']['baseline'] == 'grpo:iid'


def test_baseline_is_grpo_on_the_methods_own_sampler():
  from experiments.training import compare
  # Baselines: GRPO on the method's own sampler, else config.baseline, never itself.
  ms = ['grpo:iid', 'tempo:iid', 'grpo:tree_entropy', 'tempo:tree_entropy', 'spo_tree:tree_fixed']
  assert [compare.baseline_for(m, ms, 'grpo:iid') for m in ms] == [
      None, 'grpo:iid', 'grpo:iid', 'grpo:tree_entropy', 'grpo:iid']
  assert compare.baseline_for('tempo:iid', ['tempo:iid'], 'grpo:iid') is None


def test_lr_grid_layout_and_best_of_grid(tmp_path, monkeypatch, final_plots_only):
  """lr sweep bookkeeping with a stand-in for loop.sft / loop.train (no training)."""
  from experiments.training import compare
  cfg = quick_cfg()
  cfg.seeds = (0, 1)
  cfg.methods = 'grpo:iid,tempo:iid'
  cfg.lr_grid = (1e-4, 3e-4)
  acc = {('grpo:iid', 1e-4): 0.2, ('grpo:iid', 3e-4): 0.4, ('tempo:iid', 1e-4): 0.5,
         ('tempo:iid', 3e-4): 0.3}
  seen = []

  def fake_train(c, d, params, method, seed):
    assert 'lr_grid' not in c and 'baseline' not in c  # not part of a run's fingerprint
    seen.append((method, c.optimizer.lr, seed, os.path.relpath(d, tmp_path)))
    a = acc[method, c.optimizer.lr] + 0.01 * seed
    rows = [dict(step=0, wall_s=0.0, greedy_acc=0.0),
            dict(step=2, wall_s=1.0, generated_tokens_total=100.0 * (1 + seed), greedy_acc=a)]
    return test_tracking.fake_run(d, rows, cfg.eval.pass_k)

  monkeypatch.setattr(loop, 'sft', test_tracking.fake_sft(cfg.eval.pass_k))
  monkeypatch.setattr(loop, 'train', fake_train)
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert ('tempo:iid', 3e-4, 1, os.path.join('tempo_iid', 'lr0.0003', 'seed1')) in seen
  assert len(seen) == 8
  grid = summary['lr_grid']
  assert grid['best'] == {'grpo:iid': 3e-4, 'tempo:iid': 1e-4}
  assert grid['runs']['grpo:iid']['0.0001']['final_acc'] == pytest.approx([0.2, 0.21])
  assert [r['final_acc'] for r in summary['methods']['tempo:iid']] == pytest.approx([0.5, 0.51])
  # Budget 100 tokens (seed 0's end): seed 1 is interpolated halfway from step 0.
  assert summary['matched_tokens']['budget_generated_tokens'] == 100.0
  assert [r['acc_at_budget'] for r in summary['methods']['grpo:iid']] == pytest.approx([0.4, 0.205])
  t = summary['paired']['by_method']['tempo:iid']['final_acc']['t']
  assert t['mean'] == pytest.approx(0.1) and t['lo'] == pytest.approx(0.1)  # same diff per seed
  assert 'lr=0.0001' in compare.format_table(summary, cfg.eval.pass_k)


def test_process_rewards_reach_pure_through_the_loop(tmp_path):
  """`pure` needs token_rewards + step_ends: the loop computes them from the task's per-step
  verifier (scratch_add), and refuses a task without one with a clear error (its training
  run: test_pure_trains_through_the_loop, slow)."""
  cfg = quick_cfg()
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 1, 1, 1
  cfg.credit.name = 'pure'
  # Refused while checking the config, before any work: the params' shapes are enough
  # (decoder.init_params's, not computed).
  dummy = jax.numpy.zeros((1, 1), jax.numpy.int32)
  shapes = jax.eval_shape(decoder.model(loop.policy_config(cfg, loop.build_task(cfg))).init,
                          jax.random.PRNGKey(0), dummy, dummy)['params']
  with pytest.raises(ValueError, match='process rewards.*addition'):
    loop.train(cfg, str(tmp_path / 'bad'), shapes, method='pure:iid')
  cfg.task.name, cfg.task.kwargs = 'scratch_add', {'num_digits': 2}
  task = loop.build_task(cfg)

  @jax.jit  # one program (op by op, the demonstrations compile ~100 small ones)
  def demos(key):
    prompts, info = task.sample(key, 2)
    return (prompts, info, *task.demonstrations(prompts, info))

  prompts, info, demo, mask = demos(jax.random.PRNGKey(0))
  tokens = np.stack([demo, demo], 1)  # [2, G=2, R]: row 1 of group 0 gets a wrong first sum
  tokens[0, 1, 2] = (tokens[0, 1, 2] + 1) % 10
  tokens, mask = jax.numpy.asarray(tokens), jax.numpy.stack([mask, mask], 1)
  tr, ends = loop.group_process_rewards(prompts, tokens, mask, info, task=task)
  np.testing.assert_allclose(np.sum(tr, -1), [[1.0, 0.0], [1.0, 1.0]], atol=1e-6)
  assert np.all(np.sum(ends, -1) == task.num_digits + 1)
  rewards = loop.group_rewards(prompts, tokens, mask, info, task=task)
  fn = loop.credit_fn('pure', '{}', False)
  zeros = jax.numpy.zeros(tokens.shape, jax.numpy.float32)
  no_parent = -jax.numpy.ones(tokens.shape[:2], jax.numpy.int32)
  args = (tokens, mask, rewards, no_parent, 0 * no_parent, zeros, None)
  with_steps, _ = fn(*args, tr, ends)
  rloo, _ = fn(*args)  # without process rewards PURE is RLOO
  assert not np.allclose(with_steps[0], rloo[0])
  # identical correct responses: equal credit, 0 at the first token (G_0 = its baseline)
  np.testing.assert_allclose(with_steps[1, 0], with_steps[1, 1])
  np.testing.assert_allclose(with_steps[1, :, 0], 0.0, atol=1e-6)
  # SCRL and blockwise read the same process rewards through the same jitted credit step
  # the loop runs: the wrong first sum costs row 1 of group 0 its first step's credit.
  for name in ('scrl', 'blockwise'):
    adv, _ = loop.credit_fn(name, '{}', False)(*args, tr, ends)
    assert np.all(np.asarray(adv)[0, 1][np.asarray(mask)[0, 1]][:2] < 0), name


# The loop's process-reward path also runs in the fast suite through dvao ('token_rewards', the
# confidence family's quick run) and the step-boundary estimators' family quick runs.
@pytest.mark.slow
def test_pure_trains_through_the_loop(tmp_path):
  cfg = quick_cfg()
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 1, 1, 1
  cfg.credit.name = 'pure'
  cfg.task.name, cfg.task.kwargs = 'scratch_add', {'num_digits': 2}
  loop.train(cfg, str(tmp_path / 'ok'), init_params(cfg), method='pure:iid')
  rows = loop.read_metrics(tmp_path / 'ok' / 'metrics.jsonl')
  assert [r['step'] for r in rows] == [0, 1] and np.isfinite(rows[1]['loss'])
