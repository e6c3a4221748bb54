"""The tree estimators `tree_grpo`, `treepo`, `spo_tree` and `treerl` against plain-Python
transcriptions of what the papers' authors' public code computes for a tree of rollouts.

Each transcription below was written from reading the authors' code (not copied from it),
with loops over nodes / paths and exact rational arithmetic (`fractions.Fraction`, so that
means of equal rewards are equal exactly; floats only where a square root is taken). Each
names the repository, file, function and commit it follows. Conventions where the project
departs from the authors are flags of the transcription: the random-tree tests switch them to
the project's (so everything else is shown identical), and a fixed case per convention shows
both numbers.

Mapping a sampled tree (`trees.from_forks`: response g copies `fork[g]` tokens of `parent[g]`)
onto the authors' trees: a node is identified by (position, the response that sampled the
token), as `trees.from_forks` does. Restrictions to the mappable trees are stated per estimator.
"""

import math
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings

import credit
import trees
from groups import sampled_trees

TOL = dict(rtol=1e-4, atol=2e-5)  # float32 estimators against exact / float64 references


# ----------------------------------------------------------------------------- mapping

def owner(parent, fork, g, t):
  """The response whose sampling produced response g's token t."""
  while parent[g] >= 0 and t < fork[g]:
    g = parent[g]
  return g


def node_paths(lengths, parent, fork):
  """Per response, the sampled-tree node after each of its tokens: (t, owner)."""
  return [[(t, owner(parent, fork, g, t)) for t in range(lengths[g])]
          for g in range(len(lengths))]


def project(name, tokens, mask, rewards, parent, fork, **hparams):
  tree = trees.from_forks(tokens, mask, parent, fork)
  rollouts = credit.Rollouts(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask),
                             rewards=jnp.asarray(rewards), tree=tree,
                             parent=jnp.asarray(parent), fork=jnp.asarray(fork))
  return np.asarray(credit.get(name)(rollouts, **hparams)), rollouts


def tokens_of(per_response, lengths, width):
  """Per-response values -> [G, L] rows (0 after each response's end)."""
  out = np.zeros((len(lengths), width))
  for g, n in enumerate(lengths):
    out[g, :n] = per_response[g]
  return out


def rows_of(per_token, width):
  """Per-response lists of per-token values -> [G, L]."""
  out = np.zeros((len(per_token), width))
  for g, row in enumerate(per_token):
    out[g, :len(row)] = row
  return out


def fmean(xs):
  return sum(xs, Fraction(0)) / len(xs)


def fvar(xs, ddof):
  m = fmean(xs)
  return sum(((x - m) ** 2 for x in xs), Fraction(0)) / (len(xs) - ddof)


def exact(rewards):
  return [Fraction(float(r)) for r in rewards]


def fixed_group(lengths, parent, fork, rewards, width=None):
  """One group ([1, G, L]) from lengths and edges; tokens all 0 (the sampled tree tells
  siblings apart)."""
  width = width or max(max(lengths), 1)
  mask = (np.arange(width) < np.array(lengths)[:, None])[None]
  return (np.zeros(mask.shape, np.int32), mask, np.array([rewards], np.float32),
          np.array([parent], np.int32), np.array([fork], np.int32))


# ----------------------------------------------------------------------------- Tree-GRPO

def tree_grpo_authors(rewards, prompt_ids, tree_ids, one_leaf_tree="authors", eps=1e-6):
  """AMAP-ML/Tree-GRPO (commit 90b1709), verl/trainer/ppo/ray_trainer_ts.py,
  `compute_advantage` with adv_estimator='tree' (the released train_*_tree_search.sh):
  `compute_grpo_outcome_advantage` (verl/trainer/ppo/core_algos.py) once grouped by the prompt
  `uid` and once by `tree_uid`, summed. Each grouping: a group of one gets mean 0 and std 1
  (so R/(1 + eps)), otherwise (R − mean)/(torch.std (Bessel) + eps).

  `tree_ids[i]`: the tree of response i (None: in no tree). `one_leaf_tree='project'`: a tree
  with one response adds 0 instead of R/(1 + eps) (the project's convention).
  """
  def grouped(index, single):
    members = {}
    for i, key in enumerate(index):
      if key is not None:
        members.setdefault(key, []).append(i)
    out = [0.0] * len(rewards)
    for group in members.values():
      scores = [rewards[i] for i in group]
      if len(group) == 1:
        out[group[0]] = float(scores[0]) / (1 + eps) if single == "authors" else 0.0
        continue
      m, s = fmean(scores), math.sqrt(fvar(scores, 1))
      for i in group:
        out[i] = float(rewards[i] - m) / (s + eps)
    return out

  inter = grouped(prompt_ids, "authors")
  inner = grouped(tree_ids, one_leaf_tree)
  return [a + b for a, b in zip(inter, inner)]


def authors_tree_uid(parent, g):
  """The authors' tree_uid: a node inherits its parent node's (generation_ts.py,
  `tree_uid = parent_node.tree_uid`), so a response is in the tree of the initial chain its
  parents lead to, also when it was expanded from that tree's root (fork 0)."""
  while parent[g] >= 0:
    g = parent[g]
  return g


def project_tree_id(lengths, parent, fork, g):
  """The project's tree: the responses that share their first node; none for an empty one."""
  return owner(parent, fork, g, 0) if lengths[g] > 0 else None


def tree_grpo_reference(rewards, lengths, parent, fork, conventions="authors"):
  tree_id = (lambda g: authors_tree_uid(parent, g)) if conventions == "authors" else (
      lambda g: project_tree_id(lengths, parent, fork, g))
  g = len(rewards)
  return tree_grpo_authors(exact(rewards), [0] * g, [tree_id(i) for i in range(g)],
                           one_leaf_tree=conventions)


@settings(max_examples=20, deadline=None)
@given(sampled_trees())
def test_tree_grpo_matches_authors_with_the_project_tree_conventions(group):
  """Identical to the authors' two GRPO groupings once a tree is the responses that share
  their first node (forks at position 0 start a tree) and a one-response tree adds 0."""
  tokens, mask, rewards, parent, fork = group
  adv, _ = project("tree_grpo", tokens, mask, rewards, parent, fork)
  for b in range(len(tokens)):
    lengths = mask[b].sum(-1).tolist()
    ref = tree_grpo_reference(rewards[b].tolist(), lengths, parent[b].tolist(),
                              fork[b].tolist(), conventions="project")
    np.testing.assert_allclose(adv[b], tokens_of(ref, lengths, mask.shape[-1]), **TOL)


def test_tree_grpo_one_response_tree():
  """Responses 0 and 1 form a tree, response 2 (a second initial chain) is a tree of one.
  Rewards [1, 0, 1]: the group term of response 2 is (1 − 2/3)/(√(1/3) + 1e-6) = 0.57735;
  the authors add R/(1 + 1e-6) = 1 for its tree of one (verl's group-of-one rule: mean 0,
  std 1), the project adds 0."""
  lengths, parent, fork, rewards = [3, 3, 3], [-1, 0, -1], [0, 1, 0], [1.0, 0.0, 1.0]
  authors = tree_grpo_reference(rewards, lengths, parent, fork, "authors")
  adv, _ = project("tree_grpo", *fixed_group(lengths, parent, fork, rewards))
  np.testing.assert_allclose(authors[2], 1.57735, atol=1e-5)
  np.testing.assert_allclose(adv[0, 2], 0.57735, atol=1e-5)
  np.testing.assert_allclose(adv[0, :2, 0], authors[:2], **TOL)  # the two-response tree agrees


def test_tree_grpo_fork_at_position_zero():
  """Response 2 was forked from response 0 at position 0 (an expansion of the tree's root).
  The authors keep it in response 0's tree (its tree_uid is inherited), so the one tree is the
  whole group and each response gets twice its GRPO advantage; the project starts a new tree at
  a fork at position 0 (responses sharing their first node), so response 2 is a tree of one.
  Rewards [1, 0, 0]: response 2 gets 2·(−1/3)/√(1/3) = −1.1547 from the authors, −0.57735
  from the project."""
  lengths, parent, fork, rewards = [3, 3, 3], [-1, 0, 0], [0, 2, 0], [1.0, 0.0, 0.0]
  authors = tree_grpo_reference(rewards, lengths, parent, fork, "authors")
  adv, _ = project("tree_grpo", *fixed_group(lengths, parent, fork, rewards))
  np.testing.assert_allclose(authors, [2.3094, -1.1547, -1.1547], atol=1e-4)
  np.testing.assert_allclose(adv[0, :, 0], [1.86181, -1.28446, -0.57735], atol=1e-4)
  # with the authors' tree_uid and only the one-response rule switched, response 2 still
  # differs: the project's trees are not the authors' here
  switched = tree_grpo_authors(exact(rewards), [0] * 3, [0, 0, 0], one_leaf_tree="project")
  assert abs(switched[2] - adv[0, 2, 0]) > 0.5


# ----------------------------------------------------------------------------- TreePO

def treepo_authors(uids, rewards, multiplicity="authors", single_root="authors"):
  """multimodal-art-projection/TreePO (commit f055523), verl/trainer/ppo/core_algos.py,
  `compute_tree_reinforce_plus_plus_baseline_outcome_advantage` with
  adv_weight_strategy='average' and remove_no_std_subgroup=False (recipe/treepo/
  run_treepo_train.sh), before its `masked_whiten`. `uids[i]` is the trainer's uid,
  'prompt#node1#node2#...' (recipe/dapo/dapo_ray_trainer.py with tree_subgroup_opt=14: the
  first 14 segment ids of tree_idx; our trees have at most 6 levels, so nothing is cut).

  For depth d = 0 .. D−1 (D: the most '#' in the batch) the responses are grouped by their
  first d + 1 uid parts; a response records R − mean of its group if d = 0 (always; a group of
  one has mean 0) or the group has more than one member; its advantage is the mean of its
  records. Because every segment is a node, a leaf set that spans several depths (one-child
  nodes) is recorded once per depth.

  multiplicity='project': a leaf set is recorded once per response (each distinct set, as the
  project counts the root and each branch). single_root='project': a group of one gets 0 at
  the root (R − its own mean), not R.
  """
  parts = [u.split("#") for u in uids]
  depth_max = max(len(p) - 1 for p in parts)
  records = [[] for _ in uids]
  last_set = [None] * len(uids)
  for depth in range(depth_max):
    keys = ["#".join(p[:depth + 1]) for p in parts]
    groups = {}
    for i, k in enumerate(keys):
      groups.setdefault(k, []).append(i)
    for i, k in enumerate(keys):
      group = groups[k]
      if len(group) == 1:
        mean = rewards[i] if single_root == "project" else Fraction(0)
      else:
        mean = fmean([rewards[j] for j in group])
      if depth == 0 or len(group) > 1:
        if multiplicity == "project" and last_set[i] == frozenset(group):
          continue
        records[i].append(rewards[i] - mean)
        last_set[i] = frozenset(group)
  return [fmean(r) for r in records]


def treepo_uids(mask, parent, fork):
  """One uid per row of a batch [B, G, L]: segments are single tokens, a segment id is the
  sampled-tree node (position, owner), as the authors' '{step}-{batch index}' ids name the
  sampled node of each step."""
  uids = []
  for b in range(mask.shape[0]):
    lengths = mask[b].sum(-1).tolist()
    for path in node_paths(lengths, parent[b].tolist(), fork[b].tolist()):
      uids.append(f"p{b}" + "".join(f"#{t}-{o}" for t, o in path))
  return uids


def whiten_authors(values, mask):
  """verl.utils.torch_functional.masked_whiten (as in the TreePO repository): mean and
  variance over the masked tokens, both divided by (count + 1e-8), the variance times
  n/(n − 1) (Bessel), then (x − mean)·rsqrt(var + 1e-8)."""
  xs = [Fraction(float(v)) for v, m in zip(values.ravel(), mask.ravel()) if m]
  n = len(xs)
  mean = sum(xs, Fraction(0)) / (n + Fraction(1, 10 ** 8))
  var = sum(((x - mean) ** 2 for x in xs), Fraction(0)) / (n + Fraction(1, 10 ** 8))
  var = var * n / (n - 1)
  scale = 1 / math.sqrt(float(var) + 1e-8)
  return np.where(mask, (values - float(mean)) * scale, 0.0)


def whiten_project(values, mask):
  """The project's convention (docs/conventions.md, batch whitening): population variance,
  (x − mean)/(std + 1e-8), exact 0 when every masked value is equal."""
  xs = [Fraction(float(v)) for v, m in zip(values.ravel(), mask.ravel()) if m]
  if not xs or min(xs) == max(xs):
    return np.zeros_like(values)
  mean = fmean(xs)
  std = math.sqrt(fvar(xs, 0))
  return np.where(mask, (values - float(mean)) / (std + 1e-8), 0.0)


def treepo_reference(mask, rewards, parent, fork, **conventions):
  """[B, G, L] unwhitened authors' advantages on the tokens."""
  uids = treepo_uids(mask, parent, fork)
  flat = treepo_authors(uids, [Fraction(float(r)) for r in rewards.ravel()], **conventions)
  adv = np.array([float(a) for a in flat]).reshape(rewards.shape)
  return np.where(mask, adv[..., None], 0.0)


