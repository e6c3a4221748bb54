"""Shared-prefix lengths between the responses of a group.

`lcp[g, h]` is the length of the longest common prefix of responses g and h,
counting only unmasked positions (so `lcp[g, g]` is response g's length). The
prefix tree follows from it (`prefix_tree.py`).

- `lcp_blocked`: hashes blocks of `block` keys, finds each pair's first
  differing block from the hashes and compares keys exactly inside it:
  O(G·L + G²·(L/block + block)) work. Equal blocks always hash equal, so an
  entry can only be too large, and only on a 32-bit hash collision;
  `prefix_tree.build` verifies the result exactly and falls back to
  `lcp_exact` when it finds one.
- `lcp_exact`: key-by-key comparison, O(G²·L), one row at a time.
"""

import jax
import jax.numpy as jnp

BLOCK = 32


def mix32(x):
  """murmur3's 32-bit finaliser: a bijection on uint32 with good avalanche."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def lcp_blocked(keys, mask, block: int = BLOCK):
  """Shared-prefix lengths from block hashes. [G, L] int, [G, L] bool -> int32 [G, G]."""
  g, l = keys.shape
  block = min(block, l)
  pad = -l % block
  keys = jnp.pad(jnp.where(mask, keys, -1), ((0, 0), (0, pad)), constant_values=-1)
  blocks = keys.reshape(g, -1, block)  # [G, nb, b]
  position = jnp.arange(l + pad, dtype=jnp.uint32).reshape(-1, block)
  words = mix32(blocks.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + position)
  hashes = jnp.sum(words, axis=-1, dtype=jnp.uint32)  # [G, nb]
  # First block where g and h differ (by hash), then the first differing key in it.
  same_block = hashes[:, None, :] == hashes[None, :, :]  # [G, G, nb]
  num_blocks = blocks.shape[1]
  first_block = jnp.min(jnp.where(same_block, num_blocks - 1, jnp.arange(num_blocks)), axis=-1)
  mine = jnp.take_along_axis(blocks, first_block[:, :, None], axis=1)  # blocks[g, fb[g, h]]
  same_key = mine == jnp.swapaxes(mine, 0, 1)  # [G, G, b]; fb is symmetric.
  offset = jnp.min(jnp.where(same_key, block, jnp.arange(block)), axis=-1)
  lengths = jnp.sum(mask, axis=-1, dtype=jnp.int32)
  return jnp.minimum(first_block * block + offset,
                     jnp.minimum(lengths[:, None], lengths[None, :])).astype(jnp.int32)


def lcp_exact(keys, mask):
  """Shared-prefix lengths by exact comparison. [G, L], [G, L] -> int32 [G, G]."""

  def row(args):
    key, m = args
    same = (keys == key[None]) & mask & m[None]
    return jnp.sum(jnp.cumprod(same, axis=-1), axis=-1, dtype=jnp.int32)

  return jax.lax.map(row, (keys, mask))
