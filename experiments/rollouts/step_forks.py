"""Rollout trees forked at reasoning-step boundaries (boundary j of a response: the position
after its j-th step end, j = 0 its start; only boundaries inside its reasoning, `probe_cuts`).
Rounds are host-side steps of jitted stages; the task's reward and step ends are passed in
as functions. Children come after their sources, parent = the source's index in the group,
fork = the boundary's position, so the samples are a tree (`trees.from_forks`).

'tree_bisect', a binary-search rollout tree (ELPO, #39: locate each failed chain's first
irrecoverable step): N i.i.d. chains, then R rounds. In each round every chain forks C
continuations at one of its boundaries, chosen by a binary search over
[lo, hi] that starts at lo = −1 (the prompt: recoverable), hi = S_n + 1 (the end):
mid = clip(⌊(lo + hi) / 2⌋, 0, S_n). If one of the C continuations succeeds (reward ≥
`success`), the boundary is recoverable and lo = mid, else hi = mid. After R rounds the
first irrecoverable step of a failed chain is between boundaries lo and hi. A chain that
succeeded is searched too (its outcomes only add samples to the tree). G = N (1 + R C):
chains first, then round r's children ordered (chain, continuation); parent = the chain,
fork = the boundary's position: the tree's prefix values say, at every searched boundary,
whether the chain could still succeed.

'tree_steps', a multi-level step tree (TreePS-RAG, #181): N chains; at level ℓ = 1 .. D
every response so far forks C continuations at its own ℓ-th boundary (one that has none is
re-sampled from the start), G = N (1 + C)^D. Each boundary's Monte Carlo value (the mean
outcome of the responses through it) then averages over the subtree below it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.rollouts import sampling
from experiments.training.probes import probe_cuts


def group_size(num_chains: int, num_rounds: int, num_continuations: int) -> int:
  """'tree_bisect''s G."""
  return num_chains * (1 + num_rounds * num_continuations)


def step_tree_size(num_chains: int, num_levels: int, num_continuations: int) -> int:
  """'tree_steps''s G."""
  return num_chains * (1 + num_continuations) ** num_levels


