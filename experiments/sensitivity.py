"""Runs the cells of configs/sensitivity.py (issue 42) and writes their report.

    python -m experiments.sensitivity --config=configs/sensitivity.py --workdir=DIR
        [--config.cells=scratch_add_d3_g4,...] [--config.seeds="(0,1,2)"] [--config.quick=True]
    python -m experiments.sensitivity --config=configs/sensitivity.py --workdir=DIR --report

Each cell runs in DIR/<cell>; one SFT warm start per (task, horizon) in DIR/sft_<task>[_d<D>],
linked as each cell's sft/; a rerun skips finished runs. Every run's wall and CPU seconds and
the programs it compiled go to DIR/<cell>/runs_timing.jsonl. --report writes
<report.out>/<report.name>.md, .json and figures from the cells' summary.json files and the
stored credit-accuracy files. docs/sensitivity.md describes the workdir, the statistics and
the design.
"""

import collections
import json
import math
import os
import time

import jax
import matplotlib
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from configs import sensitivity as sens
from experiments import credit_quality as cq
from experiments.training import compare, loop, stats

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_COMPILE = '/jax/core/compile/backend_compile_duration'
TRACE = '/jax/core/compile/jaxpr_trace_duration'
CACHE_HITS = '/jax/compilation_cache/cache_hits'
MAIN_JOB_CELL = 'scratch_add_d3_g8'  # configs/tempo.py's task, G and budget: the main job
DECIDED = 0.015  # issue 42: the main job is decided by an interval narrower than this
KEYS = (('acc_at_budget', 'tokens'), ('final_acc', 'final'))  # matched tokens, matched rollouts
# A quick cell keeps its G and its task (household_long needs max_turns >= 12, where
# configs.agents.shrink would set 6).
KEPT_BY_QUICK = ('sampler.group_size', 'sampler.num_chains', 'sampler.num_forks',
                 'sampler.num_continuations', 'task.kwargs')
MDE_NOTE = ('MDE = (t_{{1-α/2, n-1}} + t_{{power, n-1}}) · sd / √n, sd the standard deviation '
            'of the n paired differences (ddof 1), α = {alpha} two-sided, power {power}: the true '
            'mean difference a paired t test of these n seeds detects with probability {power}')


# ----------------------------------------------------------------------------- running


class CompileCounter:
  """Counts programs built, traces and persistent-cache hits while entered (issue 42).

  'compiles' counts jax's backend-compile events: one per miss of jit's in-memory cache
  (a program lowered, then compiled by XLA or fetched from the persistent compilation
  cache, when one is set); 'cache_hits' the fetches among them. A seed that reuses the
  process's programs adds neither."""

  def __init__(self):
    self.counts = collections.Counter()
    self.programs = collections.Counter()

  def _on_duration(self, event, duration, **kw):
    if event == BACKEND_COMPILE:
      self.counts['compiles'] += 1
      self.counts['compile_s'] += duration
      self.programs[str(kw.get('fun_name', '?'))] += 1
    elif event == TRACE:
      self.counts['traces'] += 1

  def _on_event(self, event, **kw):
    if event == CACHE_HITS:
      self.counts['cache_hits'] += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)

  def snapshot(self):
    return collections.Counter(self.counts), collections.Counter(self.programs)


def _finished(run_dir: str, steps: int) -> bool:
  """True when the run's metrics already reach its last step (a rerun only reads it back)."""
  path = os.path.join(run_dir, 'metrics.jsonl')
  rows = loop.read_metrics(path) if os.path.exists(path) else []
  return bool(rows) and rows[-1].get('step', -1) >= steps


def timed_train(train, counter: CompileCounter, records: list):
  """`loop.train` that appends each run's wall / CPU seconds and compiles to `records`
  (index_in_process: the run's place in this cell's process, 0 for its first)."""

  def run(cfg, workdir, params, method=None, seed=0, **kw):
    skipped = _finished(workdir, cfg.rl.steps)
    counts0, programs0 = counter.snapshot()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = train(cfg, workdir, params, method=method, seed=seed, **kw)
    counts, programs = counter.snapshot()
    counts.subtract(counts0)
    programs.subtract(programs0)
    records.append(dict(
        method=method, seed=seed, skipped=skipped, index_in_process=len(records),
        wall_s=time.perf_counter() - wall0,
        cpu_s=time.process_time() - cpu0, compiles=int(counts['compiles']),
        compile_s=float(counts['compile_s']), traces=int(counts['traces']),
        cache_hits=int(counts['cache_hits']),
        programs={k: v for k, v in programs.items() if v > 0}, time=time.time()))
    return out

  return run


def shared_sft_dir(workdir: str, name: str, quick: bool) -> str:
  """DIR/sft_<task>[_d<D>][_quick]: one warm start per (task, horizon), shared over G."""
  cell = sens.parse_cell(name)
  tag = cell['task'] + (f'_d{cell["digits"]}' if cell['digits'] else '')
  return os.path.join(workdir, f'sft_{tag}' + ('_quick' if quick else ''))