def distinct_paths(mask, parent, fork):
  """The authors' responses each end in their own last segment: no two responses of a group
  have the same node path (e.g. two empty ones, or one that copied all of its parent and
  sampled nothing). Such duplicates share a uid and form a group of their own at every depth
  past their end, which has no counterpart in the project's trees."""
  for b in range(mask.shape[0]):
    paths = node_paths(mask[b].sum(-1).tolist(), parent[b].tolist(), fork[b].tolist())
    if len({tuple(p) for p in paths}) < len(paths):
      return False
  return True


@settings(max_examples=20, deadline=None)
@given(sampled_trees())
def test_treepo_matches_authors_counting_each_leaf_set_once(group):
  """Identical to the authors' depth loop once each distinct leaf set is counted once (not
  once per one-child segment) and a group of one gets 0, both unwhitened and with the
  project's batch whitening. Restricted to trees without duplicate paths (`distinct_paths`)."""
  tokens, mask, rewards, parent, fork = group
  assume(distinct_paths(mask, parent, fork))
  ref = treepo_reference(mask, rewards, parent, fork, multiplicity="project",
                         single_root="project")
  raw, _ = project("treepo", tokens, mask, rewards, parent, fork, whiten=False)
  np.testing.assert_allclose(raw, ref, **TOL)
  adv, _ = project("treepo", tokens, mask, rewards, parent, fork)
  np.testing.assert_allclose(adv, whiten_project(ref, mask), rtol=1e-4, atol=1e-4)


def test_treepo_one_child_segments_counted_per_depth():
  """Response 0 (reward 1) has three tokens; response 1 forks from it at 1, response 2 at 2
  (rewards 0, 0). Along response 0 the leaf sets are {0,1,2} (the root and the one-child node
  after token 0) and {0,2}. The authors count {0,1,2} at depths 0 and 1:
  (2/3 + 2/3 + 1/2)/3 = 11/18; the project counts each set once: (2/3 + 1/2)/2 = 7/12.
  Response 2: −7/18 against −5/12. Response 1 (only {0,1,2}): −1/3 in both."""
  lengths, parent, fork, rewards = [3, 3, 3], [-1, 0, 0], [0, 1, 2], [1.0, 0.0, 0.0]
  tokens, mask, r, p, f = fixed_group(lengths, parent, fork, rewards)
  authors = treepo_reference(mask, r, p, f)[0, :, 0]
  np.testing.assert_allclose(authors, [11 / 18, -1 / 3, -7 / 18], atol=1e-12)
  adv, _ = project("treepo", tokens, mask, r, p, f, whiten=False)
  np.testing.assert_allclose(adv[0, :, 0], [7 / 12, -1 / 3, -5 / 12], atol=1e-6)
  switched = treepo_reference(mask, r, p, f, multiplicity="project")[0, :, 0]
  np.testing.assert_allclose(adv[0, :, 0], switched, atol=1e-6)


def test_treepo_group_of_one():
  """Two groups of one response, rewards 1 and 0. The authors' root group of one has mean 0, so
  the raw advantages are 1 and 0, whitened over the batch to ±0.7071; the project's are
  R − R = 0, and whiten to 0."""
  tokens, mask, r, p, f = fixed_group([1], [-1], [0], [1.0])
  tokens, mask, p, f = (np.concatenate([x, x]) for x in (tokens, mask, p, f))
  r = np.array([[1.0], [0.0]], np.float32)
  authors = treepo_reference(mask, r, p, f)
  np.testing.assert_array_equal(authors[:, 0, 0], [1.0, 0.0])
  np.testing.assert_allclose(whiten_authors(authors, mask)[:, 0, 0], [0.70711, -0.70711],
                             atol=1e-5)
  adv, _ = project("treepo", tokens, mask, r, p, f, whiten=False)
  np.testing.assert_array_equal(adv[:, 0, 0], [0.0, 0.0])
  adv, _ = project("treepo", tokens, mask, r, p, f)
  np.testing.assert_array_equal(adv[:, 0, 0], [0.0, 0.0])
  switched = treepo_reference(mask, r, p, f, single_root="project")
  np.testing.assert_array_equal(switched[:, 0, 0], [0.0, 0.0])


