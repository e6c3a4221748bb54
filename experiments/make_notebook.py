"""Writes experiments/trees_notebook.ipynb (outputs cleared): `python experiments/make_notebook.py`.

The notebook samples one group from an SFT-warm-started toy policy on `scratch_add`,
builds its prefix tree, shows it (text, Graphviz, treescope) and plots GRPO's and
TEMPO's per-token credit on it. Edit the cells here, rerun this script and commit both;
tests/test_notebook.py executes the notebook (with QUICK = True) and checks that the
committed file is what this script writes.
"""

import os
import sys

import nbformat
from nbformat import v4

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trees_notebook.ipynb")


def md(text):
  return v4.new_markdown_cell(text.strip("\n"))


def code(text, tag=None):
  cell = v4.new_code_cell(text.strip("\n"))
  if tag:
    cell.metadata["tags"] = [tag]
  return cell


CELLS = [
    md("""
# A group's prefix tree, and the credit two estimators give it

Sample a group of G = 8 responses from a warm-started toy policy on `scratch_add`
(2-digit column addition with a written scratchpad, e.g. `"47+38=" -> "7+8=15,4+3+1=08,085<eos>"`),
build its prefix tree, look at it three ways (text, Graphviz, `treescope` on the `PrefixTree`
pytree) and compare the per-token advantages of `grpo` and `tempo` on it.

`QUICK = True` (what the tests run) trains a tiny policy for a few steps, so most of its
samples are wrong; `QUICK = False` warm-starts a 0.4M-parameter policy for 1-2 minutes on
2 CPU cores (cached in `WORKDIR`, so a rerun loads it).
"""),
    code("""
QUICK = False  # True: a smoke run (tiny policy, 40 SFT steps; the tests set this)
WORKDIR = '/tmp/treecredit/trees_notebook'  # SFT checkpoints are cached here
SEED = 0  # which prompts and samples
""", tag="parameters"),
    code("""
import hashlib
import json
import os
import pathlib
import shutil
import sys

# Run from experiments/ without `pip install -e .`: put the repository root on the path.
_root = pathlib.Path.cwd().resolve()
if not (_root / 'trees').is_dir() and (_root.parent / 'trees').is_dir():
  sys.path.insert(0, str(_root.parent))

import warnings

warnings.filterwarnings('ignore', message='IProgress not found')  # tqdm.auto without ipywidgets

import jax
import matplotlib.pyplot as plt
import numpy as np
import treescope
from IPython.display import display

import credit
import trees
from configs import tempo as tempo_config
from experiments.rollouts import sampling
from experiments.training import loop
"""),
    md("""
## Supervised warm start

`loop.sft` trains the toy policy (`experiments/models/decoder.py`) on the task's
demonstrations (valid scratchpads, with randomised term order and optional zeros) and
reports greedy accuracy on held-out prompts.
"""),
    code("""
cfg = tempo_config.get_config()
cfg.task.name = 'scratch_add'
cfg.task.kwargs = {'num_digits': 2, 'num_operands': 2}
cfg.progress = False
if QUICK:
  cfg.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64)
  cfg.sft.update(steps=40, batch_size=64, lr=3e-3, warmup_steps=10)
  # pass@8 on one prompt: the same sampler shapes as the group below (one compile).
  cfg.eval.update(num_prompts=8, pass_k=8, pass_prompts=1)
else:
  cfg.model.update(d_model=128)
  cfg.sft.update(steps=300, batch_size=128, lr=1e-3, warmup_steps=50)  # ~80% greedy
  cfg.eval.update(num_prompts=256, pass_k=8, pass_prompts=64)

# One cache directory per (task, model, SFT) config, so changing them never clashes.
_key = json.dumps([cfg.task.to_dict(), cfg.model.to_dict(), cfg.sft.to_dict()], sort_keys=True)
sft_dir = os.path.join(WORKDIR, 'sft-' + hashlib.sha1(_key.encode()).hexdigest()[:10])
params, sft_info = loop.sft(cfg, sft_dir)
print(f"SFT {cfg.sft.steps} steps: loss {sft_info['loss']:.3f}, "
      f"greedy accuracy {sft_info['greedy_acc']:.3f}, pass@8 {sft_info['pass@8']:.3f}")
""", tag="sft"),
    md("""
## One group at temperature 1

Prompts are tried in turn until a group has both right and wrong responses (if every reward
is equal, every estimator's credit is 0). If none does (the QUICK policy is rarely right), the
last response of the last group is replaced by a demonstration from the task, so that the
credit below has something to show.
"""),
    code("""
task = loop.build_task(cfg)
pcfg = loop.policy_config(cfg, task)
G = 8


def detok(ids):
  return ''.join(task.vocab[int(i)] for i in ids)


sample_prompts = jax.jit(task.sample, static_argnums=1)  # jitted: compiles faster than eager
demonstrations = jax.jit(task.demonstrations)
key = jax.random.PRNGKey(SEED)
for attempt in range(4 if QUICK else 16):
  prompts, info = sample_prompts(jax.random.fold_in(key, attempt), 1)  # [1, P]
  samples = sampling.sample_iid(params, pcfg, jax.random.fold_in(key, 1000 + attempt), prompts,
                                G, task.response_len, temperature=1.0, eos_id=task.eos_id,
                                pad_id=task.pad_id)  # Samples [1, G, L]
  group_rewards = loop.group_rewards(prompts, samples.tokens, samples.mask, info, task=task)
  if 0 < float(group_rewards.mean()) < 1:
    break

tokens, mask = np.array(samples.tokens[0]), np.array(samples.mask[0])  # [G, L]
demo_note = ''
if float(group_rewards.max()) == 0:  # no right response: put a demonstration in as the last
  demo, demo_mask = demonstrations(prompts, info)  # [1, L]
  tokens[-1], mask[-1] = np.asarray(demo[0]), np.asarray(demo_mask[0])
  group_rewards = loop.group_rewards(prompts, tokens[None], mask[None], info, task=task)
  demo_note = f' (no right sample: response {G - 1} is a demonstration)'
rewards = np.asarray(group_rewards[0])  # [G]
print(f'prompt {detok(prompts[0])!r} (try {attempt + 1}), G = {G}, L = {tokens.shape[1]}'
      f'{demo_note}')
for g in range(G):
  print(f'  {g}  R={rewards[g]:.0f}  {detok(tokens[g][mask[g]])}')
""", tag="group"),
    md("""
## The prefix tree

`trees.build` turns the group into a `PrefixTree`. In the text rendering each line is an
edge (a run of tokens with no branch inside) with n(v), the number of responses through its
end node, V(v), their mean reward, and the TD step V(v) − V(parent); `*` marks a branch point.
"""),
    code("""
tree = trees.build(tokens, mask)
print(trees.render_text(tree, rewards, detokenize=detok))
""", tag="render_text"),
    md("""
### As a Graphviz picture

`trees.to_dot` gives DOT source. It is drawn with the `graphviz` Python package when
Graphviz's `dot` binary is installed (`apt-get install graphviz`, `pip install graphviz`);
otherwise the source is printed and written to a file to render elsewhere.
"""),
    code("""
dot_source = trees.to_dot(tree, rewards, detokenize=detok)
os.makedirs(WORKDIR, exist_ok=True)
dot_path = os.path.join(WORKDIR, 'tree.dot')
with open(dot_path, 'w') as f:
  f.write(dot_source)
try:
  import graphviz
except ImportError:
  graphviz = None
if graphviz is not None and shutil.which('dot'):
  display(graphviz.Source(dot_source))
else:
  print(f'No Graphviz here (the `dot` binary or the `graphviz` package is missing). '
        f'Render the source below, written to {dot_path}, with\\n'
        f'  dot -Tsvg {dot_path} -o tree.svg\\n'
        f'or paste it into any online Graphviz viewer.\\n')
  print(dot_source)
""", tag="graphviz"),
    md("""
### The `PrefixTree` pytree in `treescope`

All fields of the tree: per-token arrays `[G, L]` (`node`, `parent`, `count`, `branches`, ...)
and per-node arrays `[N]` with N = 1 + G·L slots (`node_count`, `node_parent`, ...).
Click to expand; arrays are drawn as heatmaps.
"""),
    code("""
treescope.display(tree, autovisualize=True)
""", tag="treescope"),
    md("""
## Credit: GRPO vs TEMPO

Both estimators take `credit.Rollouts(tokens, mask, rewards)` and return advantages
`[G, L]`, 0 on padding. Rows are in trie order, so responses that share a prefix are adjacent;
black bars mark branch points (`tree.branches`: some response of the group leaves the path there).
The third panel, their difference, is TEMPO's TD term.
"""),
    code("""
rollouts = credit.validate(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards))
advantages = {name: np.asarray(credit.get(name)(rollouts)) for name in ('grpo', 'tempo')}
branches = np.asarray(tree.branches)
for name, adv in advantages.items():
  print(f'{name}: advantages {adv.shape} {adv.dtype}, range [{adv.min():+.2f}, {adv.max():+.2f}]')
# TEMPO = GRPO + a TD step that is exactly 0 where nothing branches.
assert np.allclose(advantages['tempo'][~branches], advantages['grpo'][~branches], atol=1e-5)
print(trees.render_text(tree, rewards, advantages=advantages['tempo'], detokenize=detok))
""", tag="credit"),
    code("""
order = np.asarray(tree.order)  # trie order
panels = [('grpo', advantages['grpo']), ('tempo', advantages['tempo']),
          ('tempo − grpo', advantages['tempo'] - advantages['grpo'])]
lim = max(1e-3, max(float(np.abs(a).max()) for _, a in panels))
length = int(mask.sum(-1).max())
fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.42 * length), 2.2 * len(panels) + 1),
                         sharex=True, constrained_layout=True)
for ax, (title, adv) in zip(axes, panels):
  shown = np.ma.masked_where(~mask[order, :length], adv[order, :length])
  im = ax.imshow(shown, cmap='RdBu', vmin=-lim, vmax=lim, aspect='auto', interpolation='nearest')
  for row, g in enumerate(order):
    for t in np.flatnonzero(mask[g, :length]):
      ax.text(t, row, detok([tokens[g, t]]).replace('<eos>', '$'), ha='center', va='center',
              fontsize=7, family='monospace')
    at = np.flatnonzero(branches[g, :length])  # a branch point before token t
    ax.plot(at - 0.5, np.full(len(at), row), 'k|', markersize=11, markeredgewidth=1.5)
  ax.set_yticks(range(G), [f'{g} (R={rewards[g]:.0f})' for g in order], fontsize=7)
  ax.set_title(title, fontsize=9)
  ax.set_xticks(range(0, length, 2))
  fig.colorbar(im, ax=ax, shrink=0.9)
axes[-1].set_xlabel('token position ($ = end of response)')
plt.show()
""", tag="plot"),
    md("""
GRPO gives every token of a response the same advantage, (R − μ)/σ; TEMPO adds the TD
step (V(s_{t+1}) − V(s_t))/σ of the prefix tree, which is nonzero only at branch points, so
its credit changes along a response exactly where the group's responses part ways, and the
tokens of a shared prefix are credited by how the responses through it do, not by the one
response they sit in.
"""),
]


def notebook():
  nb = v4.new_notebook(cells=CELLS)
  for i, cell in enumerate(nb.cells):  # fixed ids, so the file only changes with its cells
    cell.id = f"cell-{i:02d}"
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.metadata["language_info"] = {"name": "python"}
  return nb


def text() -> str:
  """The notebook file's contents (what is committed)."""
  nb = notebook()
  nbformat.validate(nb)
  return nbformat.writes(nb) + "\n"


def main(argv=None):
  path = (argv or sys.argv[1:] or [PATH])[0]
  with open(path, "w") as f:
    f.write(text())
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
