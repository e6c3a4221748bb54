"""The credit-sensitivity study (issue 42): power and rank statistics against scipy, the
report recomputed from synthetic summary.json files, the grid's validation, and the run
plumbing (shared SFT link, per-run timing and compile counts) with stand-ins for training."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from configs import sensitivity as sens
from experiments import sensitivity
from experiments.training import compare, loop, stats

# ----------------------------------------------------------------------------- statistics


def exact_power(effect, sd, n, alpha=0.05):
  """Power of the two-sided paired t test at a true mean difference `effect` (noncentral t)."""
  df, lam = n - 1, effect * math.sqrt(n) / sd
  crit = scipy.stats.t.ppf(1 - alpha / 2, df)
  return scipy.stats.nct.sf(crit, df, lam) + scipy.stats.nct.cdf(-crit, df, lam)


@pytest.mark.parametrize('n', [5, 10, 20, 40])
def test_power_at_the_mde_is_the_target(n):
  sd = 0.03
  mde = stats.min_detectable_effect(sd, n)
  assert exact_power(mde, sd, n) == pytest.approx(0.8, abs=0.012)
  assert exact_power(stats.min_detectable_effect(sd, n, power=0.9), sd, n) == pytest.approx(
      0.9, abs=0.012)
  if n >= 10:  # at alpha 0.01 the shifted central t needs more degrees of freedom
    assert exact_power(stats.min_detectable_effect(sd, n, alpha=0.01), sd, n, alpha=0.01) == \
        pytest.approx(0.8, abs=0.02)


def test_mde_normal_limit_scaling_and_errors():
  n, sd = 20000, 0.05  # large n: the z-test formula
  z = scipy.stats.norm.ppf(0.975) + scipy.stats.norm.ppf(0.8)
  assert stats.min_detectable_effect(sd, n) == pytest.approx(z * sd / math.sqrt(n), rel=1e-3)
  assert stats.min_detectable_effect(2 * sd, 10) == pytest.approx(
      2 * stats.min_detectable_effect(sd, 10))
  assert stats.min_detectable_effect(0.0, 10) == 0.0
  assert stats.min_detectable_effect(sd, 10) < stats.min_detectable_effect(sd, 5)
  for bad in (dict(sd=0.1, n=1), dict(sd=0.1, n=2.5), dict(sd=float('nan'), n=5),
              dict(sd=-0.1, n=5), dict(sd=0.1, n=5, alpha=0.0), dict(sd=0.1, n=5, power=1.0)):
    with pytest.raises(ValueError):
      stats.min_detectable_effect(**bad)


def test_spearman_matches_scipy_with_ties():
  rng = np.random.default_rng(0)
  for n in (3, 7, 25, 100):
    for _ in range(5):
      x, y = rng.integers(0, 4, n).astype(float), rng.integers(0, 5, n) + 0.5 * rng.integers(0, 2, n)
      if np.ptp(x) == 0 or np.ptp(y) == 0:
        continue
      assert stats.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y)[0], abs=1e-12)
  x = rng.normal(size=50)
  assert stats.spearman(x, np.exp(x)) == pytest.approx(1.0)
  assert stats.spearman(x, -x ** 3) == pytest.approx(-1.0)


def test_spearman_degenerate_and_bad_input():
  assert math.isnan(stats.spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))  # constant: undefined
  with pytest.raises(ValueError, match='at least 2'):
    stats.spearman([1.0], [2.0])
  with pytest.raises(ValueError, match='differ in length'):
    stats.spearman([1.0, 2.0], [1.0, 2.0, 3.0])
  with pytest.raises(ValueError, match='finite'):
    stats.spearman([1.0, float('nan'), 3.0], [1.0, 2.0, 3.0])
  with pytest.raises(ValueError, match='finite'):
    stats.spearman_interval([1.0, 2.0, float('inf')], [1.0, 2.0, 3.0])


def test_spearman_interval_bootstrap():
  rng = np.random.default_rng(1)
  x = rng.normal(size=30)
  y = x + rng.normal(size=30)
  r1 = stats.spearman_interval(x, y, num_boot=2000, seed=3)
  assert r1 == stats.spearman_interval(x, y, num_boot=2000, seed=3)
  assert r1['rho'] == pytest.approx(scipy.stats.spearmanr(x, y)[0])
  assert r1['lo'] < r1['rho'] < r1['hi'] and r1['n'] == 30 and r1['valid'] == 2000
  # Fisher-z interval as a loose reference for the width at n = 30.
  se = 1.06 / math.sqrt(27)
  z = math.atanh(r1['rho'])
  assert r1['hi'] - r1['lo'] == pytest.approx(math.tanh(z + 1.96 * se) - math.tanh(z - 1.96 * se),
                                              rel=0.35)
  # A monotone relation stays exactly monotone in every resample (ties go together).
  mono = stats.spearman_interval(x, 2 * x + 1, num_boot=500)
  assert mono['rho'] == mono['lo'] == mono['hi'] == pytest.approx(1.0)
  # Resamples that draw one point only have no rho: left out, and counted.
  two = stats.spearman_interval([0.0, 1.0], [0.0, 1.0], num_boot=400)
  assert 0 < two['valid'] < 400 and two['lo'] == two['hi'] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- the report

SEEDS = (0, 1, 2, 3, 4)


def synthetic_summary(rng, methods, group_size, start=0.5) -> dict:
  """A cell's summary.json as compare writes it: per-seed runs with both endpoints."""
  runs = {m: [dict(seed=s, group_size=group_size, final_acc=float(start + rng.normal(0, .03)),
                   acc_at_budget=float(start + rng.normal(0, .03))) for s in SEEDS]
          for m in methods}
  return dict(sft=dict(greedy_acc=start), methods=runs, rollouts_per_run={m: 10240 for m in methods},
              matched_tokens=dict(budget_generated_tokens=5e5), total_wall_s=1.0)