def test_treepo_whitening():
  """Two groups of two one-token responses, rewards [1, 0] and [1, 1]: raw advantages
  [0.5, −0.5, 0, 0] in both. The authors' masked_whiten (Bessel variance 1/6, eps inside the
  root) gives ±1.2247; the project's (population std 0.35355, eps outside) ±1.4142."""
  tokens, mask, r, p, f = fixed_group([1, 1], [-1, -1], [0, 0], [1.0, 0.0])
  tokens, mask, p, f = (np.concatenate([x, x]) for x in (tokens, mask, p, f))
  r = np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)
  authors = treepo_reference(mask, r, p, f)
  np.testing.assert_array_equal(authors[..., 0], [[0.5, -0.5], [0.0, 0.0]])
  np.testing.assert_allclose(whiten_authors(authors, mask)[..., 0],
                             [[1.22474, -1.22474], [0.0, 0.0]], atol=1e-5)
  adv, _ = project("treepo", tokens, mask, r, p, f)
  np.testing.assert_allclose(adv[..., 0], [[1.41421, -1.41421], [0.0, 0.0]], atol=1e-5)
  np.testing.assert_allclose(adv, whiten_project(authors, mask), atol=1e-6)


# ----------------------------------------------------------------------------- SPO-tree

def spo_authors_tree(paths, rewards):
  """The authors' tree (hybrid_inference_strategy.py `_construct_tree`) for a sampled tree:
  the root is the prompt; a node is a run of tokens sampled in one call, and every node the
  authors expand gets branch_factor >= 2 children (configs/episode_generators/
  branch_factor_*.jsonnet), so a node is a maximal run between branch points; a leaf carries
  its reward. A response that ends where others continue is a finished child with empty text
  (its edge has no tokens, as the authors drop empty edges)."""
  children, ends = {"root": []}, {"root": []}
  for g, path in enumerate(paths):
    prev = "root"
    for key in path:
      if key not in children:
        children[key], ends[key] = [], []
        children[prev].append(key)
      prev = key
    ends[prev].append(g)

  def segment(first):
    keys = [first]
    while len(children[keys[-1]]) == 1 and not ends[keys[-1]]:
      keys.append(children[keys[-1]][0])
    last = keys[-1]
    if not children[last] and len(ends[last]) == 1:
      return {"keys": keys, "reward": rewards[ends[last][0]]}
    return {"keys": keys, "children": [segment(k) for k in children[last]]
            + [{"keys": [], "reward": rewards[g]} for g in ends[last]]}

  return {"keys": [], "children": [segment(k) for k in children["root"]]
          + [{"keys": [], "reward": rewards[g]} for g in ends["root"]]}


def spo_tree_authors(paths, rewards, adv_method="rloo", ddof=0):
  """AIFrameResearch/SPO (commit b9fc6a2): node values from src/treetune/inference_strategies/
  hybrid_inference_strategy.py `_construct_tree` (a leaf's reward; an inner node's reward =
  np.mean of its children's, reward_std = np.std of them, population), edges from
  src/treetune/episode_generators/tree_episode_generator.py `extract_edges_from_tree`:
  advantage = child reward − parent reward ('rloo', the default adv_method) or that over
  (parent reward_std + 1e-8) ('grpo'); hybrid_episode_generator.py `_compute_token_advantages`
  puts an edge's advantage on all its tokens. With only_adv_greater_than_zero (default True) an
  edge is kept iff advantage + BoK(child) − BoK(parent) != 0 (BoK(v) = 1 − (1 − v)^4), which
  for values in [0, 1] is iff advantage != 0.

  Returns ({node key: advantage}, {node key: kept}). `ddof=1` is the project's convention.
  """
  def value(node):
    if "children" in node:
      kids = [value(c) for c in node["children"]]
      node["reward"] = fmean(kids)
      node["reward_std"] = math.sqrt(fvar(kids, ddof)) if len(kids) > ddof else 0.0
    return node["reward"]

  def bok(v):
    return 1 - (1 - v) ** 4

  value(tree := spo_authors_tree(paths, rewards))
  adv, kept = {}, {}

  def edges(node):
    for child in node.get("children", []):
      a = child["reward"] - node["reward"]
      a = float(a) if adv_method == "rloo" else float(a) / (node["reward_std"] + 1e-8)
      keep = a + float(bok(child["reward"]) - bok(node["reward"])) != 0
      for key in child["keys"]:
        adv[key], kept[key] = a, keep
      edges(child)

  edges(tree)
  return adv, kept


