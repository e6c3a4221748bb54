"""The shared comparison script behind every per-paper script in experiments/.

    python -m experiments.<paper> [--config=configs/<paper>.py] [--workdir=/tmp/treecredit/<paper>]
        [--config.quick=True] [--config.rl.steps=100] [--config.methods=grpo:iid,tempo:iid]

One SFT warm start, then every "credit:sampler" method in `config.methods` x
every seed in `config.seeds`, on the same task and rollout budget, through the
shared loop (`experiments/training/loop.py`). Layout of the workdir: sft/,
<credit>_<sampler>/seed<k>/{metrics.jsonl, checkpoints/} (<credit>_<sampler>/lr<lr>/seed<k>/
with `config.lr_grid`), curves_vs_{step,wall,generated_tokens}.png, summary.json.
Rerunning with the same workdir resumes or skips finished runs. `--config.quick=True`
shrinks everything to a smoke run (`configs.tempo.shrink`, applied after the other overrides,
keeping the fields set on the command line and printing which). A method or seed given twice
is refused (`check_comparison`).

Reported per method: final accuracy (matched steps = matched rollouts), accuracy at a
matched generated-token budget, and paired differences over seeds against GRPO
(`config.baseline`), see `run_experiment`; `--config.lr_grid='(1e-4,3e-4)'` sweeps lr.
"""

import importlib
import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import credit
from configs import agents as agents_config
from configs import lm as lm_config
from configs import tempo as tempo_config
from experiments.training import loop, metrics_io, passes, plots, problems, stats, tracking
from experiments.training.config_checks import problem_kind
from experiments.training import train_step as ts

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          'configs')


def unknown_override(argv, reference) -> str | None:
  """A message naming the first `--config.<path>` in argv that `reference` lacks, or None."""
  for arg in argv:
    if not arg.startswith('--config.'):
      continue
    node, path = reference, arg[len('--config.'):].split('=')[0].split('.')
    for depth, key in enumerate(path):
      if not hasattr(node, 'keys') or key not in node:
        where = '.'.join(path[:depth]) or 'the config'
        valid = ', '.join(sorted(node.keys())) if hasattr(node, 'keys') else '(none: a leaf)'
        return f'unknown config field {".".join(path)!r}; valid fields of {where}: {valid}'
      node = node[key]
  return None


def _run_cfg(cfg):
  """cfg without the comparison-only fields (baseline, lr_grid): runs' fingerprints as before."""
  out = cfg.copy_and_resolve_references()
  with out.unlocked():
    for field in ('baseline', 'lr_grid'):
      if field in out:
        del out[field]
  return out


def run_dir(workdir: str, method: str, seed: int, lr=None) -> str:
  """<credit>_<sampler>/seed<k>, or <credit>_<sampler>/lr<lr>/seed<k> in an lr sweep."""
  parts = [method.replace(':', '_')] + ([f'lr{lr:g}'] if lr is not None else []) + [f'seed{seed}']
  return os.path.join(workdir, *parts)


def eval_curve(rows, x_key: str = 'generated_tokens_total'):
  """(x, greedy_acc) arrays of a run's eval rows (x of the step-0 row is 0); None if x is unlogged."""
  pts = [(0.0 if r['step'] == 0 and x_key not in r else r.get(x_key), r['greedy_acc'])
         for r in rows if 'greedy_acc' in r]
  pts = [p for p in pts if p[0] is not None]
  if len(pts) < 2:
    return None
  x, y = np.asarray(pts, float).T
  return x, y


def acc_at(rows, budget: float, x_key: str = 'generated_tokens_total') -> float:
  """Greedy accuracy at x = budget, linear in x between eval rows; nan past the run's end."""
  c = eval_curve(rows, x_key)
  if c is None or not np.isfinite(budget) or budget > c[0][-1] * (1 + 1e-9):
    return float('nan')
  return float(np.interp(budget, *c))


def matched_budget(rows_by_method: dict, x_key: str = 'generated_tokens_total') -> float:
  """The largest x every run reached: min over all runs (methods x seeds) of their last x."""
  ends = [c[0][-1] for runs in rows_by_method.values() for rows in runs
          if (c := eval_curve(rows, x_key)) is not None]
  return float(min(ends)) if ends else float('nan')


