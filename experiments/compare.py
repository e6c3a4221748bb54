"""The shared comparison script behind every per-paper script in experiments/.

    python -m experiments.<paper> [--config=configs/<paper>.py] [--workdir=/tmp/treecredit/<paper>]
        [--config.quick=True] [--config.rl.steps=100] [--config.methods=grpo:iid,tempo:iid]

One SFT warm start, then every "credit:sampler" method in `config.methods` x
every seed in `config.seeds`, on the same task and rollout budget, through the
shared loop (`experiments/loop.py`). Layout of the workdir: sft/,
<credit>_<sampler>/seed<k>/{metrics.jsonl, checkpoints/}, curves_vs_step.png,
curves_vs_wall.png, summary.json. Rerunning with the same workdir resumes or
skips finished runs. `--config.quick=True` shrinks everything to a smoke run
(`configs.tempo.shrink`, applied after the other overrides).
"""

import json
import os
import sys
import time

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from configs import lm as lm_config
from configs import tempo as tempo_config
from experiments import loop, plots
from experiments import train_step as ts

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


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


def run_experiment(cfg, workdir: str) -> dict:
  """SFT once, then every method x seed; writes plots + summary.json; returns the summary."""
  if cfg.quick:
    (lm_config if loop.is_text(cfg) else tempo_config).shrink(cfg)
  loop.check_config(cfg)
  methods = [f'{c}:{s}' for c, s in loop.parse_methods(cfg.methods)]
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  if loop.is_text(cfg):  # a pretrained (instruct) model is the starting point
    params0, sft_info = loop.pretrained_start(cfg)
  else:
    params0, sft_info = loop.sft(cfg, os.path.join(workdir, 'sft'))
  print(f'{"Start" if loop.is_text(cfg) else "SFT warm start"}: greedy acc {sft_info["greedy_acc"]:.3f}, '
        f'pass@{cfg.eval.pass_k} {sft_info[f"pass@{cfg.eval.pass_k}"]:.3f} '
        f'({sft_info["wall_s"]:.1f} s)', flush=True)
  results, rows = {}, {}
  for method in methods:
    g = loop.group_size(loop.with_method(cfg, method).sampler)
    for seed in cfg.seeds:
      d = os.path.join(workdir, method.replace(':', '_'), f'seed{seed}')
      s = loop.train(cfg, d, params0, method=method, seed=seed)
      s.pop('params', None)
      s['group_size'] = g
      results.setdefault(method, []).append(s)
      rows.setdefault(method, []).append(loop.read_metrics(os.path.join(d, 'metrics.jsonl')))
      print(f'  {method:>20s} seed {seed}: final acc {s["final_acc"]:.3f} '
            f'(peak {s["peak_acc"]:.3f}), {s["wall_s"]:.1f} s', flush=True)
  paths = plots.plot_runs(rows, workdir, title=(
      f'{cfg.task.name} {dict(cfg.task.kwargs)}: {cfg.rl.steps} steps x '
      f'{cfg.rl.prompts_per_step} prompts, seeds {tuple(cfg.seeds)}'))
  summary = dict(sft=sft_info, methods=results, total_wall_s=time.time() - t0, plots=paths,
                 task=cfg.task.name, rollouts_per_run={m: cfg.rl.steps * cfg.rl.prompts_per_step *
                                                   results[m][0]['group_size'] for m in results})
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1)
  print(format_table(summary, cfg.eval.pass_k))
  return summary


def format_table(summary, pass_k) -> str:
  ms = lambda xs: f'{np.mean(xs):.3f}±{np.std(xs):.3f}'
  head = (f'{"method":>26} {"G":>3} {"rollouts":>8} {"final acc":>12} {"peak acc":>12} '
          f'{"pass@" + str(pass_k):>12} {"reward":>12} {"wall s":>8} {"samp tok/s":>10} '
          f'{"train tok/s":>11} {"credit %":>8}')
  lines = [head, '-' * len(head)]
  for m, runs in summary['methods'].items():
    get = lambda k: [r[k] for r in runs]
    lines.append(
        f'{m:>26} {runs[0]["group_size"]:>3} {summary["rollouts_per_run"][m]:>8} '
        f'{ms(get("final_acc")):>12} {ms(get("peak_acc")):>12} {ms(get("final_pass")):>12} '
        f'{ms(get("final_reward")):>12} {np.mean(get("wall_s")):>8.1f} '
        f'{np.mean(get("sampled_tokens_per_s")):>10.0f} {np.mean(get("train_tokens_per_s")):>11.0f} '
        f'{100 * np.mean(get("credit_frac")):>8.2f}')
  sft = summary['sft']
  lines.append(f'(mean±std over {len(next(iter(summary["methods"].values())))} seeds; '
               f'{"start" if "source" in sft else "SFT start"}: acc {sft["greedy_acc"]:.3f}; total {summary["total_wall_s"]:.0f} s)')
  return '\n'.join(lines)


def main(name: str):
  """Entry point of `experiments/<name>.py`: --config defaults to configs/<name>.py."""
  reference = lambda: (lm_config if name == 'lm' else tempo_config).get_config()
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
    run_experiment(config.value, workdir.value)

  try:
    app.run(run)
  except KeyError as e:  # an unknown --config.<field>, if ml_collections reports it only here
    message = unknown_override(sys.argv[1:], reference())
    if message is None:
      raise
    raise SystemExit(message) from e
