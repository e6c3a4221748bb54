"""SLEA-RL's self-evolving experience library (seed #46): how the library of `envs.experience`
learns from each training batch (sampler 'experience'; the library is checkpointed loop state).

The abstract: "a self-evolving experience library that distills successful strategies and failure
patterns through score-based admission and rate-limited extraction ... through semantic analysis
rather than gradient updates". Our reading, with counting in place of an LLM's analysis: from the
batch's taken, well-formed turns (an end-of-action token), group the turns by (cluster, action)
and take each pair's count n and success rate r (the fraction of its episodes that succeeded).

  evolve    a stored strategy seen again: score ← (1 − η)·score + η·r; evicted when the score
            falls below `admit`. A stored failure pattern is evicted once an episode through it
            succeeds.
  admit     a strategy: n ≥ `min_count` and r ≥ `admit`; a failure pattern: n ≥ `min_count` and
            r = 0 (not the cluster's current strategy). Per slot the best candidate (highest r,
            then n, then the first turn; failure patterns by n) replaces the entry if the slot is
            empty or it is better than what is there (a higher score; a larger count).
  rate      at most `max_new` new entries of each kind per step, the best first.

Defaults: admit 0.5, min_count 2, max_new 32, η = 0.5; `failure_patterns=False` admits strategies
only (an ablation).
"""

import functools

import jax
import jax.numpy as jnp

from envs import experience as exp_env


def _hints(tokens, eoa_id: int, pad_id: int):
  """int32 [N, A-1]: each action's tokens before its first end-of-action, pad after."""
  before = jnp.cumprod(tokens != eoa_id, -1).astype(bool)
  return jnp.where(before, tokens, pad_id)[:, :-1]


def _pick(writer, keys, n: int):
  """bool [N]: the first `n` writers in the lexicographic order of `keys` (primary first)."""
  order = jnp.lexsort(tuple(reversed([~writer] + list(keys))))
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  return writer & (rank < n)


def _slot_winner(cand, slot, keys, slots: int):
  """bool [N]: per slot, the candidate first in the lexicographic order of `keys` (each larger
  is better), ties to the lowest index."""
  win = cand
  for key in keys:
    best = jax.ops.segment_max(jnp.where(win, key, -jnp.inf), slot, slots)
    win = win & (key == best[slot])
  idx = jnp.arange(cand.shape[0])
  first = jax.ops.segment_min(jnp.where(win, idx, cand.shape[0]), slot, slots)
  return win & (idx == first[slot])


@functools.partial(jax.jit, static_argnames=("eoa_id", "pad_id", "min_count", "max_new",
                                             "failure_patterns"))