def baseline_for(method: str, methods, baseline: str):
  """GRPO on the method's own sampler if run (and not the method itself), else `baseline`;
  None for the baseline itself or when the baseline was not run."""
  (base_credit, *_), = loop.parse_methods(baseline)
  same = f'{base_credit}:{method.split(":")[1]}'
  ref = same if same in methods and same != method else baseline
  return ref if ref in methods and ref != method else None


def paired_stats(results: dict, baseline: str, level: float = 0.95, rows=None) -> dict:
  """{method: {baseline, seeds, final_acc / acc_at_budget (/ acc_at_env_steps): {t, bootstrap},
  values: {key: the paired values, seeds, method, baseline}}}: paired over shared seeds.

  With `rows` (each run's metric rows, ordered as `results`), the matched-budget differences
  are read at the pair's own budget, the largest generated-token count (environment-step
  count) every run of the two methods reached, kept in the entry as budget_generated_tokens
  (budget_env_steps): another method in the comparison does not move the pair's point.
  Without `rows`: the runs' own acc_at_budget (the comparison's budget)."""
  out = {}
  for m, runs in results.items():
    ref = baseline_for(m, list(results), baseline)
    if ref is None:
      continue
    entry, base = dict(baseline=ref), results[ref]
    if rows is not None:
      runs, base, budgets = _at_pair_budget({m: runs, ref: base}, {m: rows[m], ref: rows[ref]})
      entry.update(budgets)
    base = {r['seed']: r for r in base}
    for key in ('final_acc', 'acc_at_budget', 'acc_at_env_steps'):
      if key not in runs[0]:
        continue
      pairs = [(r[key], base[r['seed']][key], r['seed']) for r in runs if r['seed'] in base]
      pairs = [p for p in pairs if np.isfinite(p[0]) and np.isfinite(p[1])]
      a, b, seeds = np.asarray(pairs, float).reshape(-1, 3).T
      entry[key] = None if not pairs else {
          how: stats.paired_difference(a, b, level=level, method=how) for how in stats.METHODS}
      entry.setdefault('values', {})[key] = dict(seeds=[int(x) for x in seeds], method=a.tolist(),
                                                 baseline=b.tolist())
    entry['seeds'] = [r['seed'] for r in runs if r['seed'] in base]
    out[m] = entry
  return out


def _at_pair_budget(results: dict, rows: dict):
  """(runs of the first method, runs of the second, budgets): the two methods' run summaries
  with acc_at_budget (and acc_at_env_steps, if they have it) read at the pair's budgets."""
  keys = {'acc_at_budget': ('generated_tokens_total', 'budget_generated_tokens'),
          'acc_at_env_steps': ('env_steps_total', 'budget_env_steps')}
  keys = {k: v for k, v in keys.items() if k in next(iter(results.values()))[0]}
  budgets = {name: matched_budget(rows, x) for x, name in keys.values()}
  at = lambda m: [dict(r, **{k: acc_at(rw, budgets[name], x) for k, (x, name) in keys.items()})
                  for r, rw in zip(results[m], rows[m])]
  return (*(at(m) for m in results), budgets)


def _over_seeds(results: dict, key: str) -> dict:
  """{method: {mean, std, per_seed}} of one per-run summary value."""
  return {m: dict(mean=float(np.mean(a := [s[key] for s in runs])), std=float(np.std(a)),
                  per_seed=a) for m, runs in results.items()}