@jax.jit
def bisect_mid(lo, hi, last):
  """[B, N] boundary indices to probe: ⌊(lo + hi) / 2⌋ clipped into [0, last]."""
  return jnp.clip((lo + hi) // 2, 0, last)


@jax.jit
def bisect_update(lo, hi, mid, recoverable):
  """(lo, hi) after probing `mid`: a recoverable boundary moves lo up, else hi down."""
  return jnp.where(recoverable, mid, lo), jnp.where(recoverable, hi, mid)


def sample_bisect(params, cfg, key, prompts, num_chains: int, num_rounds: int,
                  num_continuations: int, max_new_tokens: int, *, reward_fn, ends_fn,
                  num_steps: int, success: float = 1.0, temperature=1.0, top_p=1.0, top_k=0,
                  eos_id=None, pad_id: int = 0, prompt_len=None, prompt_ids=None):
  """Samples [B, G, L], G = N (1 + R C), and the search's final (lo, hi) [B, N].
  `reward_fn(tokens, mask)` -> [B, n] rewards of [B, n, L] responses; `ends_fn(tokens,
  mask)` -> bool [B, n, L] their step ends; `num_steps` S, the task's reasoning steps."""
  prompts, prompt_len, prompt_ids, knobs = sampling._inputs(
      cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p)
  b, l, n, c = prompts.shape[0], max_new_tokens, num_chains, num_continuations
  state = sampling._chains(params, cfg, key, prompts, prompt_len, prompt_ids, knobs, n, l,
                           eos_id, pad_id)
  chains = sampling._to_samples(state, b)
  cuts, ok = _boundaries(ends_fn(chains.tokens, chains.mask), chains.mask, num_steps)
  last = jnp.sum(ok, -1) - 1  # S_n: the last boundary inside the chain's reasoning
  lo, hi = jnp.full((b, n), -1, jnp.int32), last + 1
  out = chains
  for r in range(num_rounds):
    mid = bisect_mid(lo, hi, last)
    pos = jnp.take_along_axis(cuts, mid[..., None], -1)[..., 0]  # [B, N]
    _, ks = _fork_round(params, cfg, key, prompt_ids, state, pos, n + r * n * c, c, knobs,
                        eos_id, pad_id)
    won = jnp.any(reward_fn(ks.tokens, ks.mask).reshape(b, n, c) >= success, -1)
    lo, hi = bisect_update(lo, hi, mid, won)
    out = sampling._concat(out, ks)
  return out, (lo, hi)


@functools.partial(jax.jit, static_argnums=2)
def _boundaries(ends, mask, num_steps):
  return probe_cuts(ends, mask, num_steps)


def _fork_round(params, cfg, key, prompt_ids, state, pos, first_id: int, c: int, knobs,
                eos_id, pad_id):
  """C continuations of each of the B·n rows of `state` from its position `pos` [B, n],
  decoded to the end with the uniform streams first_id, first_id + 1, ...: (their Rollout,
  their `Samples` [B, n·C, L] with parent = the source row's index, fork = pos)."""
  b, n = pos.shape
  l = state.tokens.shape[1]
  u = sampling._uniforms_jit(key, prompt_ids, first_id + np.arange(n * c, dtype=np.int32),
                             length=l)
  rows = jnp.asarray(np.repeat(np.arange(b * n, dtype=np.int32), c))  # prompt-major sources
  kids = sampling._fork(state, rows, jnp.repeat(pos, c, axis=1).reshape(-1),
                        u.reshape(b * n * c, l), pad_id=pad_id)
  kids = sampling._decode(params, kids, l, knobs, cfg=cfg, eos_id=eos_id)
  parent = jnp.broadcast_to(jnp.repeat(jnp.arange(n, dtype=jnp.int32), c), (b, n * c))
  return kids, sampling.to_samples(kids, b, parent, jnp.repeat(pos, c, axis=1))


@functools.partial(jax.jit, static_argnums=2)
def _concat_rows(a, c, b: int):
  """Two Rollouts of B·n_a and B·n_c prompt-major rows as one of B·(n_a + n_c), each prompt's
  rows of `a` first (the rows' caches too; shared prompts of a cascade cache are a's)."""
  split = lambda x, axis: x.reshape(x.shape[:axis] + (b, -1) + x.shape[axis + 1:])
  join = lambda x, y, axis: jnp.concatenate([split(x, axis), split(y, axis)], axis + 1).reshape(
      x.shape[:axis] + (-1,) + x.shape[axis + 1:])
  rows = jax.tree.map(lambda x, y: join(x, y, 0), a.replace(cache=None), c.replace(cache=None))
  return rows.replace(cache=sampling.map_cache_rows(lambda x, y: join(x, y, 1), a.cache,
                                                    c.cache))


def sample_step_tree(params, cfg, key, prompts, num_chains: int, num_levels: int,
                     num_continuations: int, max_new_tokens: int, *, ends_fn,
                     num_steps: int, temperature=1.0, top_p=1.0, top_k=0, eos_id=None,
                     pad_id: int = 0, prompt_len=None, prompt_ids=None):
  """Samples [B, G, L], G = N (1 + C)^D: the 'tree_steps' sampler (module docstring).
  `ends_fn(tokens, mask)` -> bool [B, n, L] step ends of [B, n, L] responses."""
  if not 1 <= num_levels <= num_steps:
    raise ValueError(f'tree_steps num_levels must be in [1, {num_steps}] (the task\'s '
                     f'reasoning steps); got {num_levels}')
  prompts, prompt_len, prompt_ids, knobs = sampling._inputs(
      cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p)
  b, l, c = prompts.shape[0], max_new_tokens, num_continuations
  state = sampling._chains(params, cfg, key, prompts, prompt_len, prompt_ids, knobs,
                           num_chains, l, eos_id, pad_id)
  out = sampling._to_samples(state, b)
  for level in range(1, num_levels + 1):
    n = out.tokens.shape[1]
    cuts, ok = _boundaries(ends_fn(out.tokens, out.mask), out.mask, num_steps)
    pos = jnp.where(ok[..., level], cuts[..., level], 0)  # [B, n]
    kids, ks = _fork_round(params, cfg, key, prompt_ids, state, pos, n, c, knobs, eos_id,
                           pad_id)
    out = sampling._concat(out, ks)
    if level < num_levels:
      state = _concat_rows(state, kids, b)
  return out