def spo_reference(mask, rewards, parent, fork, **kwargs):
  adv = np.zeros(mask.shape)
  kept = np.zeros(mask.shape, bool)
  for b in range(mask.shape[0]):
    paths = node_paths(mask[b].sum(-1).tolist(), parent[b].tolist(), fork[b].tolist())
    a, k = spo_tree_authors(paths, exact(rewards[b]), **kwargs)
    for g, path in enumerate(paths):
      adv[b, g, :len(path)] = [a[key] for key in path]
      kept[b, g, :len(path)] = [k[key] for key in path]
  return adv, kept


@settings(max_examples=20, deadline=None)
@given(sampled_trees())
def test_spo_tree_matches_authors(group):
  """'rloo' (the authors' default): identical, and drop_zero=True keeps exactly the authors'
  edges (only_adv_greater_than_zero). 'grpo': identical with the project's Bessel std."""
  tokens, mask, rewards, parent, fork = group
  ref, kept = spo_reference(mask, rewards, parent, fork)
  adv, rollouts = project("spo_tree", tokens, mask, rewards, parent, fork)
  np.testing.assert_allclose(adv, ref, **TOL)
  dropped = np.asarray(credit.loss_mask("spo_tree", rollouts, jnp.asarray(adv), drop_zero=True))
  np.testing.assert_array_equal(dropped, kept & mask)
  ref, _ = spo_reference(mask, rewards, parent, fork, adv_method="grpo", ddof=1)
  adv, _ = project("spo_tree", tokens, mask, rewards, parent, fork, mode="grpo")
  np.testing.assert_allclose(adv, ref, rtol=1e-4, atol=1e-4)


def test_spo_tree_grpo_std_convention():
  """Two first segments with rewards 1 and 0: the edge advantage is ±0.5 in both ('rloo');
  in 'grpo' the authors divide by np.std([1, 0]) = 0.5 (±1.0), the project by the Bessel std
  0.7071 (±0.7071)."""
  lengths, parent, fork, rewards = [2, 2], [-1, -1], [0, 0], [1.0, 0.0]
  args = fixed_group(lengths, parent, fork, rewards)
  _, mask, r, p, f = args
  np.testing.assert_allclose(spo_reference(mask, r, p, f)[0][0, :, 0], [0.5, -0.5])
  np.testing.assert_allclose(project("spo_tree", *args)[0][0, :, 0], [0.5, -0.5])
  authors = spo_reference(mask, r, p, f, adv_method="grpo")[0][0, :, 0]
  np.testing.assert_allclose(authors, [1.0, -1.0], atol=1e-6)
  adv, _ = project("spo_tree", *args, mode="grpo")
  np.testing.assert_allclose(adv[0, :, 0], [0.70711, -0.70711], atol=1e-5)


# ----------------------------------------------------------------------------- TreeRL

class Node:
  """openrlhf/trainer/ppo_utils/tree_node.py `MCTSNode`: the fields the values use."""

  def __init__(self, positions, parent, terminal=False, reward=None):
    self.positions, self.parent, self.children = positions, parent, []
    self.terminal, self.reward = terminal, reward
    self.terminal_in_subtree, self.selected_terminal_in_subtree = 0, 0
    self.accumulated_value = Fraction(0)


