"""PNG curves of reward and greedy accuracy vs step, vs wall-clock and vs generated tokens
(cumulative decoded tokens, forks' copied prefixes excluded), one line per method."""

import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _series(runs, x_key, y_key):
  """Mean (and std) over seeds of y, and mean x, at the steps of the runs' rows having y.

  x of the step-0 row (the starting policy) is 0 when the row lacks it; other rows lacking
  x (runs logged before the field existed) are left out.
  """
  curves = []
  for rows in runs:
    x = lambda r: r.get(x_key, 0.0 if r['step'] == 0 else None)
    pts = [(r['step'], x(r), r[y_key]) for r in rows if y_key in r and x(r) is not None]
    if pts:
      curves.append(np.asarray(pts, float))
  if not curves:
    return None
  n = min(len(c) for c in curves)
  arr = np.stack([c[:n] for c in curves])  # [seeds, n, 3]; rows align by step
  return arr[:, :, 1].mean(0), arr[:, :, 2].mean(0), arr[:, :, 2].std(0)


def plot_runs(runs_by_method: dict, workdir: str, title: str = '') -> list[str]:
  """runs_by_method: {method: [rows of seed 0, rows of seed 1, ...]} -> written PNG paths."""
  paths = []
  for x_key, fname, xlabel in (('step', 'curves_vs_step.png', 'RL step'),
                               ('wall_s', 'curves_vs_wall.png', 'wall-clock (s)'),
                               ('generated_tokens_total', 'curves_vs_generated_tokens.png',
                                'generated tokens (cumulative)')):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (y_key, ylabel) in zip(axes, (('reward', 'mean rollout reward'),
                                          ('greedy_acc', 'greedy accuracy (held-out)'))):
      for method, runs in runs_by_method.items():
        s = _series(runs, x_key, y_key)
        if s is None:
          continue
        x, y, sd = s
        (line,) = ax.plot(x, y, label=method, marker='.' if y_key == 'greedy_acc' else None)
        if len(runs) > 1:
          ax.fill_between(x, y - sd, y + sd, color=line.get_color(), alpha=0.15)
      ax.set_xlabel(xlabel)
      ax.set_ylabel(ylabel)
      ax.grid(alpha=0.3)
      if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    if title:
      fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(workdir, fname)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths
