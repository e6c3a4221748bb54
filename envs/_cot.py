"""Array helpers shared by the chain-of-thought tasks (scratchpad_addition, countdown_steps).

Per-example functions are written for one response int32 [R] and mapped over any
leading batch dimensions with `over_batch`; responses are split into steps at
separator tokens and each step is read from a fixed-width window.
"""

import jax
import jax.numpy as jnp


def over_batch(fn, batch_shape, *trees):
  """Applies per-example `fn` over leading dims `batch_shape` of every leaf in `trees`.

  Leaves may have size-1 leading dims where the batch has more (they broadcast).
  Returns fn's outputs with leading dims `batch_shape`.
  """
  nb = len(batch_shape)

  def flat(x):
    x = jnp.asarray(x)
    x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[nb:])
    return x.reshape((-1,) + x.shape[nb:])

  out = jax.vmap(fn)(*jax.tree.map(flat, trees))
  return jax.tree.map(lambda y: y.reshape(tuple(batch_shape) + y.shape[1:]), out)


def read(tokens, mask, eos_id):
  """(tokens [R] with -1 where masked out, has_eos bool [], e int32 []): e = first EOS, else R."""
  tokens = jnp.where(mask, tokens, -1)
  is_eos = tokens == eos_id
  has_eos = jnp.any(is_eos)
  e = jnp.where(has_eos, jnp.argmax(is_eos), tokens.shape[-1]).astype(jnp.int32)
  return tokens, has_eos, e


def windows(tokens, starts, width):
  """tokens[starts[s] + w] as int32 [S, width], -1 outside [0, R)."""
  idx = starts[:, None] + jnp.arange(width)
  r = tokens.shape[-1]
  inside = (idx >= 0) & (idx < r)
  return jnp.where(inside, tokens[jnp.clip(idx, 0, r - 1)], -1)


def is_digit(x):
  return (x >= 0) & (x <= 9)


def digits_value(win, lo, hi):
  """Decimal value int32 [...] of digit tokens win[..., lo:hi] (win [..., W]; lo, hi [...]).

  Non-digit tokens count as 0; the caller checks well-formedness and hi - lo <= 9.
  """
  t = jnp.arange(win.shape[-1])
  exp = hi[..., None] - 1 - t
  inside = (t >= lo[..., None]) & (t < hi[..., None])
  power = jnp.where(inside, 10 ** jnp.clip(exp, 0, 9), 0).astype(jnp.int32)
  return jnp.sum(jnp.where(is_digit(win), win, 0) * power, axis=-1).astype(jnp.int32)


def number_tokens(x, width):
  """Decimal digits of x >= 0, MSB first, no leading zeros: (int32 [width], 0-padded; length)."""
  x = jnp.asarray(x, jnp.int32)
  length = 1 + sum((x >= 10**i).astype(jnp.int32) for i in range(1, width))
  t = jnp.arange(width)
  power = 10 ** jnp.clip(length - 1 - t, 0, width - 1)
  return jnp.where(t < length, x // power % 10, 0).astype(jnp.int32), length


def concat(pieces, size, pad_id):
  """Concatenates variable-length pieces [(tokens [w], length), ...] into (int32 [size], total)."""
  width = max(tokens.shape[-1] for tokens, _ in pieces)
  tokens = jnp.stack([jnp.pad(jnp.asarray(x, jnp.int32), (0, width - x.shape[-1]))
                      for x, _ in pieces])
  lengths = jnp.stack([jnp.asarray(n, jnp.int32) for _, n in pieces])
  offsets = jnp.cumsum(lengths) - lengths
  t = jnp.arange(width)
  idx = jnp.where(t < lengths[:, None], offsets[:, None] + t, size)  # out of range: dropped
  out = jnp.full((size,), pad_id, jnp.int32).at[idx.ravel()].set(tokens.ravel(), mode="drop")
  return out, jnp.sum(lengths)


def scatter_credit(credit, positions, size):
  """float32 [size]: credit [S] added at positions [S] (positions outside [0, size) dropped)."""
  out = jnp.zeros((size,), jnp.float32)
  return out.at[positions].add(jnp.asarray(credit, jnp.float32), mode="drop")
