"""Hypothesis strategies: rollout groups whose responses share prefixes."""

import numpy as np
from hypothesis import strategies as st


@st.composite
def groups(draw, sizes=(1, 2, 3, 6, 16), lengths=(1, 5, 12), max_vocab=4, batch=()):
  """(tokens int32 [*batch, G, L], mask bool [*batch, G, L], rewards float32 [*batch, G]).

  G and L come from short lists so that jit compiles only a few shapes. Each response copies a random-length prefix of an earlier one, then draws
  from a small vocabulary; lengths are ragged (zero allowed); duplicates and
  responses that are prefixes of others occur often.
  """
  g = draw(st.sampled_from(sizes))  # few distinct shapes: each one compiles once
  l = draw(st.sampled_from(lengths))
  vocab = draw(st.integers(1, max_vocab))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  shape = tuple(batch) + (g, l)
  tokens = rng.integers(0, vocab, shape).astype(np.int32)
  flat = tokens.reshape(-1, g, l)
  for b in range(flat.shape[0]):
    for i in range(1, g):
      src, cut = rng.integers(0, i), rng.integers(0, l + 1)
      flat[b, i, :cut] = flat[b, src, :cut]
  lengths = rng.integers(0, l + 1, shape[:-1])
  if draw(st.booleans()):
    lengths = np.maximum(lengths, l - 1)
  mask = np.arange(l) < lengths[..., None]
  kind = draw(st.sampled_from(["binary", "real", "equal"]))
  if kind == "binary":
    rewards = (rng.random(shape[:-1]) < 0.5).astype(np.float32)
  elif kind == "real":
    rewards = rng.normal(size=shape[:-1]).astype(np.float32)
  else:
    rewards = np.full(shape[:-1], 0.3, np.float32)
  return flat.reshape(shape), mask, rewards
