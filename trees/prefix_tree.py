"""Rollout groups as prefix trees, built with array code (no loops over tokens).

A group is G responses of padded length L to one prompt; batches carry leading
dimensions, so token arrays are [..., G, L]. A *node* is the state after a
token: responses g and h share the node at position t iff their first t + 1
tokens are equal and both are unmasked there. Node 0 is the root (the prompt,
reached by every response, zero-length ones included).

Representation. Responses are put in trie (lexicographic) order `order`; the
responses through any node are then a contiguous run `order[first:last + 1]`,
so a per-response reduction over a node is a difference of two prefix sums.
Node ids are static (N = 1 + G·L per group): the node at depth t + 1 whose run
starts at trie position k has id `1 + k·L + t`; other slots are unused
(`node_count == 0`). The id N means "no node" (masked tokens, the root's
parent); segment reductions drop it.

Algorithm (per group, O(G·L + G²·(L/32 + 32)) work):
shared-prefix lengths from block hashes (`lcp.py`), the trie order from them,
an exact check of every adjacent pair in that order (an exact O(G²·L)
fallback runs if a hash collision ever breaks it). The runs only change at the
G − 1 adjacent lcps, so they are computed per *level* ([G, G] tables) and
expanded to tokens with one column gather; no scans over [G, L].
"""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from trees import lcp as lcp_lib


@flax.struct.dataclass
class PrefixTree:
  """A batch of prefix trees. Shapes: [..., G, L] per token, [..., N] per node.

  Attributes:
    mask: bool [..., G, L], True on response tokens (a run from position 0).
    node: int32 [..., G, L], the node after token t (state s_{t+1}); N if masked.
    parent: int32 [..., G, L], the node before token t (s_t; root 0 at t = 0); N if masked.
    count: int32 [..., G, L], n(node): responses sharing the first t + 1 tokens; 0 if masked.
    branches: bool [..., G, L], some response reaches s_t but does not take token
      t (it takes another token or ends there). Where False, n(s_t) = n(s_{t+1})
      and so V(s_t) = V(s_{t+1}).
    first, last: int32 [..., G, L], the responses through the node after token t
      are `order[first:last + 1]`; 0 if masked.
    order: int32 [..., G], the responses in trie order (ties by index).
    level: int32 [..., L], how many adjacent-in-trie-order lcps are <= t; the
      node runs only change between levels (at most G per group).
    run_first, run_last: int32 [..., G, G], per response and level: `first[g, t]
      = run_first[g, level[t]]` on unmasked tokens (same for `last`).
    lcp: int32 [..., G, G], shared-prefix lengths; lcp[g, g] is g's length.
    node_count: int32 [..., N], n(v), responses through node v (0 = unused slot).
    node_parent: int32 [..., N], parent node (N for the root and unused slots).
    node_depth: int32 [..., N], tokens from the root (0 for the root and unused slots).
    node_token: int32 [..., N], the token into v (-1 for the root and unused slots).
  """

  mask: jax.Array
  node: jax.Array
  parent: jax.Array
  count: jax.Array
  branches: jax.Array
  first: jax.Array
  last: jax.Array
  order: jax.Array
  level: jax.Array
  run_first: jax.Array
  run_last: jax.Array
  lcp: jax.Array
  node_count: jax.Array
  node_parent: jax.Array
  node_depth: jax.Array
  node_token: jax.Array

  @property
  def group_size(self) -> int:
    return self.mask.shape[-2]

  @property
  def max_len(self) -> int:
    return self.mask.shape[-1]

  @property
  def num_nodes(self) -> int:
    return self.node_count.shape[-1]

  @property
  def batch_shape(self) -> tuple[int, ...]:
    return self.mask.shape[:-2]

  @property
  def lengths(self) -> jax.Array:
    """int32 [..., G], each response's number of tokens."""
    return jnp.sum(self.mask, axis=-1, dtype=jnp.int32)