def check_comparison(cfg):
  """Refuses a comparison that would count one run twice: a method repeated in
  `config.methods` ('grpo' and 'grpo:iid' are the same), a seed repeated in `config.seeds`
  (a "mean ± std over 2 seeds" and a paired test of one seed's copies), a repeated lr
  (as lr<lr:g> directories); an empty seed list; and a `credit.hparams` key that one of the
  methods' estimators does not take (every method of the comparison is passed all of them);
  an unknown or uninstalled `log.sinks` entry."""
  parsed = loop.parse_methods(cfg.methods)
  methods = [loop.method_name(*m) for m in parsed]
  twice = sorted({m for m in methods if methods.count(m) > 1})
  if twice:
    raise ValueError(f'config.methods {cfg.methods!r} repeats {", ".join(twice)}: each '
                     'method would be run and reported twice; list every method once')
  if isinstance(cfg.seeds, str) or not all(
      isinstance(s, int) and not isinstance(s, bool) for s in cfg.seeds):
    raise ValueError(f'config.seeds {cfg.seeds!r}: give a tuple of ints, e.g. '
                     '--config.seeds="(0,1,2)"')
  seeds = tuple(cfg.seeds)
  if not seeds:
    raise ValueError('config.seeds is empty: give at least one seed, e.g. --config.seeds="(0,)"')
  twice = sorted({s for s in seeds if seeds.count(s) > 1})
  if twice:
    raise ValueError(f'config.seeds {seeds} repeats {", ".join(map(str, twice))}: a repeated '
                     'seed is the same run counted twice (in mean ± std and in the paired '
                     'tests); list every seed once')
  tracking.check(cfg)  # log.sinks: known names, their packages installed
  for name, _, _, own in parsed:  # the shared dict, with the method's own keys over it
    credit.check_hparams(name, {**dict(cfg.credit.hparams), **dict(own)})
  kind, caps = problem_kind(cfg), problems.capabilities(cfg)
  for method in parsed:  # each method's passes' checks, before the warm start
    passes.check(loop.with_method(cfg, loop.method_name(*method)), kind, caps)
  grid = [float(lr) for lr in (cfg.get('lr_grid', ()) or ())]
  if len({f'{lr:g}' for lr in grid}) != len(grid):
    raise ValueError(f'lr_grid {tuple(grid)} has repeated values (as lr<lr:g> directories)')


def run_experiment(cfg, workdir: str, defaults=None, explicit=(), train=None) -> dict:
  """SFT once, then every method x seed (x lr in cfg.lr_grid); writes plots + summary.json;
  returns the summary.

  `cfg.quick` shrinks cfg to a smoke run (`configs.<tempo|lm|agents>.shrink`) but keeps the
  fields the user set: those differing from `defaults` (the config cfg was built from; None:
  its family's get_config()) and those named in `explicit` (the command line's overrides).

  Besides final (matched-steps, i.e. matched-rollouts) accuracy, every method is read at
  a matched generated-token budget (`matched_budget`, `acc_at`), and compared with its
  GRPO baseline (`baseline_for`) by paired differences over seeds (`experiments.training.stats`:
  95 % paired t interval printed, percentile bootstrap also in summary.json). With an lr
  grid each method's reported runs are its best lr by mean final accuracy over seeds
  (chosen on the same held-out set it is reported on, so optimistic for every method alike).

  As each run finishes, the plots and summary.json of the runs so far are rewritten (that
  summary also has `partial`: runs done of the total) and their table printed; the final
  summary.json has no `partial`. `train` replaces `loop.train` for every run (same
  signature; e.g. a wrapper that times runs and counts compiles, experiments/sensitivity.py).
  """
  if cfg.quick:
    shrink = (lm_config if loop.is_text(cfg) else
              agents_config if loop.is_agent(cfg) else tempo_config).shrink
    shrink(cfg, defaults=defaults, explicit=explicit)
  loop.check_config(cfg)
  check_comparison(cfg)
  methods = [loop.method_name(*m) for m in loop.parse_methods(cfg.methods)]
  baseline = cfg.get('baseline', 'grpo:iid')
  baseline = loop.method_name(*loop.parse_methods(baseline)[0])  # validated, 'grpo' -> 'grpo:iid'
  grid = [float(lr) for lr in (cfg.get('lr_grid', ()) or ())]
  run_cfg = _run_cfg(cfg)
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  params0, sft_info = _start(cfg, run_cfg, workdir)
  total = len(methods) * len(grid or [None]) * len(cfg.seeds)
  report = lambda cells, done=None: _report(cfg, methods, grid, baseline, sft_info, cells,
                                            workdir, time.time() - t0, done, total)

  def progress(cells, done):
    if done < total:  # after the last run: the final report
      report(cells, done)

  cells = _train_cells(cfg, run_cfg, methods, grid, params0, workdir, on_run=progress,
                       train=train)
  return report(cells)