def link_sft(cell_dir: str, shared: str) -> None:
  """Makes cell_dir/sft a relative link to the shared warm start (kept if already one)."""
  os.makedirs(shared, exist_ok=True)
  os.makedirs(cell_dir, exist_ok=True)
  link = os.path.join(cell_dir, 'sft')
  if os.path.islink(link) and os.path.realpath(link) == os.path.realpath(shared):
    return
  if os.path.lexists(link):
    raise ValueError(f'{link} exists and is not a link to {shared}: move it away (a cell '
                     'of this study reads its horizon\'s shared warm start)')
  os.symlink(os.path.relpath(shared, cell_dir), link)


def run_cell(c, name: str, workdir: str, explicit=()) -> dict:
  """One cell: `compare.run_experiment` in DIR/<cell> with the shared SFT, every run timed and
  its compiles counted (DIR/<cell>/runs_timing.jsonl); returns the cell's summary. With
  `quick` the cell is shrunk but keeps its G and task (`KEPT_BY_QUICK`) and `explicit`."""
  cfg = sens.cell_config(c, name)
  cell_dir = os.path.join(workdir, name)
  link_sft(cell_dir, shared_sft_dir(workdir, name, bool(c.quick)))
  records = []
  wall0, cpu0 = time.perf_counter(), time.process_time()
  with CompileCounter() as counter:
    summary = compare.run_experiment(cfg, cell_dir, defaults=cfg.copy_and_resolve_references(),
                                     explicit=tuple(explicit) + KEPT_BY_QUICK,
                                     train=timed_train(loop.train, counter, records))
  with open(os.path.join(cell_dir, 'runs_timing.jsonl'), 'a') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  with open(os.path.join(cell_dir, 'cell_timing.jsonl'), 'a') as f:  # SFT and reports too
    f.write(json.dumps(dict(wall_s=time.perf_counter() - wall0, cpu_s=time.process_time() - cpu0,
                            runs=len(records), time=time.time())) + '\n')
  print(format_timing(name, timing_stats(records)), flush=True)
  return summary


# ----------------------------------------------------------------------------- statistics


def paired_values(summary: dict, method: str, ref: str, key: str):
  """(a, b, seeds): the method's and its baseline's `key` on their shared seeds, finite: as
  the comparison paired them (at matched tokens: the pair's own budget), else (a summary
  from before `values` were kept, two methods: the same budget) from the runs."""
  e = summary.get('paired', {}).get('by_method', {}).get(method, {})
  v = e.get('values', {}).get(key) if e.get('baseline') == ref else None
  if v is not None:
    return np.asarray(v['method'], float), np.asarray(v['baseline'], float), list(v['seeds'])
  base = {r['seed']: r.get(key, float('nan')) for r in summary['methods'][ref]}
  rows = [(r.get(key, float('nan')), base[r['seed']], r['seed'])
          for r in summary['methods'][method] if r['seed'] in base]
  rows = [p for p in rows if math.isfinite(p[0]) and math.isfinite(p[1])]
  a, b = (np.asarray([p[i] for p in rows], float) for i in (0, 1))
  return a, b, [p[2] for p in rows]


def t_pvalue(d) -> float:
  """Two-sided paired t p-value of mean(d) = 0; nan for n < 2 (0 or 1 for sd = 0)."""
  d = np.asarray(d, float)
  if d.size < 2:
    return float('nan')
  sd = float(d.std(ddof=1))
  if sd == 0:
    return 1.0 if d.mean() == 0 else 0.0
  t = abs(float(d.mean())) / (sd / math.sqrt(d.size))
  return 2.0 * (1.0 - stats.t_cdf(t, d.size - 1))


def seeds_for(sd: float, half_width: float, level: float = 0.95, cap: int = 1000):
  """The fewest pairs whose t interval has half-width <= half_width at this sd (None past cap)."""
  if not math.isfinite(sd):
    return None
  for n in range(2, cap + 1):
    if stats.t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n) <= half_width:
      return n
  return None


def effect(a, b, r) -> dict:
  """Paired Δ = a - b: mean, t interval, sd, p, MDE and seeds for ±target (issue 42)."""
  d = np.asarray(a, float) - np.asarray(b, float)
  if d.size == 0:
    return dict(n=0)
  ci = stats.paired_difference(a, b, level=r.level)
  sd = float(d.std(ddof=1)) if d.size > 1 else float('nan')
  mde = (stats.min_detectable_effect(sd, int(d.size), r.alpha, r.power) if d.size > 1
         else float('nan'))
  return dict(n=int(d.size), mean=ci['mean'], lo=ci['lo'], hi=ci['hi'], sd=sd, mde=mde,
              p=t_pvalue(d), half_width=(ci['hi'] - ci['lo']) / 2,
              seeds_for_target=seeds_for(sd, r.target_half_width, r.level))


def cell_rows(summary: dict, baseline: str, r) -> list:
  """One row per method of a cell: its mean accuracies and, but for its own baseline, its
  paired effects against `compare.baseline_for` at matched tokens and matched rollouts."""
  methods = list(summary['methods'])
  rows = []
  for m in methods:
    runs = summary['methods'][m]
    row = dict(method=m, baseline=compare.baseline_for(m, methods, baseline),
               group_size=runs[0].get('group_size'), seeds=[x['seed'] for x in runs],
               acc={k: float(np.nanmean([x.get(k, np.nan) for x in runs])) for k, _ in KEYS},
               per_seed={k: [x.get(k, float('nan')) for x in runs] for k, _ in KEYS})
    row['budget_tokens'] = summary['matched_tokens'].get('budget_generated_tokens')
    for key, short in KEYS:
      if row['baseline'] is not None:
        a, b, _ = paired_values(summary, m, row['baseline'], key)
        row[short] = effect(a, b, r)
    pair = summary.get('paired', {}).get('by_method', {}).get(m, {})
    if row['baseline'] is not None and 'budget_generated_tokens' in pair:
      # read at the pair's own budget (compare.paired_stats)
      row['budget_tokens'] = pair['budget_generated_tokens']
      row['acc']['acc_at_budget'] = float(np.mean(pair['values']['acc_at_budget']['method']))
    rows.append(row)
  return rows


def holm(pvalues) -> list:
  """Holm-Bonferroni adjusted p-values (nan kept as nan, not counted)."""
  p = np.asarray(pvalues, float)
  ok = np.flatnonzero(np.isfinite(p))
  out = np.full(p.shape, np.nan)
  order = ok[np.argsort(p[ok])]
  running = 0.0
  for i, j in enumerate(order):
    running = max(running, min(1.0, (len(order) - i) * p[j]))
    out[j] = running
  return out.tolist()


def timing_stats(records: list) -> dict:
  """Throughput of the runs trained (not skipped): seeds per CPU-minute and compiles per run,
  for each method's first run in its process (cold: compiles its programs) and the others."""
  done, seen = [], set()
  for x in records:  # a method's first trained run in each cell process (index 0 starts one)
    seen = set() if x['index_in_process'] == 0 else seen
    if not x.get('skipped'):
      done.append(dict(x, first_of_method=x['method'] not in seen))
      seen.add(x['method'])
  out = dict(runs=len(done), skipped=len(records) - len(done),
             cpu_hours=sum(x['cpu_s'] for x in done) / 3600,
             wall_hours=sum(x['wall_s'] for x in done) / 3600)
  for label, group in (('first', [x for x in done if x['first_of_method']]),
                       ('later', [x for x in done if not x['first_of_method']])):
    cpu, wall = sum(x['cpu_s'] for x in group), sum(x['wall_s'] for x in group)
    out[label] = dict(
        runs=len(group), wall_s=wall / len(group) if group else float('nan'),
        seeds_per_cpu_min=60 * len(group) / cpu if cpu else float('nan'),
        seeds_per_wall_min=60 * len(group) / wall if wall else float('nan'),
        compiles=float(np.mean([x['compiles'] for x in group])) if group else float('nan'),
        cache_hits=float(np.mean([x['cache_hits'] for x in group])) if group else float('nan'))
  later = collections.Counter()
  for x in done:
    if not x['first_of_method']:
      later.update(x['programs'])
  out['recompiled_later'] = dict(later.most_common(12))  # programs compiled again per seed
  return out


def format_timing(name: str, t: dict) -> str:
  f, l = t['first'], t['later']
  return (f'{name}: {t["runs"]} runs trained ({t["skipped"]} finished before), '
          f'{t["cpu_hours"]:.3f} CPU-h; first run of a method: {f["wall_s"]:.1f} s, '
          f'{f["compiles"]:.1f} compiles, {f["seeds_per_cpu_min"]:.2f} seeds/CPU-min; later '
          f'seeds: {l["wall_s"]:.1f} s, {l["compiles"]:.1f} compiles, '
          f'{l["seeds_per_cpu_min"]:.2f} seeds/CPU-min'
          + (f'; compiled again after the first: {t["recompiled_later"]}'
             if t['recompiled_later'] else ''))


# ----------------------------------------------------------------------------- accuracy vs learning


def credit_name(method: str) -> str:
  return loop.parse_methods(method)[0][0]


def load_quality(path: str, env: str | None = None) -> dict:
  """{estimator: {G: corr}} from a stored credit_quality (or, with env, agent_credit_quality)
  JSON; {} if the file is missing."""
  path = path if os.path.isabs(path) else os.path.join(REPO, path)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    summary = json.load(f)['summary']
  summary = summary[env] if env is not None else summary
  return {name: {int(g): (m['corr'][0] if m['corr'][0] is not None else float('nan'))
                 for g, m in by_g.items()} for name, by_g in summary.items()}


