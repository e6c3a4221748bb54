"""Plain-Python references for the tree estimators, on explicit trees of node keys.

A group is given as `paths[g]`, the keys of the nodes after each of response
g's tokens (any hashables): for a prefix tree of tokens the key of depth t + 1
is the token prefix, for a sampled tree (parent, fork) the response that
sampled the token. Written with dicts, lists and recursion: no jax, no numpy.
"""

import math

ROOT = "root"
TOL = 1e-5  # relative rounding tolerance, as in credit.groups.rounding_tolerance


def prefix_paths(responses):
  """Node keys of a prefix tree: the token prefix."""
  return [[tuple(r[:t + 1]) for t in range(len(r))] for r in responses]


def sampled_paths(lengths, parent, fork):
  """Node keys of a sampled tree: (depth, the response that sampled the token)."""

  def owner(g, t):
    while parent[g] >= 0 and t < fork[g]:
      g = parent[g]
    return g

  return [[(t, owner(g, t)) for t in range(lengths[g])] for g in range(len(lengths))]


class Tree:
  """One group's tree; a response ending at a node is one more (terminal) child."""

  def __init__(self, paths, rewards):
    self.paths, self.rewards = paths, [float(r) for r in rewards]
    self.children, self.ends, self.below = {ROOT: []}, {ROOT: []}, {ROOT: []}
    for g, path in enumerate(paths):
      prev = ROOT
      self.below[ROOT].append(g)
      for key in path:
        if key not in self.children:
          self.children[key], self.ends[key], self.below[key] = [], [], []
          self.children[prev].append(key)
        self.below[key].append(g)
        prev = key
      self.ends[prev].append(g)

  def nodes(self, g):
    """n_0 = root, n_{t+1} = the node after token t."""
    return [ROOT] + list(self.paths[g])

  def mean_leaves(self, key, rewards=None):
    rewards = self.rewards if rewards is None else rewards
    below = self.below[key]
    return sum(rewards[g] for g in below) / len(below)

  def mean_children(self, key):
    vals = self.child_values(key, self.mean_children)
    return sum(vals) / len(vals)

  def child_values(self, key, value):
    return [value(c) for c in self.children[key]] + [self.rewards[g] for g in self.ends[key]]

  def num_children(self, key):
    return len(self.children[key]) + len(self.ends[key])

  def branch(self, g, t):
    return self.num_children(self.nodes(g)[t]) >= 2

  def segment_start(self, g, t):
    starts = [s for s in range(t + 1) if self.branch(g, s)]
    return starts[-1] if starts else 0


def mean(xs):
  return sum(xs) / len(xs)


def std(xs, ddof=0):
  if len(xs) <= ddof:
    return 0.0
  m = mean(xs)
  return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - ddof))


def snap(x, rewards):
  return 0.0 if abs(x) <= TOL * max(max(abs(r) for r in rewards), 1e-30) else x


def all_equal(rewards):
  return max(rewards) == min(rewards)


def grpo(rewards, eps=1e-6):
  if len(rewards) == 1:
    return [r / (1 + eps) for r in rewards]
  if all_equal(rewards):
    return [0.0] * len(rewards)
  m, s = mean(rewards), std(rewards, 1)
  return [(r - m) / (s + eps) for r in rewards]


def loo(rewards):
  g = len(rewards)
  if g == 1 or all_equal(rewards):
    return [0.0] * g
  return [r - (sum(rewards) - r) / (g - 1) for r in rewards]


def whiten(adv, eps=1e-8):
  """Whitens lists of per-token values over all tokens of all groups."""
  flat = [a for group in adv for row in group for a in row]
  if not flat or all(a == 0 for a in flat):
    return adv
  m, s = mean(flat), std(flat)
  return [[[(a - m) / (s + eps) for a in row] for row in group] for group in adv]


def edge_credit(tree, value="children", baseline="parent", normalise=False, eps=1e-8):
  """SPO-tree / Sibling-GRPO: per response, per token."""
  R = tree.rewards
  V = tree.mean_children if value == "children" else tree.mean_leaves
  out = []
  for g, path in enumerate(tree.paths):
    nodes, row = tree.nodes(g), []
    for t in range(len(path)):
      b = tree.segment_start(g, t)
      if not tree.branch(g, b) or all_equal(R):
        row.append(0.0)
        continue
      sibs = tree.child_values(nodes[b], V)
      base = V(nodes[b]) if baseline == "parent" else mean(sibs)
      d = snap(V(nodes[b + 1]) - base, R)
      if normalise:
        d = d / (snap(std(sibs, 1), R) + eps)
      row.append(d)
    out.append(row)
  return out


def treerl(tree, sqrt_leaves=False):
  Rn = loo(tree.rewards)
  out = []
  for g, path in enumerate(tree.paths):
    nodes, row = tree.nodes(g), []
    for t in range(len(path)):
      b = tree.segment_start(g, t)
      v = tree.mean_leaves(nodes[b + 1], Rn)
      x = (v - tree.mean_leaves(nodes[b], Rn) if tree.branch(g, b) else 0.0) + v
      if sqrt_leaves:
        x /= math.sqrt(len(tree.below[nodes[b + 1]]))
      row.append(x)
    out.append(row)
  return out


def treepo(tree):
  """Before whitening: per response, repeated on its tokens."""
  R, out = tree.rewards, []
  for g, path in enumerate(tree.paths):
    nodes = tree.nodes(g)
    sets = [ROOT] + [nodes[t + 1] for t in range(len(path))
                     if tree.branch(g, t) and len(tree.below[nodes[t + 1]]) > 1]
    a = mean([snap(R[g] - tree.mean_leaves(s), R) for s in sets])
    out.append([a] * len(path))
  return out


def tree_grpo(tree, eps=1e-6):
  R, out = tree.rewards, []
  base = grpo(R, eps)
  for g, path in enumerate(tree.paths):
    within = 0.0
    if path:
      leaves = [R[h] for h in tree.below[path[0]]]
      if not all_equal(leaves):
        within = (R[g] - mean(leaves)) / (std(leaves, 1) + eps)
    out.append([base[g] + within] * len(path))
  return out


def mars2(tree, gamma=0.5, lam=0.5, eps=1e-6):
  R, shaped = tree.rewards, []
  V = tree.mean_children
  for g in range(len(R)):
    split = [n for n in tree.nodes(g) if tree.num_children(n) >= 2]
    p = split[-1] if split else ROOT
    sibs = tree.child_values(p, V)
    others = (sum(sibs) - R[g]) / (len(sibs) - 1) if len(sibs) > 1 else V(p)
    shaped.append(R[g] + gamma * snap(R[g] - ((1 - lam) * V(p) + lam * others), R))
  adv = grpo(shaped, eps)
  return [[adv[g]] * len(path) for g, path in enumerate(tree.paths)]