def _report(cfg, methods, grid, baseline, sft_info, cells, workdir: str, wall_s: float,
            done, total: int) -> dict:
  """The summary of the runs in `cells`, written (plots, summary.json) and its table printed;
  `done` runs of `total` (None: the comparison's end) are named in a partial summary."""
  methods = [m for m in methods if any((m, lr) in cells for lr in grid or [None])]
  lr_summary, best = _best_lr(cells, methods, grid)
  results = {m: [dict(s) for s in cells[m, best[m]][0]] for m in methods}
  rows = {m: cells[m, best[m]][1] for m in methods}
  matched = _matched_tokens(cfg, results, rows)
  label = lambda m: m if best[m] is None else f'{m} lr={best[m]:g}'
  writer = jax.process_index() == 0  # multi-host: every process computes, one writes
  paths = plots.plot_runs({label(m): rows[m] for m in methods}, workdir, title=(
      f'{cfg.task.name} {dict(cfg.task.kwargs)}: {cfg.rl.steps} steps x '
      f'{cfg.rl.prompts_per_step} prompts, seeds {tuple(cfg.seeds)}'
      f'{", best lr of " + str(tuple(grid)) if grid else ""}')) if writer else []
  summary = dict(sft=sft_info, methods=results, total_wall_s=wall_s, plots=paths,
                 task=cfg.task.name, rollouts_per_run={m: cfg.rl.steps * cfg.rl.prompts_per_step *
                                                   results[m][0]['group_size'] for m in results},
                 matched_tokens=matched, lr_grid=lr_summary,
                 paired=dict(baseline=baseline, level=0.95, printed='t', intervals=(
                     't: mean ± t_{n-1,0.975} sd/sqrt(n); bootstrap: 2.5/97.5 % percentiles of '
                     '10,000 resampled mean differences (seed 0); n = 1: nan ends'),
                     by_method=paired_stats(results, baseline, rows=rows)))
  if done is not None:
    summary['partial'] = dict(runs_done=done, runs_total=total)
  if writer:  # atomic: a reader mid-comparison sees the previous summary or this one
    metrics_io.write_atomic(os.path.join(workdir, 'summary.json'),
                            json.dumps(summary, indent=1).encode())
  if done is not None:
    print(f'\nAfter {done} of {total} runs (summary.json and plots so far in {workdir}):')
  print(format_table(summary, cfg.eval.pass_k), flush=True)
  return summary


def _start(cfg, run_cfg, workdir: str):
  """(params, info) of the starting point: the pretrained model (text tasks) or the SFT
  warm start, cached in <workdir>/sft."""
  if loop.is_text(cfg):  # a pretrained (instruct) model is the starting point
    params0, sft_info = loop.pretrained_start(run_cfg)
  else:
    params0, sft_info = loop.sft(run_cfg, os.path.join(workdir, 'sft'))
  print(f'{"Start" if loop.is_text(cfg) else "SFT warm start"}: greedy acc {sft_info["greedy_acc"]:.3f}, '
        f'pass@{cfg.eval.pass_k} {sft_info[f"pass@{cfg.eval.pass_k}"]:.3f} '
        f'({sft_info["wall_s"]:.1f} s)', flush=True)
  return params0, sft_info


def _train_cells(cfg, run_cfg, methods, grid, params0, workdir: str, on_run=None,
                 train=None) -> dict:
  """{(method, lr or None): ([run summaries], [metric rows])}: every method x lr x seed;
  `on_run(cells so far, runs done)` after each run; `train` None: `loop.train`."""
  train = train or loop.train
  cells = {}
  for method in methods:
    g = loop.group_size(loop.with_method(cfg, method).sampler)
    for lr in grid or [None]:
      c = run_cfg
      if lr is not None:
        c = run_cfg.copy_and_resolve_references()
        c.optimizer.lr = lr
      for seed in cfg.seeds:
        d = run_dir(workdir, method, seed, lr)
        s = train(c, d, params0, method=method, seed=seed)
        s.pop('params', None)
        s.pop('library', None)
        rows = loop.read_metrics(os.path.join(d, 'metrics.jsonl'))
        s.update(group_size=g, seed=seed, lr=c.optimizer.lr, generated_tokens_total=(
            rows[-1].get('generated_tokens_total', float('nan')) if rows else float('nan')))
        runs, rws = cells.setdefault((method, lr), ([], []))
        runs.append(s)
        rws.append(rows)
        print(f'  {method:>20s}{f" lr {lr:g}" if lr is not None else ""} seed {seed}: final acc '
              f'{s["final_acc"]:.3f} (peak {s["peak_acc"]:.3f}), {s["wall_s"]:.1f} s', flush=True)
        if on_run is not None:
          on_run(cells, sum(len(runs) for runs, _ in cells.values()))
  return cells


