"""Tests for the RL loop, checkpoints/resume, config errors and the tempo script (quick config)."""

import json
import os

import jax
import numpy as np
import pytest

from configs import tempo as tempo_config
from experiments import loop
from experiments.models import decoder
from experiments import tempo as tempo_script

TIMING = ('wall_s', 'sample_s', 'logprob_s', 'credit_s', 'update_s', 'step_s',
          'sampled_tokens_per_s', 'train_tokens_per_s', 'credit_frac')


def quick_cfg():
  cfg = tempo_config.shrink(tempo_config.get_config())
  cfg.quick = False  # already shrunk
  cfg.progress = False
  cfg.sft.steps = 10
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


def test_quick_experiment_writes_metrics_plots_checkpoints(tmp_path):
  cfg = quick_cfg()
  summary = tempo_script.run_experiment(cfg, str(tmp_path))
  assert set(summary['methods']) == {'grpo:iid', 'tempo:tree_entropy'}
  for d in ('grpo_iid/seed0', 'tempo_tree_entropy/seed0'):
    rows = loop.read_metrics(tmp_path / d / 'metrics.jsonl')
    assert [r['step'] for r in rows] == list(range(cfg.rl.steps + 1))
    last = rows[-1]
    for k in ('wall_s', 'method', 'reward', 'loss', 'clip_frac', 'approx_kl', 'entropy',
              'grad_norm', 'greedy_acc', f'pass@{cfg.eval.pass_k}', 'sample_s', 'credit_s',
              'update_s', 'sampled_tokens_per_s', 'train_tokens_per_s'):
      assert k in last, k
    assert os.listdir(tmp_path / d / 'checkpoints')
  for f in ('curves_vs_step.png', 'curves_vs_wall.png', 'summary.json'):
    assert (tmp_path / f).stat().st_size > 0
  assert os.listdir(tmp_path / 'sft' / 'checkpoints')
  table = tempo_script.format_table(json.load(open(tmp_path / 'summary.json')), cfg.eval.pass_k)
  assert 'tempo:tree_entropy' in table


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
  monkeypatch.setattr(loop, 'sample', flaky_sample)
  with pytest.raises(KeyboardInterrupt):
    loop.train(c, str(tmp_path / 'c'), p0, method='tempo:tree_entropy')
  monkeypatch.setattr(loop, 'sample', real_sample)
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
    loop.parse_methods('tempo:iid,ppo:iid')
  with pytest.raises(ValueError, match='unknown sampler.*tree_entropy'):
    loop.parse_methods('tempo:beam')
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
          'passk': ('passk',), 'frpo': ('frpo',)}


@pytest.mark.parametrize('paper', sorted(PAPERS))
def test_paper_configs_compare_with_grpo_on_the_same_budget(paper):
  import importlib
  cfg = importlib.import_module(f'configs.{paper}').get_config()
  loop.check_config(cfg)
  methods = loop.parse_methods(cfg.methods)
  assert ('grpo', 'iid') in methods
  assert set(PAPERS[paper]) <= {name for name, _ in methods}
  sizes = {loop.group_size(loop.with_method(cfg, f'{c}:{s}').sampler) for c, s in methods}
  assert sizes == {8}
  script = importlib.import_module(f'experiments.{paper}')
  assert 'compare' in script.main.__module__


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