def update(library: exp_env.Library, clusters, actions, policy, turn_mask, success, *,
           eoa_id: int, pad_id: int, admit: float = 0.5, min_count: int = 2, max_new: int = 32,
           ema: float = 0.5, failure_patterns: bool = True):
  """The library after one batch (module docstring) and its metrics.

  library: no leading dims; clusters int32 [..., G, K+1] (`Turns.state_ids` of an
  `ExperienceEnv`: its clusters); actions int32 [..., G, K, A] (environment tokens) with their
  policy mask; turn_mask bool [..., G, K]; success bool [..., G]. Returns (library, dict of
  float32 scalars: `experience_hit_rate` / `experience_avoid_hit_rate`, the fractions of taken
  turns whose observation showed a strategy / a failure pattern; `experience_tips` /
  `experience_avoids`, entries held after the update).
  """
  slots, a = library.slots, actions.shape[-1]
  k = turn_mask.shape[-1]
  c = clusters[..., :k].reshape(-1)
  toks = jnp.where(policy, actions, pad_id).reshape(-1, a)
  taken = turn_mask.reshape(-1)
  ok = taken & jnp.any(toks == eoa_id, -1)
  won = jnp.broadcast_to(success[..., None], turn_mask.shape).reshape(-1)
  hint = _hints(toks, eoa_id, pad_id)
  n_turns = c.shape[0]
  _, seen, _, seen_avoid = jax.vmap(exp_env.lookup, (None, 0))(library, c)
  per_turn = lambda x: jnp.sum(x & taken) / jnp.maximum(jnp.sum(taken), 1)

  # Pair statistics: turns with the same cluster and action.
  same = (c[:, None] == c[None, :]) & jnp.all(hint[:, None] == hint[None, :], -1)
  same = same & ok[:, None] & ok[None, :]
  count = jnp.sum(same, 1).astype(jnp.float32)
  wins = jnp.sum(same & won[None, :], 1).astype(jnp.float32)
  rate = wins / jnp.maximum(count, 1.0)
  first = ok & (jnp.argmax(same, 1) == jnp.arange(n_turns))

  # Evolve the stored entries seen in this batch.
  def seen_stats(key, acts, held):
    m = (held[:, None] & ok[None, :] & (key[:, None] == c[None, :])
         & jnp.all(acts[:, None] == hint[None, :], -1))
    return jnp.sum(m, 1).astype(jnp.float32), jnp.sum(m & won[None, :], 1).astype(jnp.float32)

  tip_held = library.tip_score >= 0
  n_tip, w_tip = seen_stats(library.tip_key, library.tip, tip_held)
  score = jnp.where(n_tip > 0, (1 - ema) * library.tip_score + ema * w_tip / jnp.maximum(n_tip, 1),
                    library.tip_score)
  score = jnp.where(tip_held & (score < admit), -1.0, score)
  avoid_held = library.avoid_count >= 0
  _, w_avoid = seen_stats(library.avoid_key, library.avoid, avoid_held)
  avoid_count = jnp.where(avoid_held & (w_avoid > 0), -1.0, library.avoid_count)

  # Admission: per slot the best candidate, if better than the entry there.
  slot = exp_env.slot_of(c, slots)
  idx = jnp.arange(n_turns).astype(jnp.float32)
  is_tip = ((score[slot] >= 0) & (library.tip_key[slot] == c)
            & jnp.all(library.tip[slot] == hint, -1))
  is_avoid = ((avoid_count[slot] >= 0) & (library.avoid_key[slot] == c)
              & jnp.all(library.avoid[slot] == hint, -1))
  tip_cand = first & (count >= min_count) & (rate >= admit) & ~is_tip
  tip_win = _slot_winner(tip_cand, slot, (rate, count), slots)
  tip_write = tip_win & ((score[slot] < 0) | (rate > score[slot]))
  tip_write = _pick(tip_write, (-rate, -count, idx), max_new)
  avoid_cand = (first & (count >= min_count) & (wins == 0) & ~is_tip & ~is_avoid
                & failure_patterns)
  avoid_win = _slot_winner(avoid_cand, slot, (count,), slots)
  avoid_write = avoid_win & ((avoid_count[slot] < 0) | (count > avoid_count[slot]))
  avoid_write = _pick(avoid_write, (-count, idx), max_new)

  at = lambda write: jnp.where(write, slot, slots)  # out of range: dropped
  put = lambda x, write, v: x.at[at(write)].set(v, mode='drop')
  new = exp_env.Library(
      tip_key=put(library.tip_key, tip_write, c), tip=put(library.tip, tip_write, hint),
      tip_score=put(score, tip_write, rate),
      avoid_key=put(library.avoid_key, avoid_write, c),
      avoid=put(library.avoid, avoid_write, hint),
      avoid_count=put(avoid_count, avoid_write, count))
  metrics = dict(experience_hit_rate=per_turn(seen),
                 experience_avoid_hit_rate=per_turn(seen_avoid),
                 experience_tips=jnp.sum(new.tip_score >= 0).astype(jnp.float32),
                 experience_avoids=jnp.sum(new.avoid_count >= 0).astype(jnp.float32))
  return new, metrics
