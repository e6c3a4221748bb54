"""Segments: the maximal runs of a response's tokens between branch points.

Segment-level tree methods (SPO, TreeRL, TreeRPO) give every token of a
segment the credit of the segment's edge. A segment starts at a token t where
`tree.branches[g, t]` (the state before it has two or more children) or at
t = 0, and runs to the token before the next such start. Inside a segment
nothing branches, so token-level node values are constant along it.
"""

import jax
import jax.numpy as jnp

from trees.prefix_tree import PrefixTree


def segment_start(tree: PrefixTree):
  """int32 [..., G, L]: the position where token t's segment starts (0 on masked tokens)."""
  positions = jnp.arange(tree.max_len, dtype=jnp.int32)
  starts = jnp.where(tree.branches & tree.mask, positions, 0)
  return jnp.where(tree.mask, jax.lax.cummax(starts, axis=starts.ndim - 1), 0)


def segment_fill(tree: PrefixTree, x):
  """x[..., g, segment_start(g, t)] at every token: each segment takes the value
  at its first token. float [..., G, L] -> [..., G, L], 0 on masked tokens."""
  x = jnp.asarray(x)
  filled = jnp.take_along_axis(x, segment_start(tree), axis=-1)
  return jnp.where(tree.mask, filled, jnp.zeros((), x.dtype))