@pytest.fixture(scope='module')
def report(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('sens')
  rng = np.random.default_rng(7)
  c = sens.get_config()
  c.report.out, c.report.num_boot = str(tmp / 'out'), 500
  summaries = {}
  for name in ('scratch_add_d3_g4', 'scratch_add_d5_g4', 'scratch_add_d8_g8'):
    s = synthetic_summary(rng, sens.METHODS.split(','), sens.parse_cell(name)['group_size'])
    for r in s['methods']['tempo:iid']:  # one clear effect
      r['acc_at_budget'] += 0.05
    summaries[name] = s
  summaries['household_g8'] = synthetic_summary(rng, sens.AGENT_METHODS.split(','), 8, start=0.2)
  for name, s in summaries.items():
    os.makedirs(tmp / 'work' / name)
    with open(tmp / 'work' / name / 'summary.json', 'w') as f:
      json.dump(s, f)
  with open(tmp / 'work' / 'scratch_add_d3_g4' / 'runs_timing.jsonl', 'w') as f:
    for i, (first, comp) in enumerate(((True, 30), (False, 0), (False, 0))):
      f.write(json.dumps(dict(method='grpo:iid', seed=i, skipped=False, index_in_process=i,
                              wall_s=10.0 if first else 2.0, cpu_s=20.0 if first else 4.0,
                              compiles=comp, cache_hits=0, programs={})) + '\n')
  rep = sensitivity.write_report(c, str(tmp / 'work'))
  return rep, summaries, c, tmp


def test_report_tables_are_the_recomputed_paired_statistics(report):
  rep, summaries, c, tmp = report
  assert set(rep['cells']) == set(summaries)
  for name, s in summaries.items():
    methods = list(s['methods'])
    for row in rep['cells'][name]:
      ref = compare.baseline_for(row['method'], methods, 'grpo:iid')
      assert row['baseline'] == ref
      if ref is None:
        assert 'tokens' not in row
        continue
      for key, short in sensitivity.KEYS:
        a = np.array([r[key] for r in s['methods'][row['method']]])
        b = np.array([r[key] for r in s['methods'][ref]])
        d = a - b
        half = scipy.stats.t.ppf(0.975, 4) * d.std(ddof=1) / math.sqrt(5)
        mde = (scipy.stats.t.ppf(0.975, 4) + scipy.stats.t.ppf(0.8, 4)) * d.std(ddof=1) / math.sqrt(5)
        e = row[short]
        assert (e['mean'], e['lo'], e['hi'], e['mde'], e['n']) == pytest.approx(
            (d.mean(), d.mean() - half, d.mean() + half, mde, 5))
        assert e['p'] == pytest.approx(scipy.stats.ttest_rel(a, b).pvalue)
  page = open(tmp / 'out' / 'credit_sensitivity.md').read()
  tempo = next(r for r in rep['cells']['scratch_add_d5_g4'] if r['method'] == 'tempo:iid')
  assert '| `tempo:iid` | `grpo:iid` | 5 | ' in page
  assert sensitivity._ci(tempo['tokens']) in page and f'{tempo["tokens"]["mde"]:.3f}' in page
  assert 'MDE = (t_{1-α/2, n-1} + t_{power, n-1})' in page
  for suffix in ('.json', '_delta_vs_horizon.png', '_accuracy_vs_learning.png'):
    assert os.path.getsize(tmp / 'out' / f'credit_sensitivity{suffix}') > 0


def test_report_holm_rank_analysis_and_timing(report):
  rep, summaries, c, tmp = report
  rows = [r for rows in rep['cells'].values() for r in rows if 'tokens' in r]
  p = np.array([r['tokens']['p'] for r in rows])
  order = np.argsort(p)
  holm = np.maximum.accumulate(np.minimum(1, (len(p) - np.arange(len(p))) * p[order]))
  assert [r['tokens']['p_holm'] for r in np.array(rows)[order]] == pytest.approx(list(holm))
  token = rep['accuracy']['token']
  quality = sensitivity.load_quality(c.report.credit_quality)
  # grpo (reference), tempo, treerl, mc_values in each of the 3 scratch_add cells.
  assert len(token['points']) == 12 and set(token['left_out']) == {'ppo:iid', 'scrl:iid'}
  for pt in token['points']:
    assert pt['corr'] == quality[pt['estimator']][pt['group_size']]
    row = next(r for r in rep['cells'][pt['cell']] if r['method'] == pt['method'])
    assert pt['delta'] == (0.0 if pt['reference'] else row['tokens']['mean'])
  x, y = [q['corr'] for q in token['points']], [q['delta'] for q in token['points']]
  assert token['rho']['rho'] == pytest.approx(scipy.stats.spearmanr(x, y)[0])
  agent = rep['accuracy']['agent']
  assert {q['estimator'] for q in agent['points']} == {'grpo', 'gigpo', 'mt_grpo'}
  assert agent['left_out'] == ['beacon:iid']  # no milestones in the benchmark environments
  t = rep['info']['scratch_add_d3_g4']['timing']
  assert t['first']['compiles'] == 30 and t['later']['compiles'] == 0
  assert t['later']['seeds_per_cpu_min'] == pytest.approx(60 * 2 / 8.0)
  assert rep['main_job'] and rep['main_job'][0]['tokens']['n'] == 3  # the stored main job


def test_established_paragraph_follows_the_numbers(report):
  rep = report[0]
  text = sensitivity.established(rep)
  sep = [(n, r) for n, rows in rep['cells'].items() for r in rows if 'tokens' in r
         and (r['tokens']['lo'] > 0 or r['tokens']['hi'] < 0)]
  assert ('No interval excludes 0' in text) == (not sep)
  for n, r in sep:
    assert f'`{r["method"]}` in `{n}`' in text


# ----------------------------------------------------------------------------- the grid


def test_grid_and_validation():
  c = sens.get_config()
  sens.check(c)
  names = sens.cell_names(c)
  assert names[:2] == ['scratch_add_d3_g4', 'scratch_add_d3_g8'] and 'household_long_g8' in names
  cfg = sens.cell_config(c, 'scratch_add_d8_g4')
  assert (cfg.task.kwargs.num_digits, cfg.sft.steps, cfg.sampler.group_size,
          cfg.sampler.num_chains, cfg.critic.targets) == (8, c.sft_steps.d8, 4, 2, 'tree')
  assert (cfg.rl.steps, cfg.rl.prompts_per_step, tuple(cfg.seeds)) == (40, 64, tuple(range(10)))
  long = sens.cell_config(c, 'household_long_g8')
  assert (long.task.name, long.sft.steps, long.model.attn_chunk) == ('household_long', 450, 128)
  c.cells = 'scratch_add_d5_g8,household_g8'
  assert sens.selected_cells(c) == ['scratch_add_d5_g8', 'household_g8']
  bad = [('cells', 'scratch_add_d4_g4', 'unknown cell'), ('horizons', (3, 9), 'num_digits'),
         ('horizons', (3, 4), 'no SFT steps'), ('methods', 'grpo:iid,nonsense:iid', 'nonsense'),
         ('methods', 'tempo:iid', 'lacks the baseline'), ('group_sizes', (3,), 'even'),
         ('agent_tasks', ('kitchen',), 'unknown agent task'), ('seeds', (0, 0), 'repeats')]
  for field, value, match in bad:
    c = sens.get_config()
    c[field] = value
    with pytest.raises(ValueError, match=match):
      sens.check(c)
      sens.selected_cells(c)


# ----------------------------------------------------------------------------- running


def test_compile_counter_sees_a_new_program_once():
  f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
  x = jnp.ones(7)
  y = x + 1
  with sensitivity.CompileCounter() as counter:
    f(x)
    first = counter.snapshot()[0]['compiles']
    f(y)
  assert first >= 1 and counter.counts['compiles'] == first


def test_run_cell_shares_sft_and_times_each_run(tmp_path, monkeypatch):
  """Two cells of one horizon, stand-ins for run_experiment and loop.train: one shared SFT
  directory linked from both, one timing record per run, a finished run marked skipped (and
  left out of the throughput)."""
  c = sens.get_config()
  c.seeds = (0, 1)

  def fake_train(cfg, workdir, params, method=None, seed=0):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
      f.write(json.dumps(dict(step=cfg.rl.steps, greedy_acc=0.5)) + '\n')
    return dict(final_acc=0.5)

  def fake_experiment(cfg, workdir, defaults=None, explicit=(), train=None):
    assert os.path.islink(os.path.join(workdir, 'sft'))
    for seed in cfg.seeds:
      train(cfg, os.path.join(workdir, 'grpo_iid', f'seed{seed}'), None, 'grpo:iid', seed)
    return dict(methods={})

  monkeypatch.setattr(loop, 'train', fake_train)
  monkeypatch.setattr(compare, 'run_experiment', fake_experiment)
  for name in ('scratch_add_d5_g4', 'scratch_add_d5_g8', 'scratch_add_d5_g4'):
    sensitivity.run_cell(c, name, str(tmp_path))
  for name in ('scratch_add_d5_g4', 'scratch_add_d5_g8'):
    assert os.path.realpath(tmp_path / name / 'sft') == str(tmp_path / 'sft_scratch_add_d5')
  recs = sensitivity.load_timing(str(tmp_path), 'scratch_add_d5_g4')
  assert [(r['seed'], r['skipped'], r['index_in_process']) for r in recs] == [
      (0, False, 0), (1, False, 1), (0, True, 0), (1, True, 1)]
  t = sensitivity.timing_stats(recs)  # skipped runs left out; seed 0 compiled grpo's programs
  assert (t['runs'], t['skipped'], t['first']['runs'], t['later']['runs']) == (2, 2, 1, 1)
  assert len(sensitivity.load_timing(str(tmp_path), 'scratch_add_d5_g4', 'cell_timing.jsonl')) == 2
  os.remove(tmp_path / 'scratch_add_d5_g8' / 'sft')
  os.makedirs(tmp_path / 'scratch_add_d5_g8' / 'sft')
  with pytest.raises(ValueError, match='not a link'):
    sensitivity.run_cell(c, 'scratch_add_d5_g8', str(tmp_path))


# ----------------------------------------------------------------------------- the stored page

STORED = os.path.join(sensitivity.REPO, 'docs', 'results', 'credit_sensitivity')


def test_results_page_is_what_the_stored_cells_generate():
  """docs/results/credit_sensitivity.md is regenerated, number for number, from the cells'
  stored summaries and timings (docs/results/credit_sensitivity/<cell>/) and the stored
  credit-accuracy and main-job files (`--report --workdir=docs/results/credit_sensitivity`)."""
  base = os.path.join(sensitivity.REPO, 'docs', 'results', 'credit_sensitivity')
  with open(base + '.json') as f:
    figures = json.load(f)['figures']
  rep = sensitivity.build_report(sens.get_config(), STORED)
  assert sorted(rep['cells']) == sorted(os.listdir(STORED))
  with open(base + '.md') as f:
    assert sensitivity.render(rep, figures) == f.read(), (
        'docs/results/credit_sensitivity.md is stale: python -m experiments.sensitivity '
        '--report --workdir=docs/results/credit_sensitivity')
