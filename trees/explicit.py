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

from trees.prefix_tree import PrefixTree, build_from_keys, check_tokens_and_mask


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
    fork: int [..., G], leading tokens copied from the parent (0 for roots).

  Returns:
    A `PrefixTree` whose nodes are the sampled nodes; `node_token` holds tokens.
  """
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  parent, fork = jnp.asarray(parent, jnp.int32), jnp.asarray(fork, jnp.int32)
  check_tokens_and_mask(tokens, mask)
  if parent.shape != tokens.shape[:-1] or fork.shape != tokens.shape[:-1]:
    raise ValueError(f"parent {parent.shape} and fork {fork.shape} must be [..., G] = "
                     f"{tokens.shape[:-1]}.")
  if not isinstance(parent, jax.core.Tracer):
    p, f = np.asarray(parent), np.asarray(fork)
    if np.any(p >= np.arange(p.shape[-1])) or np.any(p < -1):
      raise ValueError("parent[g] must be -1 (a root) or the index of an earlier response.")
    if np.any(f < 0) or np.any(f > tokens.shape[-1]):
      raise ValueError("fork must be in [0, L].")
  return _from_forks(tokens, mask, parent, fork)