def quality_points(cells: dict, quality: dict) -> tuple:
  """(points, left out): a point per (cell, method) whose estimator has a correlation at the
  cell's G and whose baseline is GRPO on its own sampler (Δ a credit effect, not a sampler
  effect), plus GRPO itself at Δ = 0 (the reference every Δ is taken against)."""
  points, left = [], set()
  for name, rows in cells.items():
    for row in rows:
      est, g = credit_name(row['method']), row['group_size']
      corr = quality.get(est, {}).get(g, float('nan'))
      same = row['baseline'] is not None and row['baseline'].split(':')[1:] == \
          row['method'].split(':')[1:]
      if row['baseline'] is None and est == 'grpo' and math.isfinite(corr):
        points.append(dict(cell=name, method=row['method'], estimator=est, group_size=g,
                           corr=corr, delta=0.0, lo=0.0, hi=0.0, reference=True))
      elif same and math.isfinite(corr) and row['tokens'].get('n', 0) >= 1:
        e = row['tokens']
        points.append(dict(cell=name, method=row['method'], estimator=est, group_size=g,
                           corr=corr, delta=e['mean'], lo=e['lo'], hi=e['hi'], reference=False))
      elif est != 'grpo':
        left.add(row['method'])
  return points, sorted(left)


def rank_analysis(points: list, r) -> dict | None:
  """Spearman's ρ of corr against Δ over the points, bootstrap interval over points; None
  below 3 points (2 points give ±1 whatever they are)."""
  if len(points) < 3:
    return None
  x, y = [p['corr'] for p in points], [p['delta'] for p in points]
  return stats.spearman_interval(x, y, level=r.level, num_boot=r.num_boot, seed=r.boot_seed)


# ----------------------------------------------------------------------------- the report


def load_cells(c, workdir: str) -> dict:
  """{cell: summary} of the selected cells that have a summary.json, in grid order."""
  out = {}
  for name in sens.selected_cells(c):
    path = os.path.join(workdir, name, 'summary.json')
    if os.path.exists(path):
      with open(path) as f:
        out[name] = json.load(f)
  return out


def load_timing(workdir: str, name: str, file: str = 'runs_timing.jsonl') -> list:
  path = os.path.join(workdir, name, file)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def main_job_power(paths, r) -> list:
  """TEMPO - GRPO on each stored main-job summary: Δ, MDE, and the seeds whose interval
  would be ±0.015 (the issue's 'decided' rule) at the observed sd."""
  out = []
  for path in paths:
    full = path if os.path.isabs(path) else os.path.join(REPO, path)
    if not os.path.exists(full):
      continue
    with open(full) as f:
      s = json.load(f)
    if not {'grpo:iid', 'tempo:iid'} <= set(s['methods']):
      continue
    row = dict(path=path, total_wall_s=s.get('total_wall_s'))
    for key, short in KEYS:
      a, b, _ = paired_values(s, 'tempo:iid', 'grpo:iid', key)
      row[short] = effect(a, b, r)
      row[short]['seeds_for_0.015'] = seeds_for(row[short].get('sd', float('nan')), DECIDED,
                                                r.level)
    out.append(row)
  return out


def build_report(c, workdir: str) -> dict:
  """Everything on the page, computed from the cells' summaries and the stored files."""
  r = c.report
  summaries = load_cells(c, workdir)
  cells = {n: cell_rows(s, c.baseline, r) for n, s in summaries.items()}
  flat = [(n, row) for n, rows in cells.items() for row in rows if 'tokens' in row]
  for key in ('tokens', 'final'):
    adj = holm([row[key].get('p', float('nan')) for _, row in flat])
    for (_, row), p in zip(flat, adj):
      row[key]['p_holm'] = p
  scratch = {n: rows for n, rows in cells.items() if n.startswith('scratch_add_')}
  agent = {n: rows for n, rows in cells.items() if not n.startswith('scratch_add_')}
  token_pts, token_left = quality_points(scratch, load_quality(r.credit_quality))
  agent_pts, agent_left = quality_points(
      agent, load_quality(r.agent_credit_quality, r.agent_quality_env))
  info = {n: dict(sens.parse_cell(n), start_acc=s['sft'].get('greedy_acc'),
                  partial=s.get('partial'), budget_tokens=s['matched_tokens'].get(
                      'budget_generated_tokens'), rollouts_per_run=s.get('rollouts_per_run'),
                  timing=timing_stats(load_timing(workdir, n)), cell_cpu_hours=sum(
                      x['cpu_s'] for x in load_timing(workdir, n, 'cell_timing.jsonl')) / 3600)
          for n, s in summaries.items()}
  return dict(
      issue=42, workdir=workdir, cells=cells, info=info, settings=r.to_dict(),
      mde_formula=MDE_NOTE.format(alpha=r.alpha, power=r.power),
      main_job=main_job_power(r.main_job, r),
      accuracy=dict(token=dict(points=token_pts, left_out=token_left,
                               rho=rank_analysis(token_pts, r), source=r.credit_quality),
                    agent=dict(points=agent_pts, left_out=agent_left,
                               rho=rank_analysis(agent_pts, r), source=r.agent_credit_quality,
                               env=r.agent_quality_env)))