def as_tokens_and_mask(tokens, mask):
  """`tokens`, `mask` as jax arrays, checked by `check_tokens_and_mask`.

  Host inputs (numpy arrays, lists) have their dtypes checked before the
  conversion, so strings or objects raise ValueError rather than a TypeError
  from `jnp.asarray`, and 64-bit ids outside int32 (which the conversion would
  silently wrap) are caught while they are still exact.
  """
  if not isinstance(tokens, jax.Array):
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"tokens must be integers; got dtype {tokens.dtype}.")
    _check_int32_range(tokens)
  if not isinstance(mask, jax.Array):
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
      raise ValueError(f"mask must be boolean; got dtype {mask.dtype}.")
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  check_tokens_and_mask(tokens, mask)
  return tokens, mask


def _check_int32_range(tokens):
  """Keys are int32 inside `build_from_keys`: wider integer ids must fit (when concrete)."""
  if tokens.dtype.itemsize <= 4 or isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
    return
  t = np.asarray(tokens)
  low, high = t.min(), t.max()
  if low < -2**31 or high >= 2**31:
    bad = low if low < -2**31 else high
    at = tuple(int(i) for i in np.argwhere(t == bad)[0])
    raise ValueError(f"tokens must fit in int32; got tokens{list(at)} = {bad} ({t.dtype}).")


def check_tokens_and_mask(tokens, mask):
  """Raises ValueError on inputs `build` cannot take (values only when concrete)."""
  if tokens.ndim < 2:
    raise ValueError(f"tokens must be [..., G, L]; got shape {tokens.shape}.")
  if tokens.shape != mask.shape:
    raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must have the same shape.")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers; got dtype {tokens.dtype}.")
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean; got dtype {mask.dtype}.")
  if tokens.shape[-2] == 0:
    raise ValueError("empty group: the group axis (G, second to last) has size 0.")
  if tokens.shape[-1] == 0:
    raise ValueError("the token axis (L, last) has size 0; pad to at least one position.")
  _check_int32_range(tokens)
  if not isinstance(mask, jax.core.Tracer):
    m = np.asarray(mask)
    holes = m[..., 1:] & ~m[..., :-1]
    if holes.any():
      at = tuple(int(i) for i in np.argwhere(holes)[0])
      raise ValueError(
          "mask has holes: response tokens must be one run starting at position 0, "
          f"but mask{list(at[:-1] + (at[-1] + 1,))} is True after a False.")


@functools.partial(jax.jit, static_argnames="method")
def _build(tokens, mask, method):
  return build_from_keys(tokens, mask, method=method)


def build(tokens, mask, *, method: str = "blocked") -> PrefixTree:
  """Builds the prefix trees of a batch of rollout groups.

  Args:
    tokens: int [..., G, L].
    mask: bool [..., G, L], True on response tokens, one run from position 0.
      Checked when concrete; under jit a mask with holes is cut at its first hole.
    method: "blocked" (block hashes, verified exactly, with an exact fallback)
      or "exact" (O(G²·L) comparisons; for tests and as the reference).

  Returns:
    A `PrefixTree` with the same leading dimensions.
  """
  tokens, mask = as_tokens_and_mask(tokens, mask)
  return _build(tokens, mask, method)


def build_from_keys(keys, mask, *, method: str = "blocked", node_tokens=None) -> PrefixTree:
  """`build`, but positions share a node iff their `keys` prefixes agree.

  `build` uses the tokens as keys. Explicit (sampled) trees use keys that name
  the sampled node each token belongs to (`explicit.py`); `node_tokens`
  [..., G, L] then fills `PrefixTree.node_token` (default: the keys).
  """
  if method not in ("blocked", "exact"):
    raise ValueError(f"unknown method {method!r}; choose 'blocked' or 'exact'.")
  batch, (g, l) = keys.shape[:-2], keys.shape[-2:]
  keys = keys.reshape((-1, g, l)).astype(jnp.int32)
  mask = mask.reshape((-1, g, l))
  lengths = jnp.min(jnp.where(mask, l, jnp.arange(l)), axis=-1)  # cut at a first hole
  mask = jnp.arange(l) < lengths[..., None]
  node_tokens = keys if node_tokens is None else node_tokens.reshape((-1, g, l))

  if method == "exact":
    order, adj, _ = _exact_trie_order(keys, mask, lengths)
  else:
    order, adj, ok = jax.vmap(_trie_order)(keys, lengths,
                                            jax.vmap(lcp_lib.lcp_blocked)(keys, mask))
    order, adj = _repair(keys, mask, lengths, order, adj, ok)
  tree = jax.vmap(_tree_from_trie_order)(mask, lengths, order, adj, node_tokens)
  return jax.tree.map(lambda x: x.reshape(batch + x.shape[1:]), tree)


