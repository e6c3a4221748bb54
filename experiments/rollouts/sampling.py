"""I.i.d. and tree-structured samplers with prefix KV-cache reuse (jitted).

Output `Samples` are [B, G, L]: B prompts, G responses per prompt, L = max_new_tokens.

Conventions
  * `logprobs` / `entropy` are under the model's UNTEMPERED distribution
    (temperature 1, no top-k / top-p), whatever was used for sampling: this is
    what PPO/GRPO ratios against `decoder.token_logprobs` need.
  * `mask[b, g, t]` is True on generated tokens up to and including the first EOS
    (a prefix run from t = 0; all True if no EOS). After it tokens are `pad_id`
    and logprobs / entropy are 0.
  * Tree: `parent[b, g]` is the response g forked from, -1 for a root chain;
    `fork[b, g]` is the number of leading response tokens g copied (not sampled)
    from its parent, 0 for roots. Always parent < g,
    tokens[g, :fork] == tokens[parent, :fork] (logprobs too) and
    0 <= fork <= length(parent) (length = mask.sum()).
  * Randomness: response g of prompt b owns the key
        node_key = fold_in(fold_in(key, prompt_ids[b]), g)
    and token t (t >= fork[g]; earlier ones are copied) is drawn by inverse-CDF
    sampling with u = uniform(node_key, (L,))[t], so a branch does not depend on
    the batch layout. The uniforms are drawn up front (`response_uniforms`),
    so the decode loops contain no PRNG (cheaper to compile and run).
    `prompt_ids` defaults to arange(B); pass stable ids (e.g. dataset indices)
    to make samples invariant to batching and permutation. With the same key,
    the chains of `sample_tree_forks` equal `sample_iid(num_chains)` and leaf 0
    of `sample_tree_fixed` equals response 0 of `sample_iid`.
  * temperature (0 = greedy), top_k, top_p are traced: changing them, or
    prompt_len / prompt_ids, does not recompile. Static: cfg, sizes, eos_id (an
    id or a tuple of stop ids, e.g. a chat model's end-of-turn and end-of-text),
    pad_id, the tree shape and the fork policy.
  * Prompts are right-padded (see models/decoder.py); `prompt_len` [B] gives true lengths
    (None = all P). P + L must be <= cfg.max_len.
  * Decode loops are `lax.while_loop`s of one-token steps over a static-shape KV
    cache that stop as soon as every row has emitted EOS or reached its stop index.

Building blocks (pure, composable): `response_uniforms` (all randomness, up
front), `start` (prefill once per prompt; the cache keeps it once for its responses,
layout 'cascade', or repeats it per response, layout 'rows'), `decode` (one-token steps
until `stop`), `fork` (copy rows and their own caches, truncated at fork positions),
`fork_tree` (layout 'cascade_tree': a tree level's rows and segments),
fork policies returning `(source, position)` arrays, and `to_samples`.

Cache layouts (`LAYOUTS`, a sampler's `layout` argument; None = `DEFAULT_LAYOUT`,
'cascade'): 'cascade' keeps each prompt's keys and values once ([B, P]) and each row's
own tokens per row ([B * G, L]); a decode step attends to both and merges the two
softmax parts exactly by their maxima and sums (`decoder.cascade_attention`, Hydragen),
the prompt part one batched matmul over the G rows that share it. 'rows' gives each row
a whole cache of cfg.max_len slots (the prompt read G times per step). Both give the
same samples up to float rounding (tests/test_cascade_decode.py). 'cascade_tree'
(`sample_tree_fixed` only, `TREE_LAYOUTS`) adds one shared level per tree level
(`decoder.TreeCache`): each node's segment is kept and read once, each row's own slots
hold only its tokens after its last fork (tests/test_tree_cascade.py).
"""

import dataclasses
import functools
import itertools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from experiments.models import decoder


@struct.dataclass
class Samples:
  """Sampled responses; see the module docstring for conventions."""
  tokens: jax.Array    # [B, G, L] int32
  logprobs: jax.Array  # [B, G, L] f32, untempered log p(token)
  entropy: jax.Array   # [B, G, L] f32, untempered entropy at each step
  mask: jax.Array      # [B, G, L] bool
  parent: jax.Array    # [B, G] int32, -1 for roots
  fork: jax.Array      # [B, G] int32, copied prefix length

  @property
  def lengths(self) -> jax.Array:
    """[B, G] int32 number of generated tokens (incl. EOS)."""
    return self.mask.sum(-1).astype(jnp.int32)


@struct.dataclass
class Rollout:
  """Per-row decode state and response buffers; R rows, L = max_new_tokens.

  Row r feeds `token` at position `prompt_len + index - 1` and samples response
  token `index` next, using `uniforms[r, index]`.
  """
  cache: 'decoder.KVCache | decoder.CascadeCache | decoder.TreeCache'  # see `LAYOUTS`
  uniforms: jax.Array     # [R, L] f32, the row's response's uniform stream
  prompt_len: jax.Array   # [R] int32
  prompt_last: jax.Array  # [R] int32, last prompt token
  token: jax.Array        # [R] int32, next token to feed
  index: jax.Array        # [R] int32, response index of next sampled token
  done: jax.Array         # [R] bool, emitted EOS
  tokens: jax.Array       # [R, L] int32
  logprobs: jax.Array     # [R, L] f32
  entropy: jax.Array      # [R, L] f32
  mask: jax.Array         # [R, L] bool


# ----------------------------------------------------------------------------
# Token selection.


# Static size of the candidate set that top-k / top-p filtering takes with lax.top_k.
TOP_CANDIDATES = 256


