"""Hypothesis strategies (rollout groups whose responses share prefixes) and a plain GRPO reference."""

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


@st.composite
def sampled_trees(draw, sizes=(1, 4, 7), length=6, max_vocab=3, batch=2):
  """A branching sampler's output: (tokens [B, G, L], mask, rewards [B, G], parent
  [B, G], fork [B, G]). Response g forks from a random earlier one (or is a root),
  copies its first `fork` tokens (fork <= the parent's length) and samples the
  rest; siblings often draw equal tokens, which only the sampled tree tells apart.
  """
  g = draw(st.sampled_from(sizes))
  vocab = draw(st.integers(1, max_vocab))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  tokens = rng.integers(0, vocab, (batch, g, length)).astype(np.int32)
  lengths = np.zeros((batch, g), np.int64)
  parent = np.full((batch, g), -1, np.int32)
  fork = np.zeros((batch, g), np.int32)
  for b in range(batch):
    for i in range(g):
      if i > 0 and rng.random() < 0.8:
        parent[b, i] = rng.integers(0, i)
        fork[b, i] = rng.integers(0, lengths[b, parent[b, i]] + 1)
        tokens[b, i, :fork[b, i]] = tokens[b, parent[b, i], :fork[b, i]]
      lengths[b, i] = rng.integers(max(fork[b, i], 1 if rng.random() < 0.9 else 0), length + 1)
  mask = np.arange(length) < lengths[..., None]
  tokens = np.where(mask, tokens, 0).astype(np.int32)
  kind = draw(st.sampled_from(["binary", "graded", "equal"]))
  if kind == "binary":
    rewards = (rng.random((batch, g)) < 0.5).astype(np.float32)
  elif kind == "graded":
    rewards = rng.integers(0, 5, (batch, g)).astype(np.float32) / 4
  else:
    rewards = np.full((batch, g), 0.3, np.float32)
  return tokens, mask, rewards, parent, fork


def grpo_ref(rewards, scale_by_std=True):
  """GRPO per response [..., G] -> [..., G] with plain loops (float64), credit.outcome.grpo's
  conventions: (R − μ)/(σ + 1e-6) with Bessel σ (no division with `scale_by_std` False),
  all-equal rewards give 0, a group of one is R (over 1 + 1e-6 when scaling)."""
  rewards = np.asarray(rewards, np.float64)
  out = np.zeros_like(rewards)
  for idx in np.ndindex(rewards.shape[:-1]):
    r = rewards[idx]
    if len(r) == 1:
      out[idx] = r / (1 + 1e-6) if scale_by_std else r
    elif r.max() > r.min():
      out[idx] = (r - r.mean()) / ((r.std(ddof=1) + 1e-6) if scale_by_std else 1.0)
  return out


def outcome_rollouts(seed: int, shape=(2, 3), length: int = 4):
  """(mask [*shape, L], 0/1 rewards [*shape], `credit.Rollouts` of zero tokens) for tests of
  estimators that read only the outcome and the mask."""
  import credit  # noqa: PLC0415 (tests/ helpers stay importable without jax set up)
  import jax.numpy as jnp  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  mask = np.arange(length) < rng.integers(0, length + 1, shape)[..., None]
  rewards = rng.integers(0, 2, shape).astype(np.float32)
  return mask, rewards, credit.Rollouts(tokens=jnp.zeros(mask.shape, jnp.int32),
                                        mask=jnp.asarray(mask), rewards=jnp.asarray(rewards))