def _exact_trie_order(keys, mask, lengths):
  """[N, G, L] groups -> (order, adj, ok) from exact lcps."""
  return jax.vmap(_trie_order)(keys, lengths, jax.vmap(lcp_lib.lcp_exact)(keys, mask))


@jax.custom_batching.custom_vmap
def _repair(keys, mask, lengths, order, adj, ok):
  """Redoes the batch of [N, G, L] groups exactly if any hashed order failed its check.

  A `cond` over the whole batch; the exact branch runs only on a hash
  collision. The custom vmap rule keeps it so under a user's `vmap` (where a
  plain cond would become a select that always runs the exact branch).
  """
  return jax.lax.cond(jnp.all(ok), lambda: (order, adj),
                      lambda: _exact_trie_order(keys, mask, lengths)[:2])


@_repair.def_vmap
def _repair_vmap(axis_size, in_batched, *args):
  args = [x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
          for x, batched in zip(args, in_batched)]
  out = _repair(*[x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]) for x in args])
  n = args[0].shape[1]
  return tuple(y.reshape((axis_size, n) + y.shape[1:]) for y in out), (True, True)


def _shift_right(x, fill):
  """x[..., t - 1] at t, `fill` at t = 0."""
  return jnp.concatenate([jnp.full(x.shape[:-1] + (1,), fill, x.dtype), x[..., :-1]], axis=-1)


def _trie_order(keys, lengths, lcp):
  """One group's trie order from lcp [G, G], which may be over-estimated.

  Returns:
    order [G], the responses in trie order; adj [G - 1], the lcp of each
    adjacent pair in it; and whether an exact check confirmed both: each
    adjacent pair agrees before its lcp and is strictly ordered at it.
  """
  g, l = keys.shape
  index, position = jnp.arange(g), jnp.arange(l)
  # g before h iff g's key at their first difference is smaller, or g ends
  # there and h does not, or they are identical and g < h.
  at = jnp.take_along_axis(keys, jnp.minimum(lcp, l - 1), axis=1)  # keys[g, lcp[g, h]]
  ended = lcp >= lengths[:, None]
  before = jnp.where(ended | ended.T,
                     ended & (~ended.T | (index[:, None] < index[None, :])),
                     at < at.T)
  order = jnp.argsort(jnp.sum(before, axis=0) * g + index).astype(jnp.int32)

  keys_s, len_s = keys[order], lengths[order]
  adj = lcp[order[:-1], order[1:]]
  agree = jnp.all((keys_s[:-1] == keys_s[1:]) | (position[None] >= adj[:, None]))
  col = jnp.minimum(adj, l - 1)[:, None]
  at_a = jnp.take_along_axis(keys_s[:-1], col, axis=1)[:, 0]
  at_b = jnp.take_along_axis(keys_s[1:], col, axis=1)[:, 0]
  a_ends, b_ends = adj == len_s[:-1], adj == len_s[1:]
  ordered = jnp.where(a_ends, ~b_ends | (order[:-1] < order[1:]), ~b_ends & (at_a < at_b))
  return order, adj, agree & jnp.all(ordered)


def expand_levels(table, level):
  """Per-token values from a per-level table: out[g, t] = table[g, level[t]].

  table: [G, levels]; level: int [L]. One column gather with indices shared by
  all rows (several times faster here than a one-hot matmul or a per-element gather).
  """
  return jnp.take(table, level, axis=1)