def filter_logits(logits, temperature=1.0, top_k=0, top_p=1.0, *,
                  max_candidates: int = TOP_CANDIDATES):
  """Tempered, top-k then nucleus-filtered logits [..., V] (dropped = -inf).

  top_k <= 0 or >= V disables top-k; top_p >= 1 disables nucleus filtering,
  which keeps the smallest set of most likely tokens (after top-k,
  renormalized) whose mass reaches top_p, and always the most likely one.
  Ties at a threshold are kept. Needs temperature > 0. The three settings may
  be traced scalars (no recompilation).

  Cost: `lax.top_k` of C = min(V, max_candidates) (static) candidates per row
  instead of a sort over V. The result is always that of a full sort: the
  candidates decide whenever the kept set lies within them, i.e. when
  1 <= top_k <= C, or when top-k is off and the C candidates hold mass >= top_p
  (under the tempered softmax over all V); otherwise (C < top_k < V, or a
  nucleus wider than C tokens) a full sort over V runs instead, for the whole
  batch if any row needs it (a `lax.cond`). The cumulative mass is summed in
  another order than a full sort's, so a token whose mass-before lies within
  float rounding (~1e-7) of top_p may be kept by one and not the other.
  """
  logits = logits.astype(jnp.float32) / temperature
  vocab = logits.shape[-1]
  k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
  thresh, exact = _candidate_threshold(logits, k, top_p, min(vocab, max_candidates))
  thresh = jax.lax.cond(jnp.all(exact), lambda: thresh,
                        lambda: _sorted_threshold(logits, k, top_p))
  return jnp.where(logits >= thresh, logits, -jnp.inf)


def _keep_sorted(desc, probs, k, top_p):
  """Kept ranks [..., C] of descending logits `desc` [..., C] with probabilities `probs`,
  and the total mass of the C [..., 1]."""
  rank = jnp.arange(desc.shape[-1])
  mass = jnp.cumsum(probs, axis=-1)
  keep = (rank < k) & ((mass - probs < top_p) | (top_p >= 1.0))
  return keep, mass[..., -1:]


def _sorted_threshold(logits, k, top_p):
  """Smallest kept logit [..., 1] from a full sort over V (the reference computation)."""
  rank = jnp.arange(logits.shape[-1])
  desc = jnp.where(rank < k, -jnp.sort(-logits, axis=-1), -jnp.inf)
  keep, _ = _keep_sorted(desc, jax.nn.softmax(desc, axis=-1), k, top_p)
  return jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)


def _candidate_threshold(logits, k, top_p, num: int):
  """(smallest kept logit [..., 1], whether it equals the full sort's [...]) from the
  top `num` logits (`lax.top_k`); see `filter_logits` for when it does."""
  vocab = logits.shape[-1]
  cand = jax.lax.top_k(logits, num)[0]  # [..., C], the sort's first C values
  desc = jnp.where(jnp.arange(num) < k, cand, -jnp.inf)
  # Nucleus probabilities: over the top-k set when it lies in the candidates, else
  # (top-k off) over all V.
  in_cand = k <= num
  probs = jnp.where(in_cand, jax.nn.softmax(desc, axis=-1),
                    jnp.exp(desc - jax.nn.logsumexp(logits, axis=-1, keepdims=True)))
  keep, cand_mass = _keep_sorted(desc, probs, k, top_p)
  exact = in_cand | ((k >= vocab) & (top_p < 1.0) & (cand_mass[..., 0] >= top_p))
  return jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True), exact


def select_tokens(u, logits, temperature=1.0, top_k=0, top_p=1.0, *,
                  max_candidates: int = TOP_CANDIDATES):
  """Inverse-CDF sampling: u [R] in [0, 1), logits [R, V] -> tokens [R] int32.

  Picks the first token whose cumulative (filtered, tempered) probability
  exceeds u. temperature 0 = greedy (argmax). Settings may be traced scalars;
  `max_candidates` is `filter_logits`'.
  """
  temperature = jnp.asarray(temperature, jnp.float32)
  greedy = jnp.argmax(logits, axis=-1)
  temp = jnp.where(temperature > 0, temperature, 1.0)
  vocab = logits.shape[-1]
  # The top-k (and any sort) in filter_logits only runs when top-k or top-p is active.
  active = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
  filtered = jax.lax.cond(active, lambda x: filter_logits(x, temp, top_k, top_p,
                                                          max_candidates=max_candidates),
                          lambda x: x.astype(jnp.float32) / temp, logits)
  weights = jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True))
  cdf = jnp.cumsum(weights, axis=-1)
  sampled = jnp.argmax(cdf > u[:, None] * cdf[:, -1:], axis=-1)
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Building blocks.


ROW_AXES = ('data', 'fsdp')  # the RL loop's mesh axes that split rows (train_step.make_mesh)