def _best_lr(cells, methods, grid):
  """(the lr grid's summary or None, {method: its best lr or None}): best by mean final
  accuracy over seeds, ties to the first in the grid (of the lrs in `cells`: all at the end)."""
  if not grid:
    return None, {m: None for m in methods}
  ran = lambda m: [lr for lr in grid if (m, lr) in cells]
  score = lambda m, lr: np.nan_to_num(np.mean([r['final_acc'] for r in cells[m, lr][0]]),
                                      nan=-np.inf)
  best = {m: max(ran(m), key=lambda lr: score(m, lr)) for m in methods}
  return dict(grid=grid, selected_by='mean final greedy_acc over seeds', best=best, runs={
      m: {f'{lr:g}': dict(final_acc_mean=float(np.mean(a := [r['final_acc'] for r in cells[m, lr][0]])),
                          final_acc_std=float(np.std(a)), final_acc=a)
          for lr in ran(m)} for m in methods}), best


def _matched_tokens(cfg, results, rows) -> dict:
  """Each run's accuracy at the matched generated-token budget (and, multi-turn, at matched
  environment steps), set in its summary; returns their means over seeds."""
  budget = matched_budget(rows)
  agent = loop.is_agent(cfg)  # multi-turn: also at matched environment steps
  steps_budget = matched_budget(rows, 'env_steps_total') if agent else None
  for m in results:
    for s, rws in zip(results[m], rows[m]):
      s['acc_at_budget'] = acc_at(rws, budget)
      if agent:
        s['acc_at_env_steps'] = acc_at(rws, steps_budget, 'env_steps_total')
  matched = dict(
      budget_generated_tokens=budget,
      definition='greedy_acc interpolated linearly in cumulative generated tokens (forks\' '
                 'copied prefixes excluded) at the largest budget every run reached',
      acc=_over_seeds(results, 'acc_at_budget'))
  if agent:
    matched['budget_env_steps'] = steps_budget
    matched['acc_at_env_steps'] = _over_seeds(results, 'acc_at_env_steps')
  return matched


def _ci(st) -> str:
  """'+0.012 [-0.030, +0.054]' from a stats.paired_difference dict (or '-')."""
  if st is None:
    return '-'
  return f'{st["mean"]:+.3f} [{st["lo"]:+.3f}, {st["hi"]:+.3f}]'


def format_table(summary, pass_k) -> str:
  ms = lambda xs: f'{np.mean(xs):.3f}±{np.std(xs):.3f}'
  matched = summary.get('matched_tokens') or {}
  budget = matched.get('budget_generated_tokens', float('nan'))
  at = f'acc@{budget / 1e3:.1f}k tok' if np.isfinite(budget) else 'acc@tok'
  head = (f'{"method":>26} {"G":>3} {"rollouts":>8} {"gen tok":>9} {"final acc":>12} '
          f'{at:>15} {"peak acc":>12} '
          f'{"pass@" + str(pass_k):>12} {"reward":>12} {"wall s":>8} {"samp tok/s":>10} '
          f'{"train tok/s":>11} {"credit %":>8}')
  grid = summary.get('lr_grid')
  name = lambda m: m if not grid else f'{m} lr={grid["best"][m]:g}'
  w = max([26] + [len(name(m)) for m in summary['methods']])
  head = f'{"method":>{w}}' + head[26:]
  lines = [head, '-' * len(head)]
  for m, runs in summary['methods'].items():
    get = lambda k: [r.get(k, float('nan')) for r in runs]
    lines.append(
        f'{name(m):>{w}} {runs[0]["group_size"]:>3} {summary["rollouts_per_run"][m]:>8} '
        f'{np.mean(get("generated_tokens_total")):>9.0f} '
        f'{ms(get("final_acc")):>12} {ms(get("acc_at_budget")):>15} {ms(get("peak_acc")):>12} '
        f'{ms(get("final_pass")):>12} '
        f'{ms(get("final_reward")):>12} {np.mean(get("wall_s")):>8.1f} '
        f'{np.mean(get("sampled_tokens_per_s")):>10.0f} {np.mean(get("train_tokens_per_s")):>11.0f} '
        f'{100 * np.mean(get("credit_frac")):>8.2f}')
  sft = summary['sft']
  n = sorted({len(runs) for runs in summary['methods'].values()})  # differ only in a partial one
  lines.append(f'(mean±std over {n[0] if len(n) == 1 else f"{n[0]}-{n[-1]}"} seeds; '
               f'{"start" if "source" in sft else "SFT start"}: acc {sft["greedy_acc"]:.3f}; total {summary["total_wall_s"]:.0f} s; '
               f'gen tok: generated tokens per run, forks\' copied prefixes excluded; '
               f'{at}: at the largest generated-token budget every run reached)')
  paired = summary.get('paired')
  if paired and paired.get('by_method'):
    lines.append(f'\nPaired differences vs baseline over seeds: mean [{100 * paired["level"]:.0f} % paired-t '
                 f'interval] (bootstrap percentile intervals in summary.json); matched tokens: '
                 f'the largest budget every run of the pair reached')
    sub = (f'{"method":>26} {"baseline":>20} {"n":>2} {"Δ final acc":>26} '
           f'{"Δ acc@matched tok":>26} {"at tok":>8}')
    lines += [sub, '-' * len(sub)]
    for m, e in paired['by_method'].items():
      pick = lambda k: None if e.get(k) is None else e[k][paired.get('printed', 't')]
      n = (pick('final_acc') or {}).get('n', 0)
      pair_budget = e.get('budget_generated_tokens', budget)
      lines.append(f'{m:>26} {e["baseline"]:>20} {n:>2} {_ci(pick("final_acc")):>26} '
                   f'{_ci(pick("acc_at_budget")):>26} {pair_budget / 1e3:>7.1f}k')
  if 'budget_env_steps' in matched:
    steps = matched['budget_env_steps']
    lines.append(f'\nMulti-turn: success at {steps:.0f} environment steps (the most every run took; '
                 f'forks\' copied turns excluded), mean±std, and paired Δ vs baseline (at the '
                 f'most every run of the pair took)')
    sub = f'{"method":>26} {"acc@env steps":>15} {"Δ acc@env steps":>26}'
    lines += [sub, '-' * len(sub)]
    by = (paired or {}).get('by_method', {})
    for m, runs in summary['methods'].items():
      e = by.get(m, {}).get('acc_at_env_steps')
      lines.append(f'{m:>26} {ms([r["acc_at_env_steps"] for r in runs]):>15} '
                   f'{_ci(None if e is None else e[paired.get("printed", "t")]):>26}')
  if grid:
    lines.append(f'\nLearning-rate grid: final acc mean±std over seeds (best by {grid["selected_by"]} marked *)')
    sub = f'{"method":>26} ' + ' '.join(f'{"lr " + f"{lr:g}":>13}' for lr in grid['grid'])
    lines += [sub, '-' * len(sub)]
    for m, cells in grid['runs'].items():
      cell = lambda lr, c: (('*' if lr == grid['best'][m] else '') +
                            f'{c["final_acc_mean"]:.3f}±{c["final_acc_std"]:.3f}')
      show = lambda lr: (cell(lr, cells[f'{lr:g}']) if f'{lr:g}' in cells
                         else '-')  # not run yet (a partial summary)
      lines.append(f'{m:>26} ' + ' '.join(f'{show(lr):>13}' for lr in grid['grid']))
  return '\n'.join(lines)


def main(name: str):
  """Entry point of `experiments/<name>.py`: --config defaults to configs/<name>.py."""
  reference = lambda: loop.reference_config(
      importlib.import_module(f'configs.{name}').get_config())
  try:  # ml_collections applies --config.* overrides here, with a terse KeyError on a typo.
    config = config_flags.DEFINE_config_file(
        'config', os.path.join(CONFIG_DIR, f'{name}.py'), 'Experiment config (ml_collections).')
  except (KeyError, AttributeError) as e:
    message = unknown_override(sys.argv[1:], reference())
    if message is None:
      raise
    raise SystemExit(message) from e
  workdir = flags.DEFINE_string('workdir', f'/tmp/treecredit/{name}', 'Output directory.')

  def run(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    ts.maybe_initialize_distributed()
    flag = flags.FLAGS['config']  # quick keeps what this command line set
    run_experiment(config.value, workdir.value, defaults=flag.parser.parse(flag.config_filename),
                   explicit=tuple(config_flags.get_override_values(flag)))

  try:
    app.run(run)
  except KeyError as e:  # an unknown --config.<field>, if ml_collections reports it only here
    message = unknown_override(sys.argv[1:], reference())
    if message is None:
      raise
    raise SystemExit(message) from e