def _tree_from_trie_order(mask, lengths, order, adj, node_tokens):
  """One group's `PrefixTree` from its trie order and adjacent lcps."""
  g, l = mask.shape
  num_nodes = 1 + g * l
  k, position = jnp.arange(g), jnp.arange(l)

  # Level of position t: how many adjacent lcps are <= t. Within a level the
  # set of cuts between trie-adjacent rows is fixed, so every node run is too.
  thresholds = jnp.sort(adj)  # [G - 1]
  level = jnp.sum(thresholds[None, :] <= position[:, None], axis=1, dtype=jnp.int32)  # [L]
  at_level = jnp.concatenate([jnp.array([-1], adj.dtype), thresholds])  # [G] a t in each level
  cut_before = (k[None] == 0) | (jnp.pad(adj, (1, 0))[None] <= at_level[:, None])  # [lvl, k]
  cut_after = (k[None] == g - 1) | (jnp.pad(adj, (0, 1))[None] <= at_level[:, None])
  first_s = jax.lax.cummax(jnp.where(cut_before, k[None], 0), axis=1)  # [lvl, k]
  last_s = jax.lax.cummin(jnp.where(cut_after, k[None], g - 1), axis=1, reverse=True)
  rank = jnp.argsort(order)
  run_first, run_last = first_s[:, rank].T, last_s[:, rank].T  # [G, lvl], input row order

  first = jnp.where(mask, expand_levels(run_first, level), 0).astype(jnp.int32)
  last = jnp.where(mask, expand_levels(run_last, level), 0).astype(jnp.int32)
  count = jnp.where(mask, expand_levels(run_last - run_first + 1, level), 0).astype(jnp.int32)
  node = jnp.where(mask, 1 + first * l + position, num_nodes)

  # Per-node arrays, in trie order (node 1 + k·L + t).
  mask_s, first_t, count_s, node_s = mask[order], first[order], count[order], node[order]
  owns = mask_s & (first_t == k[:, None])
  flat = lambda x, root: jnp.concatenate([jnp.array([root], jnp.int32), x.reshape(-1)])
  return PrefixTree(
      mask=mask,
      node=node,
      parent=jnp.where(mask, _shift_right(node, 0), num_nodes),
      count=count,
      branches=mask & (_shift_right(count, g) > count),
      first=first,
      last=last,
      order=order,
      level=level,
      run_first=run_first.astype(jnp.int32),
      run_last=run_last.astype(jnp.int32),
      lcp=_exact_lcp_from_adjacent(adj, lengths[order])[rank][:, rank],
      node_count=flat(jnp.where(owns, count_s, 0), g),
      node_parent=flat(jnp.where(owns, _shift_right(node_s, 0), num_nodes), num_nodes),
      node_depth=flat(jnp.where(owns, position + 1, 0), 0),
      node_token=flat(jnp.where(owns, node_tokens[order], -1), -1),
  )


def _exact_lcp_from_adjacent(adj, lengths):
  """lcp in trie order: the minimum of the adjacent lcps between two rows. [G-1], [G] -> [G, G]."""
  g = lengths.shape[0]
  big = jnp.iinfo(jnp.int32).max
  i, j = jnp.meshgrid(jnp.arange(g), jnp.arange(g), indexing="ij")
  # run_min[i, j] = min(adj[i:j]) for j > i.
  steps = jnp.where(jnp.arange(g - 1)[None, :] >= i[:, :1], adj[None, :], big)  # [G, G-1]
  run_min = jax.lax.cummin(steps, axis=1)  # min(adj[i:j+1])
  upper = jnp.pad(run_min, ((0, 0), (1, 0)), constant_values=big)  # at j: min(adj[i:j])
  lcp = jnp.where(j > i, upper, upper.T)
  return jnp.where(i == j, lengths[:, None], lcp).astype(jnp.int32)