def _mesh_split(rows: int):
  """(the mesh axes that split `rows` rows, or None; whether kv heads split over a
  'model' axis > 1) for the mesh that `jax.set_mesh` set while tracing; (None, False)
  without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(ROW_AXES) <= set(mesh.axis_names):
    return None, False
  size = math.prod(mesh.shape[a] for a in ROW_AXES)
  split = ROW_AXES if size > 1 and rows % size == 0 else None
  return split, dict(mesh.shape).get(decoder.MODEL_AXIS, 1) > 1


def place_cache(cache):
  """A KV cache [layers, rows, slots, K, Dh] (a `decoder.KVCache`, or a
  `decoder.CascadeCache`: its prefixes and its own rows each) with its rows split over
  ('data', 'fsdp') when they divide, and its kv heads over 'model' when the mesh has that
  axis (see `place_rows`); as is without a mesh. Placement only, values are unchanged."""

  def place(x):
    split, tp = _mesh_split(x.shape[1])
    if split is None and not tp:
      return x
    spec = jax.sharding.PartitionSpec(
        None, ROW_AXES if split else jax.sharding.PartitionSpec.UNCONSTRAINED, None,
        decoder.MODEL_AXIS if tp else None, None)
    return jax.lax.with_sharding_constraint(x, spec)
  return jax.tree.map(place, cache)


def map_cache_rows(fn, cache, *others):
  """fn(x, *ys) on the per-row arrays [layers, R, ...] of a cache (and of `others`, caches
  of the same kind): all of a `KVCache`, the own rows of a `CascadeCache` (its shared
  prefixes, those of `cache`, are kept as they are). A `decoder.TreeCache`'s rows are only
  forked by `fork_tree`."""
  if isinstance(cache, decoder.TreeCache):
    raise ValueError("the rows of a 'cascade_tree' cache (decoder.TreeCache) fork only at "
                     "the tree's static levels: sampling.fork_tree (sample_tree_fixed)")
  if isinstance(cache, decoder.CascadeCache):
    return cache.replace(k=fn(cache.k, *(o.k for o in others)),
                         v=fn(cache.v, *(o.v for o in others)))
  return jax.tree.map(fn, cache, *others)


def place_rows(state: 'Rollout') -> 'Rollout':
  """`state` with its rows (axis 1 of the KV cache, axis 0 of the rest) split over the
  ('data', 'fsdp') axes of the mesh that `jax.set_mesh` set while tracing, when their
  size divides the rows, and the cache's kv heads over its 'model' axis (tensor
  parallelism) when it has one > 1; else `state` as is (no mesh, as in tests and
  notebooks).

  Placement only, values are unchanged. Without it XLA may leave the cache of a
  prefill or a fork replicated on every device (measured with experiments/compile_tpu.py,
  SmolLM2-135M prefilling 256 rows of 1024 + 1024 slots on a v5e-4: 20.5 GB of
  temporaries per chip, over its 16 GB; with it, a 3.0 GB cache shard and 6.5 GB).
  """
  split, _ = _mesh_split(state.tokens.shape[0])
  if split is not None:
    put = lambda x: jax.lax.with_sharding_constraint(
        x, jax.sharding.PartitionSpec(ROW_AXES, *([None] * (x.ndim - 1))))
    state = jax.tree.map(put, state.replace(cache=None)).replace(cache=state.cache)
  return state.replace(cache=place_cache(state.cache))


def response_uniforms(key, prompt_ids, response_ids, length: int):
  """All randomness of a sampler: u [B, n, length] f32 in [0, 1).

  u[b, j] = uniform(fold_in(fold_in(key, prompt_ids[b]), response_ids[j]),
  (length,)): response g of a prompt draws token t by inverse CDF at u[t].
  """
  prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
  response_ids = jnp.asarray(response_ids, jnp.int32)
  b, n = prompt_ids.shape[0], response_ids.shape[0]
  u = row_uniforms(key, jnp.repeat(prompt_ids, n), jnp.tile(response_ids, b), length)
  return u.reshape(b, n, length)  # flat [B * n] first: compiles faster than nested vmaps


def row_uniforms(key, prompt_ids, response_ids, length: int):
  """u [R, length]: row r's stream, that of response response_ids[r] of prompt
  prompt_ids[r] (`response_uniforms` for arbitrary (prompt, response) pairs)."""
  keys = jax.vmap(lambda p, j: jax.random.fold_in(jax.random.fold_in(key, p), j))(
      jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(response_ids, jnp.int32))
  return jax.vmap(lambda k: jax.random.uniform(k, (length,)))(keys)


# KV cache layouts of a Rollout: 'cascade' keeps each prompt once and each row's own
# tokens per row (`decoder.CascadeCache`; decode reads a prompt once per step for its G
# rows, Hydragen), 'rows' a full cache per row (`decoder.KVCache`; the prompt G times),
# 'cascade_tree' (`TREE_LAYOUTS`: `sample_tree_fixed` only, `fork_tree`)
# also each tree node's segment once (`decoder.TreeCache`).
LAYOUTS = ('cascade', 'rows', 'cascade_tree')
TREE_LAYOUTS = ('cascade_tree',)
DEFAULT_LAYOUT = 'cascade'


def start(params, cfg: decoder.PolicyConfig, prompts, uniforms, *, prompt_len=None,
          pad_id: int = 0, layout: str = DEFAULT_LAYOUT,
          own_len: Optional[int] = None) -> Rollout:
  """Prefills prompts [B, P] once into the cache of all their responses.

  uniforms: [B, n, L] (see `response_uniforms`). Returns a Rollout of R = B * n
  rows; row b * n + j samples with uniforms[b, j] from response index 0.
  layout 'cascade' (`LAYOUTS`): a `decoder.CascadeCache` holding prompt b once and row
  b * n + j's own L slots (slot i = position prompt_len[b] - 1 + i: the last prompt
  token is fed again by the first decode step, as in 'rows'). Layout 'rows': the R-row
  cache of cfg.max_len slots is made first and placed (`place_cache`: rows over the mesh,
  kv heads over 'model'); `decoder.prefill` runs the B prompts and each layer writes its
  keys and values, n times, straight into it. (Building a B-row cache and repeating it
  made the compiled program hold gathered copies of the whole cache: measured with
  experiments/compile_tpu.py, Llama-3.1-8B, 32 prompts x 8 on a v5e-16.)
  Layout 'cascade_tree' (`sample_tree_fixed`'s): a `decoder.TreeCache` without segments
  whose rows have `own_len` own slots (`tree_own_lens`; `fork_tree` adds the levels).
  """
  b, p = prompts.shape
  n, l = uniforms.shape[1:]
  if p + l > cfg.max_len:
    raise ValueError(f'P + L = {p + l} > max_len = {cfg.max_len}')
  if layout not in LAYOUTS:
    raise ValueError(f'layout {layout!r} not in {LAYOUTS}')
  if own_len is not None and (layout == 'rows' or not 0 < own_len <= l):
    raise ValueError(f'own_len {own_len}: a cascade layout\'s own slots, in [1, L = {l}]; '
                     f'layout {layout!r}')
  prompt_len = (jnp.full((b,), p, jnp.int32) if prompt_len is None
                else jnp.asarray(prompt_len, jnp.int32))
  r = b * n
  empty = (decoder.init_cascade_cache(cfg, b, p, r, own_len or l) if layout != 'rows'
           else decoder.init_cache(cfg, r))
  _, cache = decoder.prefill(params, cfg, prompts, place_cache(empty))
  if layout in TREE_LAYOUTS:
    cache = decoder.TreeCache(prefix_k=cache.prefix_k, prefix_v=cache.prefix_v, seg_k=(),
                              seg_v=(), k=cache.k, v=cache.v)
  # Row b * n + j <- prompt b: a broadcast (jnp.repeat), not a gather; see `place_rows`.
  rep = lambda x: jnp.repeat(x, n, axis=0, total_repeat_length=r)
  last = jnp.take_along_axis(prompts, (prompt_len - 1)[:, None], axis=1)[:, 0]
  last = rep(last).astype(jnp.int32)
  return place_rows(Rollout(
      cache=cache,
      uniforms=uniforms.reshape(r, l).astype(jnp.float32),
      prompt_len=rep(prompt_len),
      prompt_last=last,
      token=last,
      index=jnp.zeros((r,), jnp.int32),
      done=jnp.zeros((r,), bool),
      tokens=jnp.full((r, l), pad_id, jnp.int32),
      logprobs=jnp.zeros((r, l), jnp.float32),
      entropy=jnp.zeros((r, l), jnp.float32),
      mask=jnp.zeros((r, l), bool)))


def tree_own_lens(num_levels: int, segment_len: int, length: int) -> tuple:
  """Own slots of a 'cascade_tree' row at each level of `sample_tree_fixed`: segment_len
  before the last level (its slots become the level's segment), then the response's rest,
  length - (num_levels - 1) * segment_len."""
  return (segment_len,) * (num_levels - 1) + (length - (num_levels - 1) * segment_len,)


def fork_tree(state: Rollout, n: int, own_len: int, uniforms, *, pad_id: int = 0) -> Rollout:
  """`fork` of every row of a 'cascade_tree' Rollout into n children (row i -> rows
  i * n + c) at its own slots' end, the next level's start: the rows' own slots become the
  tree's next segment level as they are, one entry per node (no copy), and the children
  get `own_len` fresh own slots from there (`decoder.TreeCache`, Hydragen arXiv 2402.05099).
  uniforms [R * n, L]. Every row must have filled its own slots or be done (as
  `sample_tree_fixed`'s levels do)."""
  cache = state.cache
  if not isinstance(cache, decoder.TreeCache):
    raise ValueError(f'fork_tree forks a decoder.TreeCache, got {type(cache).__name__}')
  position = cache.offset + cache.k.shape[2]
  if position + own_len > state.tokens.shape[1]:
    raise ValueError(f'children at {position} with {own_len} own slots pass L = '
                     f'{state.tokens.shape[1]}')
  rows = cache.k.shape[1] * n
  fresh = jnp.zeros(cache.k.shape[:1] + (rows, own_len) + cache.k.shape[3:], cache.k.dtype)
  cache = cache.replace(seg_k=cache.seg_k + (cache.k,), seg_v=cache.seg_v + (cache.v,),
                        k=fresh, v=fresh)
  s = fork(state.replace(cache=None), n, jnp.full((rows,), position, jnp.int32), uniforms,
           pad_id=pad_id)
  return s.replace(cache=place_cache(cache))


def decode_windows(cfg: decoder.PolicyConfig, length: int, cascade: bool = True) -> tuple:
  """Static ends of the decode's phases over `length` response slots: multiples of
  `cfg.decode_window`, then `length`; one phase, (length,), without a cascade cache or for
  a window of 0 or >= length. A step of the phase ending at w reads own slots [0, w) only."""
  w = cfg.decode_window if cascade else 0
  return (length,) if not w or w >= length else tuple(range(w, length, w)) + (length,)


def decode(params, cfg: decoder.PolicyConfig, state: Rollout, stop, *,
           temperature=1.0, top_k=0, top_p=1.0, eos_id: Optional[int] = None) -> Rollout:
  """Samples one token per active row per step until response index `stop`.

  `stop` (int or traced scalar) <= L; sampling settings may be traced.

  A row is active while not done and `index < stop`; the loop ends when no row
  is active (at most `stop` steps). Inactive rows keep their state; their
  compute is wasted as in any lockstep decoder, and the only cache slot they
  rewrite is their current position, with their current token.

  Phases (`decode_windows`, a `CascadeCache` or `TreeCache` only): the loop runs once per
  phase, rows stopping at its end w, each step attending over own slots [0, w) instead of
  all L (a `TreeCache`: all W of its level), so a step reads about half the rows' slots on
  average (issue 41). The rows' results are the same up to float rounding (fewer zero terms
  in each sum) and no row takes more steps: every phase ends when its slowest row reaches
  w, where it would be anyway.
  """
  length = state.tokens.shape[1]
  slots = jnp.arange(length)[None, :]

  def body(s, limit):
    act = ~s.done & (s.index < limit)
    cascade = isinstance(s.cache, (decoder.CascadeCache, decoder.TreeCache))
    start = s.prompt_len - 1 if cascade else None
    logits, cache = decoder.decode_step(
        params, cfg, s.cache, s.token, s.prompt_len + s.index - 1, start)
    logp, ent = decoder.log_softmax_entropy(logits)
    u = jnp.take_along_axis(s.uniforms, jnp.minimum(s.index, length - 1)[:, None], 1)[:, 0]
    new = select_tokens(u, logits, temperature, top_k, top_p)
    lp = jnp.take_along_axis(logp, new[:, None], axis=-1)[:, 0]
    write = act[:, None] & (slots == s.index[:, None])
    finished = (jnp.isin(new, jnp.asarray(eos_id, jnp.int32)) if eos_id is not None
                else jnp.zeros_like(act))
    return s.replace(
        cache=cache,
        token=jnp.where(act, new, s.token),
        index=jnp.where(act, s.index + 1, s.index),
        done=s.done | (act & finished),
        tokens=jnp.where(write, new[:, None], s.tokens),
        logprobs=jnp.where(write, lp[:, None], s.logprobs),
        entropy=jnp.where(write, ent[:, None], s.entropy),
        mask=s.mask | write)

  # Phases over the own slots: [0, L) of a CascadeCache, [0, W) of a TreeCache's level,
  # which start at response index `offset` (its last fork).
  tree = isinstance(state.cache, decoder.TreeCache)
  offset, own = (state.cache.offset, state.cache.k.shape[2]) if tree else (0, length)
  for end in decode_windows(cfg, own, tree or isinstance(state.cache, decoder.CascadeCache)):
    limit = stop if end == own else jnp.minimum(stop, offset + end)
    window = None if end == own else end
    s = state.replace(cache=state.cache.replace(window=window)) if window else state
    s = jax.lax.while_loop(lambda s: jnp.any(~s.done & (s.index < limit)),
                           functools.partial(body, limit=limit), s)
    state = s.replace(cache=s.cache.replace(window=None)) if window else s
  return state


def fork(state: Rollout, source, position, uniforms, *, pad_id: int = 0) -> Rollout:
  """New rows copying rows `source` [R'] (KV cache included) up to `position` [R'].

  Row i keeps response tokens [:position[i]] of row source[i] and samples
  from index position[i] on with `uniforms[i]` ([R', L], its own response's
  stream), reusing the copied cache (no prefix recomputation). Needs position
  <= the source's generated length (its `index`). A fork at or beyond the
  source's EOS yields a done row identical to its source. A static int
  `source` n means source = repeat(arange(R), n): a broadcast, not a gather.
  With a `decoder.CascadeCache` only the rows' own slots are copied and the prompts stay
  shared: the new rows must be prompt-major (row i of R' belongs to prompt i // (R' / B),
  as in every sampler here: children listed by prompt, then by source).
  """
  if isinstance(source, int):
    take = lambda x, axis: jnp.repeat(x, source, axis=axis)
  else:
    take = lambda x, axis: x[(slice(None),) * axis + (source,)]
  s = jax.tree.map(lambda x: take(x, 0), state.replace(cache=None))
  cache = map_cache_rows(lambda x: take(x, 1), state.cache)
  if isinstance(cache, decoder.CascadeCache) and cache.k.shape[1] % cache.prefix_k.shape[1]:
    raise ValueError(f'{cache.k.shape[1]} forked rows do not split evenly over '
                     f'{cache.prefix_k.shape[1]} prompts')
  position = jnp.asarray(position, jnp.int32)
  length = s.tokens.shape[1]
  keep = jnp.arange(length)[None, :] < position[:, None]
  prev = jnp.take_along_axis(s.tokens, jnp.clip(position - 1, 0, length - 1)[:, None], 1)[:, 0]
  return place_rows(s.replace(
      cache=cache,
      uniforms=jnp.asarray(uniforms, jnp.float32),
      token=jnp.where(position > 0, prev, s.prompt_last),
      index=position,
      done=s.done & (position >= s.mask.sum(-1)),
      tokens=jnp.where(keep, s.tokens, pad_id),
      logprobs=jnp.where(keep, s.logprobs, 0.0),
      entropy=jnp.where(keep, s.entropy, 0.0),
      mask=keep & s.mask))


def to_samples(state: Rollout, num_prompts: int, parent=None, fork_pos=None) -> Samples:
  """Reshapes B * G rows (prompt-major) into Samples [B, G, L]."""
  r, l = state.tokens.shape
  g = r // num_prompts
  shape = lambda x: x.reshape(num_prompts, g, l)
  if parent is None:
    parent = jnp.full((num_prompts, g), -1, jnp.int32)
  if fork_pos is None:
    fork_pos = jnp.zeros((num_prompts, g), jnp.int32)
  return Samples(tokens=shape(state.tokens), logprobs=shape(state.logprobs),
                 entropy=shape(state.entropy), mask=shape(state.mask),
                 parent=jnp.asarray(parent, jnp.int32), fork=jnp.asarray(fork_pos, jnp.int32))


def _concat(a: Samples, b: Samples) -> Samples:
  return jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=1), a, b)


# ----------------------------------------------------------------------------
# Samplers: short Python sequences of jitted stages (uniforms, start, decode,
# fork, finish). Compiled stages are cached by shape and shared between
# samplers (e.g. a decode over R rows); `stop`, temperature, top_k, top_p,
# prompt_len and prompt_ids are traced, so changing them never recompiles.


def _inputs(cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p):
  prompts = jnp.asarray(prompts, jnp.int32)
  b, p = prompts.shape
  if p + max_new_tokens > cfg.max_len:
    raise ValueError(f'P + L = {p + max_new_tokens} > max_len = {cfg.max_len}')
  prompt_len = (jnp.full((b,), p, jnp.int32) if prompt_len is None
                else jnp.asarray(prompt_len, jnp.int32))
  prompt_ids = (jnp.arange(b, dtype=jnp.int32) if prompt_ids is None
                else jnp.asarray(prompt_ids, jnp.int32))
  knobs = dict(temperature=jnp.asarray(temperature, jnp.float32),
               top_k=jnp.asarray(top_k, jnp.int32), top_p=jnp.asarray(top_p, jnp.float32))
  return prompts, prompt_len, prompt_ids, knobs


_uniforms_jit = jax.jit(response_uniforms, static_argnames='length')
_to_samples = jax.jit(to_samples, static_argnums=1)


def _layout(layout: Optional[str], sampler: str) -> str:
  """`sampler`'s cache layout: `DEFAULT_LAYOUT` (read when called) for None; a
  `TREE_LAYOUTS` one only for sample_tree_fixed (its forks at static positions)."""
  layout = DEFAULT_LAYOUT if layout is None else layout
  if layout in TREE_LAYOUTS and sampler != 'sample_tree_fixed':
    raise ValueError(f'layout {layout!r} is sample_tree_fixed\'s only; {sampler} takes '
                     f'{tuple(x for x in LAYOUTS if x not in TREE_LAYOUTS)}')
  return layout


@functools.partial(jax.jit, static_argnames=('cfg', 'pad_id', 'layout'))
def _start(params, prompts, uniforms, prompt_len, *, cfg, pad_id, layout=DEFAULT_LAYOUT):
  return start(params, cfg, prompts, uniforms, prompt_len=prompt_len, pad_id=pad_id,
               layout=layout)


@functools.partial(jax.jit, static_argnames=('cfg', 'eos_id'))
def _decode(params, state, stop, knobs, *, cfg, eos_id):
  return decode(params, cfg, state, stop, eos_id=eos_id, **knobs)


_fork = jax.jit(fork, static_argnames='pad_id')


def _chains(params, cfg, key, prompts, prompt_len, prompt_ids, knobs, num_samples,
            max_new_tokens, eos_id, pad_id, layout=None) -> Rollout:
  """B * num_samples i.i.d. rows decoded to the end (cache `layout`, see `LAYOUTS`)."""
  u = _uniforms_jit(key, prompt_ids, np.arange(num_samples, dtype=np.int32),
                    length=max_new_tokens)
  state = _start(params, prompts, u, prompt_len, cfg=cfg, pad_id=pad_id,
                 layout=_layout(layout, 'the i.i.d. chains (_chains)'))
  return _decode(params, state, max_new_tokens, knobs, cfg=cfg, eos_id=eos_id)


def sample_iid(params, cfg: decoder.PolicyConfig, key, prompts, num_samples: int,
               max_new_tokens: int, *, temperature=1.0, top_p=1.0, top_k=0,
               eos_id: Optional[int] = None, pad_id: int = 0, prompt_len=None,
               prompt_ids=None, layout: Optional[str] = None) -> Samples:
  """G = num_samples i.i.d. responses per prompt: prompts [B, P] -> Samples [B, G, L].

  Each prompt is prefilled once; with layout 'cascade' (the default, `DEFAULT_LAYOUT`)
  its cache is kept once and read once per step for its G responses, with 'rows' it is
  repeated G times (`start`). parent = -1 and fork = 0 everywhere. temperature 0 = greedy.
  """
  layout = _layout(layout, 'sample_iid')
  prompts, prompt_len, prompt_ids, knobs = _inputs(
      cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p)
  state = _chains(params, cfg, key, prompts, prompt_len, prompt_ids, knobs, num_samples,
                  max_new_tokens, eos_id, pad_id, layout)
  return _to_samples(state, prompts.shape[0])


def fixed_tree(branching: Sequence[int], segment_len: int):
  """Static layout of the fixed-branching tree.

  Leaves g are ordered lexicographically by their path (i_0, ..., i_{K-1}),
  i_l in [0, branching[l]). The first child (i_l = 0) continues its parent's
  response; child i_l > 0 forks from it after l * segment_len tokens.

  Returns numpy int32 arrays:
    parent [G], fork [G]: the tree before EOS clipping (roots: -1, 0).
    level_ids: list of [prod(branching[:l+1])], the response each row samples
      for at level l (the first leaf below that node).
  """
  branching = tuple(int(b) for b in branching)
  strides = np.array([math.prod(branching[l + 1:]) for l in range(len(branching))])
  paths = np.array(list(itertools.product(*map(range, branching))), np.int64)
  g = len(paths)
  parent = np.full((g,), -1, np.int32)
  fork_pos = np.zeros((g,), np.int32)
  for i, path in enumerate(paths):
    nz = np.flatnonzero(path)
    if nz.size and nz[-1] > 0:
      j = nz[-1]
      parent[i] = (path[:j] * strides[:j]).sum()
      fork_pos[i] = j * segment_len
  level_ids = []
  for l in range(len(branching)):
    prefix = np.array(list(itertools.product(*map(range, branching[:l + 1]))), np.int64)
    level_ids.append((prefix * strides[:l + 1]).sum(-1).astype(np.int32))
  return parent, fork_pos, level_ids


@functools.partial(jax.jit, static_argnums=1)
def _finish_fixed(state, num_prompts, parent, fork_pos):
  """Samples with the static tree, fork clipped to the parent's length."""
  out = to_samples(state, num_prompts, parent, fork_pos)
  lengths = out.lengths
  parent_len = jnp.take_along_axis(lengths, jnp.maximum(out.parent, 0), axis=1)
  return out.replace(fork=jnp.where(out.parent >= 0, jnp.minimum(out.fork, parent_len), 0))


def sample_tree_fixed(params, cfg: decoder.PolicyConfig, key, prompts,
                      branching: Sequence[int], segment_len: int, max_new_tokens: int, *,
                      temperature=1.0, top_p=1.0, top_k=0, eos_id: Optional[int] = None,
                      pad_id: int = 0, prompt_len=None, prompt_ids=None,
                      layout: Optional[str] = None) -> Samples:
  """Fixed-branching tree (SPO-tree / TreePO style): prompts [B, P] -> [B, G, L].

  Level 0 samples branching[0] chains of segment_len tokens from the prompt; at
  level l each frontier row's cache is repeated branching[l] times and the rows
  sample the next segment_len tokens; the last level runs to L. G =
  prod(branching). Layout, parent and fork as in `fixed_tree`, with fork
  clipped to the parent's length (a child forked after its parent's EOS is an
  identical copy of it). Needs (len(branching) - 1) * segment_len < L.

  layout 'cascade_tree' (`TREE_LAYOUTS`, this sampler only; the default's form here when
  `layout` is None and `DEFAULT_LAYOUT` is 'cascade'): the prompt once per group, each
  node's segment once (one shared cache level per tree level, `decoder.TreeCache`), each
  leaf's own slots only its L - (len(branching) - 1) * segment_len tokens after its last
  fork (`start`'s own_len, `fork_tree`; Hydragen, arXiv 2402.05099). Same samples as
  'cascade' and 'rows' up to float rounding; decodes in phases over each level's own slots.
  """
  if layout is None and DEFAULT_LAYOUT == 'cascade':
    layout = 'cascade_tree'  # the cascade with each shared segment read once
  layout = _layout(layout, 'sample_tree_fixed')
  branching = tuple(int(b) for b in branching)
  if not branching or min(branching) < 1 or segment_len < 1:
    raise ValueError(f'bad tree: branching={branching}, segment_len={segment_len}')
  if (len(branching) - 1) * segment_len >= max_new_tokens:
    raise ValueError('the last level would start at or after max_new_tokens')
  prompts, prompt_len, prompt_ids, knobs = _inputs(
      cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p)
  parent, _, _ = fixed_tree(branching, segment_len)
  u = _uniforms_jit(key, prompt_ids, np.arange(len(parent), dtype=np.int32),
                    length=max_new_tokens)
  return _tree_fixed(params, prompts, u, prompt_len, knobs, cfg=cfg, branching=branching,
                     segment_len=segment_len, eos_id=eos_id, pad_id=pad_id,
                     layout=layout)


@functools.partial(jax.jit, static_argnames=('cfg', 'branching', 'segment_len', 'eos_id',
                                             'pad_id', 'layout'))
def _tree_fixed(params, prompts, u, prompt_len, knobs, *, cfg, branching, segment_len, eos_id,
                pad_id, layout=DEFAULT_LAYOUT):
  """All levels of `sample_tree_fixed` in one program (uniforms u [B, G, L]).

  Forks repeat rows (a broadcast, no gather) and feed the next level's decode
  loop directly, so no stage boundary copies or re-materializes the KV cache.
  """
  b, l = prompts.shape[0], u.shape[-1]
  parent, fork_pos, level_ids = fixed_tree(branching, segment_len)
  tree = layout in TREE_LAYOUTS  # a shared cache level per tree level, see `fork_tree`
  own = tree_own_lens(len(branching), segment_len, l)
  state = start(params, cfg, prompts, u[:, level_ids[0]], prompt_len=prompt_len,
                pad_id=pad_id, layout=layout, own_len=own[0] if tree else None)
  for level in range(len(branching)):
    if level > 0 and tree:
      state = fork_tree(state, branching[level], own[level],
                        u[:, level_ids[level]].reshape(-1, l), pad_id=pad_id)
    elif level > 0:
      position = jnp.full((state.tokens.shape[0] * branching[level],), level * segment_len,
                          jnp.int32)
      state = fork(state, branching[level], position, u[:, level_ids[level]].reshape(-1, l),
                   pad_id=pad_id)
    stop = l if level == len(branching) - 1 else (level + 1) * segment_len
    state = decode(params, cfg, state, stop, eos_id=eos_id, **knobs)
  shape = (b, len(parent))
  return _finish_fixed(state, b, np.broadcast_to(parent, shape), np.broadcast_to(fork_pos, shape))


# A fork policy maps the chains `Samples` [B, N, L] to (source [B, K], position
# [B, K]) int32: child k of prompt b forks from chain source[b, k] in [0, N) and
# keeps its first position[b, k] tokens. Must be hashable (a jit static arg),
# e.g. a frozen dataclass.
ForkPolicy = Callable[[Samples], tuple]


def _fork_at(pos, num_continuations: int):
  """Fork positions [B, N, F] -> (source, position) [B, N·F·C], ordered (chain, fork, continuation)."""
  b, n, f = pos.shape
  source = np.repeat(np.arange(n), f * num_continuations)
  source = jnp.broadcast_to(jnp.asarray(source, jnp.int32), (b, source.size))
  return source, jnp.repeat(pos.reshape(b, n * f), num_continuations, axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class EntropyForks:
  """Forks each chain at its `num_forks` highest-scoring valid positions (TreeRL/EPTree).

  score: 'entropy' (policy entropy at the step) or 'nll' (-log p of the sampled
  token). Only positions t < length(chain) are eligible; a fork at t keeps
  tokens[:t] and re-samples token t onwards. Ties go to the earlier position;
  chains shorter than num_forks repeat their best position. Children are
  ordered (chain n, fork f, continuation c) -> k = (n * F + f) * C + c, forks
  of a chain sorted by decreasing score.
  """
  num_forks: int
  num_continuations: int
  score: str = 'entropy'

  def __call__(self, chains: Samples):
    if self.score == 'entropy':
      score = chains.entropy
    elif self.score == 'nll':
      score = -chains.logprobs
    else:
      raise ValueError(f'unknown score {self.score!r}')
    l = chains.tokens.shape[-1]
    if self.num_forks > l:
      raise ValueError(f'num_forks={self.num_forks} > max_new_tokens={l}')
    score = jnp.where(chains.mask, score, -jnp.inf)
    _, pos = jax.lax.top_k(score, self.num_forks)  # [B, N, F]
    valid = jnp.take_along_axis(chains.mask, pos, axis=-1)
    return _fork_at(jnp.where(valid, pos, pos[..., :1]), self.num_continuations)


@dataclasses.dataclass(frozen=True)
class CutpointForks:
  """Forks at SPO-chain cutpoints: before tokens with p < `threshold`, every
  `every`-th such token kept, the first `num_forks` of them per chain.

  p is the untempered probability of the sampled token. A chain with fewer
  cutpoints repeats its lowest-probability position. Children are ordered as in
  `EntropyForks` (chain, fork, continuation).
  """
  num_forks: int
  num_continuations: int
  threshold: float = 0.9
  every: int = 1

  def __call__(self, chains: Samples):
    l = chains.tokens.shape[-1]
    if self.num_forks > l or self.every < 1:
      raise ValueError(f'need num_forks <= max_new_tokens={l} and every >= 1')
    low = chains.mask & (chains.logprobs < math.log(self.threshold))
    rank = jnp.cumsum(low, axis=-1) - 1
    cut = low & (rank % self.every == 0)
    t = jnp.arange(l)
    _, pos = jax.lax.top_k(jnp.where(cut, l - t, -1), self.num_forks)  # earliest first
    valid = jnp.take_along_axis(cut, pos, axis=-1)
    fallback = jnp.argmin(jnp.where(chains.mask, chains.logprobs, jnp.inf), axis=-1)[..., None]
    return _fork_at(jnp.where(valid, pos, fallback), self.num_continuations)


@functools.partial(jax.jit, static_argnums=0)
def _apply_policy(fork_policy, chains):
  """Runs the policy; clips positions into [0, length(source) - 1]."""
  return _clip_forks(chains, *fork_policy(chains))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _apply_model_policy(fork_policy, params, cfg, prompts, prompt_len, chains):
  """`fork_policy.with_model(...)` (a policy that reads the model); clipped as above."""
  return _clip_forks(chains, *fork_policy.with_model(params, cfg, prompts, prompt_len, chains))


def _clip_forks(chains, source, position):
  source = jnp.asarray(source, jnp.int32)
  src_len = jnp.take_along_axis(chains.lengths, source, 1)
  return source, jnp.clip(jnp.asarray(position, jnp.int32), 0, src_len - 1)


@jax.jit
def _children_rows(source, num_chains):
  b = source.shape[0]
  return (jnp.arange(b)[:, None] * num_chains + source).reshape(-1)


@jax.jit
def _finish_forks(chains, children, source, position):
  return _concat(chains, to_samples(children, source.shape[0], source, position))


def sample_tree_forks(params, cfg: decoder.PolicyConfig, key, prompts, num_chains: int,
                      max_new_tokens: int, fork_policy: ForkPolicy, *, temperature=1.0,
                      top_p=1.0, top_k=0, eos_id: Optional[int] = None, pad_id: int = 0,
                      prompt_len=None, prompt_ids=None, layout: Optional[str] = None) -> Samples:
  """Chains to the end, then one round of forks chosen by `fork_policy`.

  Samples N = num_chains i.i.d. chains (responses g < N, roots; the same stages
  as `sample_iid`), asks `fork_policy` for K (source, position) pairs per
  prompt (a policy with `reads_model` also gets the params and prompts:
  `with_model`), and samples child k as response g = N + k from `position` to
  the end, reusing the chain's KV cache. Positions are clipped into
  [0, length(source) - 1], so each fork re-samples a token the chain
  generated. G = N + K; parent = source, fork = position for children.
  """
  layout = _layout(layout, 'sample_tree_forks')
  prompts, prompt_len, prompt_ids, knobs = _inputs(
      cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p)
  b, l = prompts.shape[0], max_new_tokens
  state = _chains(params, cfg, key, prompts, prompt_len, prompt_ids, knobs, num_chains, l,
                  eos_id, pad_id, layout)
  chains = _to_samples(state, b)
  if getattr(fork_policy, 'reads_model', False):  # e.g. APPO's counterfactual passes
    source, position = _apply_model_policy(fork_policy, params, cfg, prompts, prompt_len,
                                           chains)
  else:
    source, position = _apply_policy(fork_policy, chains)
  k = source.shape[1]
  u = _uniforms_jit(key, prompt_ids, num_chains + np.arange(k, dtype=np.int32), length=l)
  children = _fork(state, _children_rows(source, num_chains), position.reshape(-1),
                   u.reshape(b * k, l), pad_id=pad_id)
  children = _decode(params, children, l, knobs, cfg=cfg, eos_id=eos_id)
  return _finish_forks(chains, children, source, position)


def sample_tree_entropy(params, cfg: decoder.PolicyConfig, key, prompts, num_chains: int,
                        num_forks: int, num_continuations: int, max_new_tokens: int, *,
                        score: str = 'entropy', **kwargs) -> Samples:
  """Entropy-guided tree (TreeRL/EPTree): `sample_tree_forks` with `EntropyForks`.

  G = num_chains * (1 + num_forks * num_continuations); responses [0, N) are
  the chains, then children ordered by (chain, fork, continuation). kwargs as
  in `sample_iid` (temperature, top_p, top_k, eos_id, pad_id, prompt_len,
  prompt_ids, layout).
  """
  _layout(kwargs.get('layout'), 'sample_tree_entropy')
  return sample_tree_forks(params, cfg, key, prompts, num_chains, max_new_tokens,
                           EntropyForks(num_forks, num_continuations, score), **kwargs)