def treerl_authors(lengths, parent, fork, rewards, sqrt="authors", fill_in=True):
  """THUDM/TreeRL (commit f0edbea), openrlhf/trainer/ppo_utils/tree_node.py
  `build_into_tree_format` (build_tree_node, leaf_normalize, leaf_backpropagate,
  selected_backpropagate, compute_weighted_update) and parallel_mcts.py `gather_paths`
  (path_from_root_to_node, fill_in_paths), with the released scripts/treerl-qw14b.sh options:
  use_state_value_reward, use_weighted_value with weighted_value_style='sqrt',
  overall_norm_style 'none' (its default: normalize_all_steps returns), average_one_generation
  off; experience_maker.py `_generate_vllm_mcts` puts a path node's value on its tokens.

  Each response is one generation (TreeNode) forked from the generation that sampled position
  fork[g] of its parent, at that split index; build_tree_node cuts a generation at its
  children's split indices into segments (MCTSNode); a generation's last segment is its leaf.
  Leaves get R − mean of the other leaves (leaf_normalize); a node's accumulated value is the
  sum over the leaves below; with 'sqrt' every node's is divided by √(selected leaves below)
  (all leaves selected here); V = accumulated / leaves below; a path node gets
  (V(node) − V(parent)) + V(node), where fill_in_paths first replaces a difference
  |·| < 1e-8 by the previous node's difference.

  sqrt: 'authors' (before the differences), 'none' (no weighting), 'after' (the project's
  sqrt_leaves: the node's reward over √(leaves below)). Returns per-response token lists.
  """
  g_count = len(lengths)
  own_start = [fork[g] if parent[g] >= 0 else 0 for g in range(g_count)]
  kids = [[] for _ in range(g_count)]
  for g in range(g_count):
    if parent[g] >= 0:
      a = attach(parent, fork, g)
      kids[a].append((fork[g] - own_start[a], g))
  leaves, leaf_of = [], {}

  def build(gen, parent_node):  # build_tree_node
    children = sorted(kids[gen], key=lambda c: c[0])
    splits = [s for s, _ in children]
    own = list(range(own_start[gen], lengths[gen]))
    first = splits[0] if splits else len(own)
    node = Node(own[:first], parent_node, terminal=not splits,
                reward=rewards[gen] if not splits else None)
    if node.terminal:
      leaves.append(node)
      leaf_of[gen] = node
    current, start, i = node, first, 0
    while i < len(children):  # add_segments_and_children
      split, group = splits[i], []
      while i < len(children) and splits[i] == split:
        group.append(children[i][1])
        i += 1
      end = splits[i] if i < len(children) else len(own)
      segment = Node(own[start:end], current, terminal=i == len(children),
                     reward=rewards[gen] if i == len(children) else None)
      current.children.append(segment)
      if segment.terminal:
        leaves.append(segment)
        leaf_of[gen] = segment
      for child in group:
        current.children.append(build(child, current))
      start, current = end, segment
    return node

  root = Node([], None)
  for g in range(g_count):
    if parent[g] < 0:
      root.children.append(build(g, root))
  assert len(leaves) == g_count and len(leaves) > 1  # the authors assert num_traces > 1

  total = sum((leaf.reward for leaf in leaves), Fraction(0))
  for leaf in leaves:  # leaf_normalize + leaf_backpropagate
    leaf.accumulated_value = leaf.reward - (total - leaf.reward) / (len(leaves) - 1)
    leaf.terminal_in_subtree += 1
    up = leaf.parent
    while up is not None:
      up.terminal_in_subtree += 1
      up.accumulated_value += leaf.accumulated_value
      up = up.parent
  if sqrt == "authors":  # all leaves selected: selected_backpropagate, compute_weighted_update
    for leaf in leaves:
      node = leaf
      while node is not None:
        node.selected_terminal_in_subtree += 1
        node = node.parent
    stack = [root]
    while stack:
      node = stack.pop()
      if node.selected_terminal_in_subtree:
        node.accumulated_value = (float(node.accumulated_value)
                                  / math.sqrt(node.selected_terminal_in_subtree))
        stack.extend(node.children)

  out = []
  for g in range(g_count):
    path, node = [], leaf_of[g]
    while node.parent is not None:  # path_from_root_to_node
      child_v = node.accumulated_value / node.terminal_in_subtree
      parent_v = node.parent.accumulated_value / node.parent.terminal_in_subtree
      path.append({"node": node, "value": child_v - parent_v, "state_value": child_v})
      node = node.parent
    path = path[::-1]
    if fill_in:  # fill_in_paths
      for i in range(1, len(path)):
        if abs(path[i]["value"]) < 1e-8:
          path[i]["value"] = path[i - 1]["value"]
    row = []
    for step in path:  # use_state_value_reward
      v = float(step["value"] + step["state_value"])
      if sqrt == "after":
        v /= math.sqrt(step["node"].terminal_in_subtree)
      row += [v] * len(step["node"].positions)
    assert [t for step in path for t in step["node"].positions] == list(range(lengths[g]))
    out.append(row)
  return out


def attach(parent, fork, g):
  """The generation g forks from: the one that sampled position fork[g] of its parent's
  response (or the parent itself when it forks at the parent's end)."""
  a = parent[g]
  while parent[a] >= 0 and fork[g] < fork[a]:
    a = parent[a]
  return a


def treerl_mappable(lengths, parent, fork):
  """Edges the authors' trees have: a child forks at a split index >= 1 of the generation it
  forks from. The entropy-guided sampler never forks at a branch's first token (its mask[0]),
  and a fork at index 0 of an initial chain would give an empty MCTS node grouping the chain
  with the fork, which the project's trees do not have. Other forks are made roots."""
  parent, fork = list(parent), list(fork)
  for g in range(len(parent)):
    if parent[g] >= 0:
      a = attach(parent, fork, g)
      start = fork[a] if parent[a] >= 0 else 0
      if fork[g] - start < 1:
        parent[g], fork[g] = -1, 0
  return parent, fork


