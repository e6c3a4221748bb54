"""Explicit trees from a branching sampler's parent pointers.

A branching sampler returns full responses [..., G, L] plus, per response, the
response it forked from (`parent`, -1 for a root chain, always < g) and how
many leading tokens it copied from that parent (`fork`). Two responses share a
node at position t iff they share the *sampled* path there, even where two
siblings happened to draw the same token, which a prefix tree of the tokens
would merge. The result is the same `PrefixTree`, so sampled trees and trees
recovered from i.i.d. groups go through the same estimators.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from trees.prefix_tree import PrefixTree, as_tokens_and_mask, build_from_keys


def owners(parent, fork, num_tokens: int):
  """owner[g, t]: the response whose sampling produced g's token t. [G], [G] -> [G, L].

  Pointer doubling over the fork chains: O(G·L·log G).
  """
  g = parent.shape[0]
  index = jnp.arange(g)
  own = (jnp.arange(num_tokens)[None] >= fork[:, None]) | (parent[:, None] < 0)
  owner = jnp.where(own, index[:, None], parent[:, None])
  for _ in range(max(1, int(np.ceil(np.log2(max(g, 2)))))):
    owner = jnp.take_along_axis(owner, owner, axis=0)  # owner[owner[g, t], t]
  return owner


@jax.jit
def _from_forks(tokens, mask, parent, fork):
  batch, (g, l) = tokens.shape[:-2], tokens.shape[-2:]
  keys = jax.vmap(functools.partial(owners, num_tokens=l))(parent.reshape(-1, g),
                                                           fork.reshape(-1, g))
  return build_from_keys(keys.reshape(batch + (g, l)), mask, node_tokens=tokens)


def from_forks(tokens, mask, parent, fork) -> PrefixTree:
  """The sampled tree of a branching sampler's responses.

  Args:
    tokens: int [..., G, L] full responses (copied prefixes included).
    mask: bool [..., G, L], one run from position 0.
    parent: int [..., G], the response each one forked from (< g), -1 for roots.
    fork: int [..., G], leading tokens copied from the parent (0 for roots), at
      most the parent's and the response's own length; the copied tokens must
      equal the parent's.

  Returns:
    A `PrefixTree` whose nodes are the sampled nodes; `node_token` holds tokens.

  Raises ValueError on malformed input (values checked only when concrete).
  """
  tokens, mask = as_tokens_and_mask(tokens, mask)
  parent, fork = _index_array(parent, "parent"), _index_array(fork, "fork")
  if parent.shape != tokens.shape[:-1] or fork.shape != tokens.shape[:-1]:
    raise ValueError(f"parent {parent.shape} and fork {fork.shape} must be [..., G] = "
                     f"{tokens.shape[:-1]}.")
  if not _traced(parent, fork):
    if _traced(tokens, mask):
      _check_forks(np.asarray(parent), np.asarray(fork), tokens.shape[-1])
    else:
      check_edges(np.asarray(tokens), np.asarray(mask), np.asarray(parent), np.asarray(fork))
  return _from_forks(tokens, mask, jnp.asarray(parent, jnp.int32), jnp.asarray(fork, jnp.int32))


def check_edges(tokens, mask, parent, fork):
  """Raises ValueError unless (parent, fork) are the edges `from_forks` accepts for these
  concrete responses (numpy arrays, [..., G, L] and [..., G])."""
  _check_forks(parent, fork, tokens.shape[-1])
  _check_copied_prefixes(tokens, mask, parent, fork)


def _traced(*xs):
  return any(isinstance(x, jax.core.Tracer) for x in xs)


def _index_array(x, name):
  """`x` as an array of integers, checked before any cast to int32 (which would
  truncate floats and wrap 64-bit values)."""
  x = x if isinstance(x, jax.Array) else np.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be integers; got dtype {x.dtype}.")
  return x


def _at(index):
  return ", ".join(str(int(i)) for i in index)


def _check_forks(p, f, num_tokens: int):
  """parent in [-1, g), fork in [0, L], and 0 for roots. [..., G] each."""
  g = np.arange(p.shape[-1])
  bad = (p >= g) | (p < -1)
  if bad.any():
    at = np.argwhere(bad)[0]
    raise ValueError(f"parent[g] must be -1 (a root) or the index of an earlier response; "
                     f"got parent[{_at(at)}] = {p[tuple(at)]} for response {at[-1]}.")
  bad = (f < 0) | (f > num_tokens)
  if bad.any():
    at = np.argwhere(bad)[0]
    raise ValueError(f"fork must be in [0, L] = [0, {num_tokens}]; got fork[{_at(at)}] = "
                     f"{f[tuple(at)]}.")
  bad = (p < 0) & (f != 0)
  if bad.any():
    at = np.argwhere(bad)[0]
    raise ValueError(f"a root (parent -1) copies nothing, so its fork must be 0; got "
                     f"fork[{_at(at)}] = {f[tuple(at)]}.")


def _check_copied_prefixes(tokens, mask, p, f):
  """Each response's first fork[g] tokens are tokens of its parent's, and its own."""
  lengths = mask.sum(-1)
  has = p >= 0
  q = np.maximum(p, 0)
  parent_len = np.take_along_axis(lengths, q, axis=-1)
  for bad, what in (((f > lengths), "the response itself"),
                    (has & (f > parent_len), "its parent")):
    if bad.any():
      at = tuple(np.argwhere(bad)[0])
      n = lengths[at] if what == "the response itself" else parent_len[at]
      raise ValueError(
          f"fork[{_at(at)}] = {f[at]}: response {at[-1]} claims {f[at]} tokens copied from "
          f"response {p[at]}, but {what} has only {n} tokens.")
  parent_tokens = np.take_along_axis(tokens, q[..., None], axis=-2)
  copied = has[..., None] & (np.arange(tokens.shape[-1]) < f[..., None])
  differ = copied & (tokens != parent_tokens)
  if differ.any():
    at = tuple(np.argwhere(differ)[0])
    row, t = at[:-1], at[-1]
    prow = row[:-1] + (p[row],)
    raise ValueError(
        f"fork[{_at(row)}] = {f[row]}: response {row[-1]} claims {f[row]} tokens copied from "
        f"response {p[row]}, but they first differ at position {t}: "
        f"tokens[{_at(row + (t,))}] = {tokens[at]} != tokens[{_at(prow + (t,))}] = "
        f"{tokens[prow + (t,)]}.")
