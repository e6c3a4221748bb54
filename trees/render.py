"""Readable renderings of one group's tree, for notebooks: text and Graphviz DOT.

Host-side (numpy) and meant for small groups. Chains where nothing branches
are drawn as one edge labelled with their tokens.
"""

from typing import Callable, Optional, Sequence

import jax
import numpy as np

from trees.node_values import node_mean
from trees.prefix_tree import PrefixTree


def _one_group(tree: PrefixTree, index):
  arrays = {k: np.asarray(v)[index] for k, v in vars(tree).items()}
  if arrays["mask"].ndim != 2:
    raise ValueError(f"index {index} must select one group of a tree with batch shape "
                     f"{tree.batch_shape}.")
  return arrays


def _segments(t, values, detokenize):
  """Edges of the compressed tree: (parent id, child id, tokens text, n, V)."""
  children = {}
  for v in np.flatnonzero(t["node_count"])[1:]:
    children.setdefault(int(t["node_parent"][v]), []).append(int(v))
  label = detokenize or (lambda ids: " ".join(str(i) for i in ids))

  def walk(v):
    for child in sorted(children.get(v, []), key=lambda c: t["node_token"][c]):
      ids, end = [int(t["node_token"][child])], child
      while len(children.get(end, [])) == 1 and not _ends_here(t, end):
        end = children[end][0]
        ids.append(int(t["node_token"][end]))
      yield v, end, label(ids), int(t["node_count"][end]), float(values[end])
      yield from walk(end)

  return list(walk(0))


def _ends_here(t, v):
  """Some response ends at node v (so the chain must not be merged past it)."""
  node, mask = t["node"], t["mask"]
  last = mask & ~np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
  return bool(np.any(node[last] == v))


def render_text(tree: PrefixTree, rewards, *, index=(), advantages=None,
                detokenize: Optional[Callable[[Sequence[int]], str]] = None) -> str:
  """A text drawing of one group's tree.

  Each line is an edge (a run of tokens with no branch inside), with n(v), the
  value V(v) (mean reward below) and the TD step V(v) − V(parent). Responses
  are listed where they end, with their reward and, if given, the mean of
  their per-token advantages.

  Args:
    tree: a `PrefixTree`; `index` selects one group from its batch dims.
    rewards: float [..., G] outcome rewards.
    advantages: optional float [..., G, L], e.g. `credit.get("tempo")(rollouts)`.
    detokenize: maps a list of token ids to text (default: the ids).
  """
  t = _one_group(tree, index)
  rewards = np.asarray(rewards)[index]
  values = np.asarray(node_mean(_subtree(tree, index), rewards))
  adv = None if advantages is None else np.asarray(advantages)[index]
  segments = _segments(t, values, detokenize)
  fan_out = {}
  for parent, *_ in segments:
    fan_out[parent] = fan_out.get(parent, 0) + 1
  node, lengths = t["node"], t["mask"].sum(-1)
  depth_of = {0: 0}
  lines = [f"root  n={int(t['node_count'][0])}  V={values[0]:.3f}"]
  for parent, child, text, n, v in segments:
    depth_of[child] = depth_of[parent] + 1
    indent, branch = "  " * depth_of[parent], "*" if fan_out[parent] > 1 else " "
    lines.append(f"{indent}{branch}[{text}]  n={n}  V={v:.3f}  TD={v - values[parent]:+.3f}")
    for g in np.flatnonzero((lengths > 0) & (node[np.arange(len(node)), lengths - 1] == child)):
      extra = "" if adv is None else f"  mean A={adv[g, :lengths[g]].mean():+.3f}"
      lines.append(f"{indent}   -> response {g}: R={rewards[g]:.3f}{extra}")
  for g in np.flatnonzero(lengths == 0):
    lines.append(f"   -> response {g} (empty): R={rewards[g]:.3f}")
  return "\n".join(lines)


def _subtree(tree, index):
  """The group at `index` as a PrefixTree (numpy leaves)."""
  return jax.tree.map(lambda x: np.asarray(x)[index], tree)


def to_dot(tree: PrefixTree, rewards, *, index=(),
           detokenize: Optional[Callable[[Sequence[int]], str]] = None) -> str:
  """Graphviz DOT source for one group's compressed tree (`dot -Tpng`, or
  `graphviz.Source(...)` in a notebook). Nodes show n(v) and V(v)."""
  t = _one_group(tree, index)
  values = np.asarray(node_mean(_subtree(tree, index), np.asarray(rewards)[index]))
  out = ["digraph prefix_tree {", "  node [shape=box, fontname=monospace];",
         f'  n0 [label="root\\nn={int(t["node_count"][0])} V={values[0]:.3f}"];']
  for parent, child, text, n, v in _segments(t, values, detokenize):
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    out.append(f'  n{child} [label="n={n} V={v:.3f}"];')
    out.append(f'  n{parent} -> n{child} [label="{text}"];')
  out.append("}")
  return "\n".join(out)