def _ci(e, digits: int = 3) -> str:
  if not e or e.get('n', 0) == 0:
    return '–'
  if not math.isfinite(e.get('lo', float('nan'))):
    return f'{e["mean"]:+.{digits}f} [n = 1]'
  return f'{e["mean"]:+.{digits}f} [{e["lo"]:+.{digits}f}, {e["hi"]:+.{digits}f}]'


def _num(x, fmt='.3f') -> str:
  return '–' if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def cell_table(rows: list, target: float) -> list:
  """Markdown lines: one row per method of a cell."""
  lines = ['| method | baseline | n | matched tokens | acc at matched tokens | '
           'Δ at matched tokens [95 %] | p (Holm) | MDE (tokens) | '
           f'Δ at matched rollouts (final) [95 %] | p (Holm) | MDE (final) | seeds for ±{target:g} |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for row in rows:
    t, f = row.get('tokens', {}), row.get('final', {})
    need = t.get('seeds_for_target')
    need = '–' if not t else ('≤ n' if need is not None and need <= t['n'] else _num(need, 'd'))
    lines.append(
        f'| `{row["method"]}` | {"`" + row["baseline"] + "`" if row["baseline"] else "(baseline)"} '
        f'| {t.get("n", len(row["seeds"]))} | '
        f'{_num((row.get("budget_tokens") or float("nan")) / 1e3, ".1f")}k | '
        f'{_num(row["acc"]["acc_at_budget"])} | {_ci(t)} | '
        f'{_num(t.get("p_holm"))} | {_num(t.get("mde"))} | {_ci(f)} | {_num(f.get("p_holm"))} | '
        f'{_num(f.get("mde"))} | {need} |')
  return lines


def cell_header(name: str, info: dict) -> str:
  part = info.get('partial')
  rollouts = sorted(set((info.get('rollouts_per_run') or {}).values()))
  horizon = f'{info["digits"]} digits, ' if info['digits'] else ''
  return (f'### `{name}`\n\n`{info["task"]}`, {horizon}G = {info["group_size"]}; SFT start: '
          f'greedy {_num(info["start_acc"])}; rollouts per run {rollouts}; every run reached '
          f'{_num((info["budget_tokens"] or float("nan")) / 1e3, ".1f")}k generated tokens '
          f'(a pair is read at the most both of its methods reached)'
          + (f'; **partial: {part["runs_done"]} of {part["runs_total"]} runs**' if part else '')
          + '.\n')


def timing_table(info: dict) -> list:
  lines = ['| cell | runs trained | CPU-h | first run of a method: s, compiles, seeds/CPU-min | '
           'later seeds: s, compiles, seeds/CPU-min | programs compiled again after the first |',
           '|---|---|---|---|---|---|']
  for name, i in info.items():
    t = i['timing']
    if not t['runs']:
      lines.append(f'| `{name}` | 0 | – | – | – | – |')
      continue
    cols = [f'{_num(t[k]["wall_s"], ".1f")} s, {_num(t[k]["compiles"], ".1f")}, '
            f'{_num(t[k]["seeds_per_cpu_min"], ".2f")}' for k in ('first', 'later')]
    again = ', '.join(f'`{k}` ×{v}' for k, v in t['recompiled_later'].items()) or 'none'
    lines.append(f'| `{name}` | {t["runs"]} | {t["cpu_hours"]:.3f} | {cols[0]} | {cols[1]} | '
                 f'{again} |')
  return lines


def established(rep: dict) -> str:
  """The plain-language paragraph, generated from the numbers (issue 42)."""
  r = rep['settings']
  comps = [(n, row) for n, rows in rep['cells'].items() for row in rows
           if row.get('tokens', {}).get('n', 0) >= 2]
  if not comps:
    return 'Nothing is established yet: no cell has a method with two or more paired seeds.'
  sep = [(n, row) for n, row in comps if row['tokens']['lo'] > 0 or row['tokens']['hi'] < 0]
  k = len(rep['cells'])
  out = [f'{len(comps)} comparisons with GRPO at matched generated tokens in {k} '
         f'cell{"s" if k != 1 else ""}; at α = {r["alpha"]} about '
         f'{len(comps) * r["alpha"]:.1f} of them would exclude 0 by chance alone if no method '
         'differed from GRPO.']
  if sep:
    out.append('Intervals that exclude 0: ' + '; '.join(
        f'`{row["method"]}` in `{n}` {_ci(row["tokens"])} (Holm p {_num(row["tokens"]["p_holm"])})'
        for n, row in sep) + '.')
    held = [x for x in sep if x[1]['tokens']['p_holm'] < r['alpha']]
    out.append(f'{len(held)} of them survive Holm\'s correction over all {len(comps)} comparisons.')
  else:
    out.append('No interval excludes 0: no method is established to differ from GRPO here.')
  rest = [row['tokens'] for n, row in comps if (n, row) not in sep]
  if rest:
    mde = [e['mde'] for e in rest]
    out.append(f'For the {len(rest)} that do not separate, the minimum detectable effect at '
               f'{100 * r["power"]:.0f} % power is {min(mde):.3f} to {max(mde):.3f} (median '
               f'{float(np.median(mde)):.3f}): effects of that size would have been detected with '
               f'{100 * r["power"]:.0f} % probability, and their intervals exclude effects beyond '
               f'±{max(max(abs(e["lo"]), abs(e["hi"])) for e in rest):.3f}.')
  wide = [(n, row) for n, row in comps if row['tokens']['half_width'] > r['target_half_width']]
  if wide:
    out.append(f'{len(wide)} intervals are wider than ±{r["target_half_width"]:g}; the seeds that '
               'would narrow each to that at its observed sd are in the tables.')
  agree = sum((row['final'].get('lo', 0) > 0 or row['final'].get('hi', 0) < 0) ==
              ((n, row) in sep) for n, row in comps)
  out.append(f'At matched rollouts (final accuracy) {agree} of {len(comps)} comparisons reach the '
             'same verdict.')
  out += main_job_verdict(rep)
  for kind, label in (('token', 'token-level'), ('agent', 'step-level (agents)')):
    rho = rep['accuracy'][kind]['rho']
    if rho is not None and not math.isfinite(rho['rho']):
      out.append(f'Credit accuracy against learning, {label}: ρ is undefined over its '
                 f'{rho["n"]} points (every Δ, or every correlation, is the same).')
    elif rho is not None:
      verdict = ('excludes 0' if rho['lo'] > 0 or rho['hi'] < 0 else 'includes 0')
      out.append(f'Credit accuracy against learning, {label}: Spearman ρ = {rho["rho"]:+.2f} '
                 f'[{rho["lo"]:+.2f}, {rho["hi"]:+.2f}] over {rho["n"]} points; the interval '
                 f'{verdict}.')
  return ' '.join(out)


def main_job_verdict(rep: dict) -> list:
  """Whether the main job's cell decides TEMPO vs GRPO by the issue's rule: an interval that
  excludes 0, or one narrower than ±DECIDED (issue 42, item 3)."""
  row = next((x for x in rep['cells'].get(MAIN_JOB_CELL, []) if x['method'] == 'tempo:iid'
              and x['baseline'] == 'grpo:iid'), None)
  if row is None:
    return []
  out = []
  for key, what in (('final', 'final accuracy'), ('tokens', 'accuracy at matched tokens')):
    e = row[key]
    if e.get('n', 0) < 2:
      continue
    decided = e['lo'] > 0 or e['hi'] < 0 or e['half_width'] < DECIDED
    out.append(f'The main job (`{MAIN_JOB_CELL}`, `tempo:iid` − `grpo:iid`, {e["n"]} seeds), '
               f'{what}: {_ci(e)}, {"decided" if decided else "not decided"} by the rule of an '
               f'interval that excludes 0 or is narrower than ±{DECIDED:g}.')
  return out


def accuracy_section(rep: dict) -> list:
  lines = []
  for kind, title in (('token', 'Token-level estimators (scratch_add cells)'),
                      ('agent', 'Step-level estimators (agent cells)')):
    a = rep['accuracy'][kind]
    src = f'`{a["source"]}`' + (f', environment `{a["env"]}`' if kind == 'agent' else '')
    lines += [f'### {title}', '', f'Correlation with the exact advantages at the cell\'s G from '
              f'{src}; Δ at matched generated tokens against GRPO on the method\'s own sampler '
              '(GRPO itself at Δ = 0, the reference). Left out (no correlation row, or Δ against '
              f'another sampler): {", ".join(f"`{m}`" for m in a["left_out"]) or "none"}.', '']
    if a['points']:
      lines += ['| cell | method | corr with A* | Δ at matched tokens [95 %] |', '|---|---|---|---|']
      lines += [f'| `{p["cell"]}` | `{p["method"]}` | {p["corr"]:.3f} | '
                f'{"0 (reference)" if p["reference"] else _ci(dict(n=2, **p, mean=p["delta"]))} |'
                for p in a['points']]
    rho = a['rho']
    lines += ['', (f'Spearman ρ = {rho["rho"]:+.3f}, {100 * rho["level"]:.0f} % bootstrap '
                   f'interval [{rho["lo"]:+.3f}, {rho["hi"]:+.3f}] ({rho["num_boot"]} resamples '
                   f'of the {rho["n"]} points, {rho["valid"]} with a defined ρ; points from one '
                   'estimator in several cells are not independent).')
              if rho and math.isfinite(rho['rho']) else
              'ρ undefined: every Δ, or every correlation, is the same.' if rho else
              'Fewer than 3 points: no ρ.', '']
  return lines


def main_job_section(rep: dict) -> list:
  lines = ['## Power of the stored main job (TEMPO − GRPO, `python -m experiments.tempo`)', '',
           '| summary | n | Δ at matched tokens [95 %] | MDE | seeds for ±0.015 | Δ final [95 %] '
           '| MDE | seeds for ±0.015 |', '|---|---|---|---|---|---|---|---|']
  for row in rep['main_job']:
    t, f = row['tokens'], row['final']
    lines.append(f'| `{row["path"]}` | {t["n"]} | {_ci(t)} | {_num(t["mde"])} | '
                 f'{_num(t["seeds_for_0.015"], "d")} | {_ci(f)} | {_num(f["mde"])} | '
                 f'{_num(f["seeds_for_0.015"], "d")} |')
  return lines + ['', 'Seeds for ±0.015: the fewest seeds whose paired t interval is that narrow '
                  'at the observed sd of the differences (the issue\'s rule for a decided main '
                  'job: an interval that excludes 0, or one narrower than ±0.015). With 3 seeds '
                  'that sd is itself uncertain (its 95 % interval spans a factor of about 6), so '
                  'read these as a floor and plan more; the d3 G = 8 cell of the sweep is the '
                  'main job\'s comparison at the study\'s seeds.', '']


def render(rep: dict, figures: dict) -> str:
  """The results page (markdown) of a report dict."""
  r = rep['settings']
  lines = ['<!-- Generated by `python -m experiments.sensitivity --report` from the cells\' '
           'summary.json; do not edit by hand. -->', '',
           '# Where finer credit pays: credit accuracy against learning (issue 42)', '',
           'Each cell trains every method from one SFT warm start per (task, horizon) at the main '
           'job\'s budget and compares it with GRPO on its own sampler, paired over seeds. Primary '
           'endpoint: greedy accuracy at matched generated tokens; secondary: at matched rollouts '
           f'(final accuracy). Intervals: paired t, {100 * r["level"]:.0f} %. p (Holm): two-sided '
           'paired t p-values, Holm-adjusted over all the comparisons on this page. '
           f'{rep["mde_formula"]}.', '', '## What is established', '', established(rep), '',
           '## The sweep', '']
  for name, rows in rep['cells'].items():
    lines += [cell_header(name, rep['info'][name])] + cell_table(rows, r['target_half_width']) + ['']
  for key, caption in (('horizon', 'Δ against horizon'), ('scatter', 'Credit accuracy against Δ')):
    if figures.get(key):
      lines += [f'![{caption}]({os.path.basename(figures[key])})', '']
  lines += ['## Accuracy against learning', ''] + accuracy_section(rep)
  if rep['main_job']:
    lines += main_job_section(rep)
  lines += ['## Throughput: seeds back to back in one process', '',
            'Per run: wall and process CPU seconds, and the programs built during it '
            '(jax.monitoring backend-compile events: misses of jit\'s in-memory cache, each an '
            'XLA compile or a persistent-cache fetch). "First run of a method" builds its '
            'programs, as a fresh process per seed would; later seeds should reuse them.', '']
  total = sum(i['cell_cpu_hours'] for i in rep['info'].values())
  lines += timing_table(rep['info']) + ['', f'CPU time of the cells\' processes in all (SFT, '
                                        f'training, evaluation, summaries): {total:.2f} CPU-hours.',
                                        '']
  return '\n'.join(lines)


def _panels(rep: dict) -> list:
  """[(title, [(x label, cell)])]: one panel per scratch_add G (x = horizon) and per agent G."""
  panels = collections.defaultdict(list)
  for name in rep['cells']:
    i = rep['info'][name]
    key = (i['task'] == 'scratch_add', i['group_size'])
    panels[key].append((str(i['digits']) if i['digits'] else i['task'], name))
  return [(f'scratch_add, G = {g}' if scratch else f'agents, G = {g}', cells)
          for (scratch, g), cells in sorted(panels.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


def plot_horizon(rep: dict, path: str) -> str | None:
  """Δ (matched tokens; matched rollouts below) against horizon, one line per method, 95 %
  intervals as error bars; one column per G (and per agent G, x = task)."""
  panels = _panels(rep)
  if not panels:
    return None
  fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7.5), squeeze=False)
  for col, (title, cells) in enumerate(panels):
    methods = [row['method'] for n in (c for _, c in cells) for row in rep['cells'][n]
               if 'tokens' in row]
    methods = list(dict.fromkeys(methods))
    for k, m in enumerate(methods):
      for ax, key in zip(axes[:, col], ('tokens', 'final')):
        xs, ys, err = [], [], [[], []]
        for j, (_, n) in enumerate(cells):
          e = next((row.get(key) for row in rep['cells'][n] if row['method'] == m), None)
          if e and e.get('n', 0) and math.isfinite(e['mean']):
            lo, hi = (e['lo'], e['hi']) if math.isfinite(e['lo']) else (e['mean'], e['mean'])
            xs.append(j + 0.06 * (k - len(methods) / 2))
            ys.append(e['mean'])
            err[0].append(e['mean'] - lo)
            err[1].append(hi - e['mean'])
        if xs:
          ax.errorbar(xs, ys, yerr=err, marker='o', markersize=4, capsize=3, label=m)
    for ax, key in zip(axes[:, col], ('matched generated tokens', 'matched rollouts (final)')):
      ax.axhline(0, color='k', linewidth=0.8)
      ax.set_xticks(range(len(cells)), [x for x, _ in cells])
      ax.set_xlabel('num_digits (horizon)' if title.startswith('scratch') else 'task')
      ax.set_ylabel(f'Δ vs GRPO, {key}')
      ax.set_title(title, fontsize=9)
      ax.grid(alpha=0.3)
    if axes[0, col].get_legend_handles_labels()[0]:
      axes[0, col].legend(fontsize=7)
  return cq.save_figure(fig, path, 'Δ vs GRPO on its own sampler, paired 95 % t intervals')


def plot_scatter(rep: dict, path: str) -> str | None:
  """Credit accuracy (corr with A*) against Δ at matched tokens, token- and step-level."""
  kinds = [k for k in ('token', 'agent') if rep['accuracy'][k]['points']]
  if not kinds:
    return None
  fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
  for ax, kind in zip(axes[0], kinds):
    a = rep['accuracy'][kind]
    ests = list(dict.fromkeys(p['estimator'] for p in a['points']))
    for p in a['points']:
      color = plt.get_cmap('tab10').colors[ests.index(p['estimator']) % 10]
      lo, hi = (p['lo'], p['hi']) if math.isfinite(p['lo']) else (p['delta'], p['delta'])
      ax.errorbar([p['corr']], [p['delta']], yerr=[[p['delta'] - lo], [hi - p['delta']]],
                  marker='s' if p['group_size'] == 4 else 'o', color=color, capsize=2,
                  mfc='none' if p['reference'] else color, linestyle='none')
    for i, e in enumerate(ests):
      ax.plot([], [], 'o', color=plt.get_cmap('tab10').colors[i % 10], label=e)
    rho = a['rho']
    ax.set_title(f'{kind}-level' + (f': ρ = {rho["rho"]:+.2f} [{rho["lo"]:+.2f}, '
                                     f'{rho["hi"]:+.2f}], {rho["n"]} points' if rho else ''),
                 fontsize=9)
    ax.axhline(0, color='k', linewidth=0.8)
    ax.set_xlabel('corr(a, A*) at the cell\'s G (square G = 4, circle otherwise)')
    ax.set_ylabel('Δ vs GRPO at matched tokens')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return cq.save_figure(fig, path, 'credit accuracy against learning (hollow: GRPO, the reference)')


def write_report(c, workdir: str) -> dict:
  """Builds the report, writes <out>/<name>.md, .json and the PNGs; returns the report."""
  out = c.report.out if os.path.isabs(c.report.out) else os.path.join(REPO, c.report.out)
  os.makedirs(out, exist_ok=True)
  base = os.path.join(out, c.report.name)
  rep = build_report(c, workdir)
  figures = dict(horizon=plot_horizon(rep, base + '_delta_vs_horizon.png'),
                 scatter=plot_scatter(rep, base + '_accuracy_vs_learning.png'))
  rep['figures'] = {k: v and os.path.basename(v) for k, v in figures.items()}
  with open(base + '.md', 'w') as f:
    f.write(render(rep, figures))
  with open(base + '.json', 'w') as f:
    json.dump(cq._jsonable(rep), f, indent=1)
  print(f'wrote {base}.md, {base}.json and {len([x for x in figures.values() if x])} figures')
  return rep


# ----------------------------------------------------------------------------- entry point


def run_cells(c, workdir: str, explicit=()) -> dict:
  """Every selected cell in grid order (each checked before any trains); {cell: summary}."""
  sens.check(c)
  names = sens.selected_cells(c)
  for name in names:  # every cell's comparison checks, before the first warm start
    cfg = sens.cell_config(c, name)
    loop.check_config(cfg)
    compare.check_comparison(cfg)
  return {name: run_cell(c, name, workdir, explicit) for name in names}


def main(argv=None):
  config = config_flags.DEFINE_config_file(
      'config', os.path.join(REPO, 'configs', 'sensitivity.py'), 'The sweep (ml_collections).')
  workdir = flags.DEFINE_string('workdir', '/tmp/treecredit/sensitivity', 'Output directory.')
  report = flags.DEFINE_bool('report', False, 'Write the results page from the summaries.')

  def run(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    c = config.value
    if report.value:
      sens.check(c)
      write_report(c, workdir.value)
      return
    # --config.quick=True shrinks each cell but keeps the study's methods (configs.tempo's
    # shrink would replace a list equal to its own default) and seeds given on the command line.
    overrides = config_flags.get_override_values(flags.FLAGS['config'])
    run_cells(c, workdir.value, explicit=('methods',) + (('seeds',) if 'seeds' in overrides else ()))

  app.run(run, argv)


if __name__ == '__main__':
  main()