def treerl_case(group):
  tokens, mask, rewards, parent, fork = group
  parent, fork = parent.copy(), fork.copy()
  for b in range(len(tokens)):
    p, f = treerl_mappable(mask[b].sum(-1).tolist(), parent[b].tolist(), fork[b].tolist())
    parent[b], fork[b] = p, f
  return tokens, mask, rewards, parent, fork


def treerl_reference(mask, rewards, parent, fork, **kwargs):
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    lengths = mask[b].sum(-1).tolist()
    rows = treerl_authors(lengths, parent[b].tolist(), fork[b].tolist(), exact(rewards[b]),
                          **kwargs)
    out[b] = rows_of(rows, mask.shape[-1])
  return out


@settings(max_examples=20, deadline=None)
@given(sampled_trees(sizes=(4, 7)))
def test_treerl_matches_authors_without_their_two_departures(group):
  """The paper variant (the default) is identical to the authors' path values without
  fill_in_paths and with √n(s) applied as the paper does (after the sum, `sqrt_leaves=True`)
  or not at all; `variant='code'` is identical to the released options. Groups of at least 2
  (the authors assert more than one leaf); forks restricted by `treerl_mappable`; all leaves
  selected (use_all_terminals, or num_traces = the number of leaves)."""
  tokens, mask, rewards, parent, fork = treerl_case(group)
  adv, _ = project("treerl", tokens, mask, rewards, parent, fork)
  np.testing.assert_allclose(adv, treerl_reference(mask, rewards, parent, fork, sqrt="none",
                                                   fill_in=False), **TOL)
  adv, _ = project("treerl", tokens, mask, rewards, parent, fork, sqrt_leaves=True)
  np.testing.assert_allclose(adv, treerl_reference(mask, rewards, parent, fork, sqrt="after",
                                                   fill_in=False), **TOL)
  adv, _ = project("treerl", tokens, mask, rewards, parent, fork, variant="code")
  np.testing.assert_allclose(adv, treerl_reference(mask, rewards, parent, fork), **TOL)


def test_treerl_departures_on_a_fixed_tree():
  """Response 0 (reward 1, three tokens); response 1 forks from it at 1 (reward 0), response 2
  at 2 (reward 1). Normalised leaves 0.5, −1, 0.5. Response 0's segments: token 0 (all
  three, V 0), token 1 ({0, 2}, V 0.5), token 2 (its leaf, V 0.5).
  fill_in_paths: the last segment's difference is 0, so the authors copy 0.5 into it: 1.0
  where the paper (the project's default) gives 0 + 0.5 = 0.5.
  √n before the differences: V' = V/√n, token 1 gets 2·0.5/√2 = 0.7071 in both, token 2
  (0.5 − 0.3536) + 0.5 = 0.6464 from the authors, (0 + 0.5)/√1 = 0.5 from the paper."""
  lengths, parent, fork, rewards = [3, 3, 3], [-1, 0, 0], [0, 1, 2], [1.0, 0.0, 1.0]
  args = fixed_group(lengths, parent, fork, rewards)
  _, mask, r, p, f = args
  plain = treerl_reference(mask, r, p, f, sqrt="none", fill_in=True)[0]
  np.testing.assert_allclose(plain[0], [0.0, 1.0, 1.0], atol=1e-12)
  adv, _ = project("treerl", *args)
  np.testing.assert_allclose(adv[0, 0], [0.0, 1.0, 0.5], atol=1e-6)
  authors = treerl_reference(mask, r, p, f)[0]  # the released options
  np.testing.assert_allclose(authors[0], [0.0, 0.70711, 0.64645], atol=1e-5)
  adv, _ = project("treerl", *args, sqrt_leaves=True)
  np.testing.assert_allclose(adv[0, 0], [0.0, 0.70711, 0.5], atol=1e-5)
  np.testing.assert_allclose(adv[0, 1], authors[1], atol=1e-5)  # response 1 agrees
  adv, _ = project("treerl", *args, variant="code")
  np.testing.assert_allclose(adv[0], authors, atol=1e-5)
  with pytest.raises(ValueError, match="variant"):
    project("treerl", *args, variant="released")
  with pytest.raises(ValueError, match="sqrt_leaves"):
    project("treerl", *args, variant="code", sqrt_leaves=True)
