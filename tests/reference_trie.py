"""Plain-Python references (dict tries, loops) for the tests and benchmarks.

Written independently of the array code: no jax, no sorting, no hashing.
"""

import math


class TrieNode:
  __slots__ = ("children", "count", "reward_sum", "depth", "token")

  def __init__(self, depth=0, token=None):
    self.children = {}
    self.count = 0
    self.reward_sum = 0.0
    self.depth = depth
    self.token = token


def build_trie(responses, rewards):
  """responses: list of token lists. Returns (root, paths): paths[g][t] = node after token t."""
  root = TrieNode()
  paths = []
  for tokens, reward in zip(responses, rewards):
    node = root
    node.count += 1
    node.reward_sum += reward
    path = []
    for tok in tokens:
      child = node.children.get(tok)
      if child is None:
        child = node.children[tok] = TrieNode(node.depth + 1, tok)
      node = child
      node.count += 1
      node.reward_sum += reward
      path.append(node)
    paths.append(path)
  return root, paths


def group_tree(responses, rewards):
  """Per-token reference values of one group (lists of lists, one entry per real token)."""
  root, paths = build_trie(responses, rewards)
  out = {"count": [], "v_before": [], "v_after": [], "branches": [], "node_key": []}
  for tokens, path in zip(responses, paths):
    prev = root
    rows = {k: [] for k in out}
    for t, node in enumerate(path):
      rows["count"].append(node.count)
      rows["v_before"].append(prev.reward_sum / prev.count)
      rows["v_after"].append(node.reward_sum / node.count)
      rows["branches"].append(prev.count > node.count)
      rows["node_key"].append(tuple(tokens[: t + 1]))
      prev = node
    for k in out:
      out[k].append(rows[k])
  out["num_nodes"] = count_nodes(root)
  return out


def count_nodes(node):
  return 1 + sum(count_nodes(c) for c in node.children.values())


def group_stats(rewards):
  g = len(rewards)
  if g == 1:
    return 0.0, 1.0
  mean = sum(rewards) / g
  return mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / (g - 1))


def tempo_advantages(responses, rewards, eps=1e-6, scale_by_std=True):
  """TEMPO advantages of one group from a dict trie: list of per-token lists."""
  root, paths = build_trie(responses, rewards)
  mean, std = group_stats(rewards)
  scale = (std + eps) if scale_by_std else 1.0
  if len(rewards) > 1 and max(rewards) == min(rewards):
    return [[0.0] * len(tokens) for tokens in responses]
  out = []
  for reward, path in zip(rewards, paths):
    prev, row = root, []
    for node in path:
      td = node.reward_sum / node.count - prev.reward_sum / prev.count
      row.append((reward - mean + td) / scale)
      prev = node
    out.append(row)
  return out


def unpad(tokens, mask):
  """[G, L] arrays -> list of token lists (the unmasked run of each row)."""
  return [[int(t) for t, m in zip(row, mrow) if m] for row, mrow in zip(tokens, mask)]
