"""Tree packing: a group's unique tokens laid out once, for one forward/backward per tree.

A group is a prompt [P] (right-padded, true length p) and G responses [G, L]. The
flat batch runs G rows of prompt + response. A *packing* instead lays out, per
group, one row of T slots:

    slots [0, P)      the prompt (slots >= p are padding, never attended to)
    slots [P, P + U)  one slot per unique response node (U <= G * L), in node-id
                      order, then unused slots up to T

where the nodes are those of `trees.build` (responses sharing their first t + 1
tokens share the slot of token t: `mode='tree'`) or one per response token (only
the prompt is shared, PrefixGrouper-style: `mode='prompt'`). Slot i holds a token
at position `positions[i]` (its depth: p + t for response token t), so RoPE sees
the same positions as the flat batch.

Attention is ancestor-only: slot i attends to itself and its ancestors, i.e. to
the slots on the root-to-i path. Each response's path is `path[g]` [S = P + L]:
path[g, s] is the slot holding position s of prompt + response g (prompt slot s
for s < p, response token s - p after; entries past the response are unused).
`source[i] = rep(i) * S + positions[i]` names one response through slot i, so
attention can run along the G paths and be read back per slot (see
`experiments.models.decoder`), as a dense [T, T] mask (`ancestor_mask`), or over
blocks of slots (`block_pairs`, `block_mask`; attention 'blocks').

Block-sparse attention ('blocks'). Slots are cut into blocks of `block` slots.
Ancestors sit in lower slots (node ids grow along every path), so key block kb
<= query block qb. Key j is an ancestor-or-self of query i iff j lies on path
g_i = source[i] // S at a position <= positions[i] (path[g_i, positions[j]] == j),
which gives the exact mask inside a block pair. A pair (qb, kb) is needed iff
for some response g, the lowest position of a key of kb on path g is <= the
highest position of a query of qb whose g_i = g (each qb also keeps its
diagonal pair, so every row sees itself). The needed pairs of a group, sorted by
(qb, kb), fill a static list of `num_pairs` entries (the host's bucketed maximum
over the groups, see `pair_bucket`), so attention costs num_pairs * block^2 per
group: slots x ancestors, not G * S^2.

The next-token distribution that scores response token t sits at its parent's
slot (the last prompt slot p - 1 for t = 0). Logits are computed on U' = T - P + 1
rows: row 0 is slot p - 1 and row u >= 1 is slot P + u - 1; `logit_row[g, t]` is
the row that scores token t of response g.

Everything is [B, ...] over groups, static in (B, G, L, P, T), and jittable.
"""

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from trees import prefix_tree

MODES = ('tree', 'prompt')
# What `pack` (and `train.pack_attention`) takes; 'auto' resolves to 'blocks' or 'paths'.
ATTENTION = ('paths', 'mask', 'blocks', 'auto')


@dataclasses.dataclass(frozen=True)
class BlockCosts:
  """How `pack` picks the attention of a batch on one backend: each candidate block size
  costs num_pairs * (block^2 + overhead * block) (scores, plus per-pair gathers and
  segment sums), 'paths' G * S^2 * paths_weight per group; 'auto' takes the cheapest,
  'blocks' the cheapest block. `default` is the block when nothing is known (traced
  inputs): the power of two >= T / 8, clamped to `default`."""
  blocks: tuple
  overhead: float
  paths_weight: float
  default: tuple


# CPU: fitted on 2 cores (d 128, Dh 32, fwd + bwd; `experiments.bench_train`): per score,
# 'paths' (dense causal tiles) runs ~2x cheaper than 32 x 32 pair tiles. TPU: the MXU's
# 128 x 128 tile, FLOP-bound; GPU: tensor-core tiles (not measured here).
BLOCK_COSTS = dict(
    cpu=BlockCosts(blocks=(16, 32, 64, 128), overhead=64, paths_weight=2.0, default=(16, 64)),
    gpu=BlockCosts(blocks=(64, 128), overhead=0, paths_weight=1.0, default=(64, 128)),
    tpu=BlockCosts(blocks=(128,), overhead=0, paths_weight=1.0, default=(128, 128)))
BLOCK_COSTS.update(cuda=BLOCK_COSTS['gpu'], rocm=BLOCK_COSTS['gpu'])


def block_costs(backend=None) -> BlockCosts:
  """`BLOCK_COSTS` of `backend` (default: JAX's default backend; unknown ones as TPU)."""
  return BLOCK_COSTS.get(backend or jax.default_backend(), BLOCK_COSTS['tpu'])


@flax.struct.dataclass
class Packing:
  """Packed layout of B groups. Shapes: T slots, S = P + L path positions.

  Attributes:
    tokens: int32 [B, T], the token in each slot (0 on padding / unused slots).
    positions: int32 [B, T], each slot's position (depth from the prompt start).
    path: int32 [B, G, S], slot of position s on response g's root-to-leaf path.
    source: int32 [B, T], g * S + s for one response g through the slot at s.
    logit_row: int32 [B, G, L], row of the logits that scores token t of response g.
    prompt_len: int32 [B], true prompt lengths p.
    num_slots: int32 [B], used slots P + U.
    num_prompt_slots: static P.
    attention: static 'paths' (attend along each response's path), 'mask' (dense
      [T, T] `ancestor_mask`) or 'blocks' (block-sparse ancestor attention over
      `num_pairs` block pairs of `block` slots); all exact, see
      `experiments.models.decoder`.
    block: static slots per attention block ('blocks'; 0 otherwise).
    num_pairs: static block pairs per group ('blocks'); 0 = every lower-triangular pair
      (always enough: what a pack built from traced arrays uses).
  """
  tokens: jax.Array
  positions: jax.Array
  path: jax.Array
  source: jax.Array
  logit_row: jax.Array
  prompt_len: jax.Array
  num_slots: jax.Array
  num_prompt_slots: int = flax.struct.field(pytree_node=False, default=0)
  attention: str = flax.struct.field(pytree_node=False, default='paths')
  block: int = flax.struct.field(pytree_node=False, default=0)
  num_pairs: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def pack_len(self) -> int:
    return self.tokens.shape[-1]

  @property
  def num_blocks(self) -> int:
    """Query / key blocks per row ('blocks'): ceil(T / block)."""
    return -(-self.pack_len // self.block) if self.block else 0

  @property
  def pair_capacity(self) -> int:
    """Static length of the block-pair list ('blocks')."""
    nb = self.num_blocks
    return self.num_pairs or nb * (nb + 1) // 2


def node_ids(tokens, mask, mode: str = 'tree'):
  """Node ids [B, G, L] for `pack`: `trees.build` nodes (mode 'tree') or one per token.

  Ids lie in [1, N) with N = 1 + G * L; masked tokens get N.
  """
  if mode not in MODES:
    raise ValueError(f"unknown packing mode {mode!r}; valid: {', '.join(MODES)}.")
  g, l = tokens.shape[-2:]
  if mode == 'tree':
    return prefix_tree.build(tokens, mask).node
  ids = 1 + jnp.arange(g)[:, None] * l + jnp.arange(l)[None, :]
  return jnp.where(mask, ids, 1 + g * l).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('num_nodes',))
def num_unique(node, num_nodes: int):
  """int32 [B]: distinct nodes among `node` [B, G, L] (ids in [1, num_nodes), N dropped)."""
  b = node.shape[0]
  used = jnp.zeros((b, num_nodes + 1), bool).at[jnp.arange(b)[:, None], node.reshape(b, -1)].set(True)
  return jnp.sum(used[:, 1:num_nodes], axis=-1, dtype=jnp.int32)


def required_len(prompts, tokens, mask, mode: str = 'tree', node=None) -> int:
  """The smallest pack length T that holds every group (host int; syncs)."""
  g, l = tokens.shape[-2:]
  if node is None:
    node = node_ids(jnp.asarray(tokens), jnp.asarray(mask), mode)
  return int(prompts.shape[-1] + jnp.max(num_unique(node, 1 + g * l)))


def bucket_len(required: int, prompt_len: int, group_size: int, response_len: int,
               buckets: int = 8) -> int:
  """`required` rounded up to one of `buckets` evenly spaced lengths in (P, P + G * L].

  Few distinct lengths, so the packed step compiles a handful of times at most.
  """
  full = group_size * response_len
  step = -(-full // buckets)
  unique = required - prompt_len
  return prompt_len + min(full, -(-max(unique, 1) // step) * step)


def _pack_one(prompt, plen, tokens, mask, node, *, pack_len: int):
  """One group: prompt [P], plen [], tokens/mask/node [G, L] -> Packing fields."""
  p = prompt.shape[0]
  g, l = tokens.shape
  n = 1 + g * l
  s_len = p + l
  used = jnp.zeros(n + 1, bool).at[node.reshape(-1)].set(True).at[0].set(False).at[n].set(False)
  slot_of_node = p + jnp.cumsum(used) - 1  # [N + 1]; valid where used
  slot = jnp.where(mask, slot_of_node[node], pack_len)  # [G, L]; pack_len = dropped
  t_idx = jnp.broadcast_to(jnp.arange(l), (g, l))
  g_idx = jnp.broadcast_to(jnp.arange(g)[:, None], (g, l))

  j = jnp.arange(pack_len)
  in_prompt = j < p
  packed_tokens = jnp.zeros(pack_len, jnp.int32).at[:p].set(prompt.astype(jnp.int32))
  packed_tokens = packed_tokens.at[slot].set(tokens.astype(jnp.int32), mode='drop')
  positions = jnp.where(in_prompt, j, 0).at[slot].set(plen + t_idx, mode='drop')
  rep = jnp.zeros(pack_len, jnp.int32).at[slot].set(g_idx, mode='drop')
  source = rep * s_len + positions

  s = jnp.arange(s_len)
  resp_t = jnp.clip(s - plen, 0, l - 1)
  from_resp = jnp.take_along_axis(slot, jnp.broadcast_to(resp_t, (g, s_len)), axis=1)
  valid = (s >= plen) & (s - plen < l)
  from_resp = jnp.where(valid[None] & (from_resp < pack_len), from_resp, 0)
  path = jnp.where((s < plen)[None], s[None], from_resp).astype(jnp.int32)

  parent_slot = jnp.concatenate([jnp.full((g, 1), plen - 1), slot[:, :-1]], axis=1)
  logit_row = jnp.where(t_idx == 0, 0, parent_slot - p + 1)
  logit_row = jnp.where(mask, logit_row, 0).astype(jnp.int32)
  num_slots = p + jnp.sum(used, dtype=jnp.int32)
  return packed_tokens, positions.astype(jnp.int32), path, source.astype(jnp.int32), \
      logit_row, num_slots


@functools.partial(jax.jit, static_argnames=('pack_len',))
def pack_slots(prompts, plen, tokens, mask, node, *, pack_len):
  """The packed rows' arrays (tokens, positions, path, source, logit_row, num_slots) of B
  groups, one jitted program: `pack`'s device part (it adds the checks and the layout)."""
  return jax.vmap(functools.partial(_pack_one, pack_len=pack_len))(prompts, plen, tokens, mask,
                                                                   node)


def _concrete(x) -> bool:
  """Values readable on this host: not a tracer, not sharded over several processes."""
  return not isinstance(x, jax.core.Tracer) and getattr(x, 'is_fully_addressable', True)


def _first(bad) -> list:
  return [int(i) for i in np.argwhere(bad)[0]]


def _dtype(x):
  return x.dtype if hasattr(x, 'dtype') else np.asarray(x).dtype


def check_inputs(prompts, tokens, mask, prompt_len=None, *, pack_len: int, node=None):
  """Raises ValueError on inputs `pack` would lay out as garbage (see `pack`'s Args).

  Static: prompts int [B, P] with P >= 1; tokens int and mask bool [B, G, L] with
  G, L >= 1; prompt_len int [B]; pack_len an int > P; node int [B, G, L]. When
  concrete (not traced, not sharded over hosts): mask one run from position 0;
  1 <= prompt_len <= P; node in [1, N) on response tokens and N = 1 + G * L
  elsewhere (as `node_ids` gives them).
  """
  pshape, tshape, mshape = np.shape(prompts), np.shape(tokens), np.shape(mask)
  if len(pshape) != 2 or pshape[1] < 1:
    raise ValueError(f'prompts must be [B, P] with P >= 1; got shape {pshape}.')
  b, p = pshape
  if len(tshape) != 3 or tshape[0] != b or tshape != mshape:
    raise ValueError(f'tokens {tshape} and mask {mshape} must be [B, G, L] with '
                     f'B = {b} prompts.')
  if tshape[1] < 1 or tshape[2] < 1:
    raise ValueError(f'tokens must be [B, G, L] with G, L >= 1; got {tshape}.')
  for name, x in (('prompts', prompts), ('tokens', tokens)):
    if not jnp.issubdtype(_dtype(x), jnp.integer):
      raise ValueError(f'{name} must be integer token ids; got dtype {_dtype(x)}.')
  if _dtype(mask) != jnp.bool_:
    raise ValueError(f'mask must be boolean; got dtype {_dtype(mask)}.')
  if isinstance(pack_len, bool) or not isinstance(pack_len, (int, np.integer)):
    raise ValueError(f'pack_len must be a (static) int; got {pack_len!r}.')
  if pack_len < p + 1:
    raise ValueError(f'pack_len {pack_len} must exceed the prompt length {p}.')
  if _concrete(mask):
    m = np.asarray(mask)
    holes = m[..., 1:] & ~m[..., :-1]
    if holes.any():
      at = _first(holes)
      raise ValueError(f'mask has holes: each response must be one run from position 0, but '
                       f'mask{at[:-1] + [at[-1] + 1]} is True after a False.')
  if prompt_len is not None:
    if np.shape(prompt_len) != (b,):
      raise ValueError(f'prompt_len must be [B] = ({b},), one true length per prompt; got '
                       f'shape {np.shape(prompt_len)}.')
    if not jnp.issubdtype(_dtype(prompt_len), jnp.integer):
      raise ValueError(f'prompt_len must be integers; got dtype {_dtype(prompt_len)}.')
    if _concrete(prompt_len):
      plen = np.asarray(prompt_len)
      bad = (plen < 1) | (plen > p)
      if bad.any():
        at = _first(bad)
        raise ValueError(f'prompt_len must be in [1, P] = [1, {p}] (a response is scored from '
                         f'the last prompt token); prompt_len{at} = {plen[tuple(at)]}.')
  if node is not None:
    if np.shape(node) != tshape or not jnp.issubdtype(_dtype(node), jnp.integer):
      raise ValueError(f'node must be int [B, G, L] = {tshape} (`node_ids`); got '
                       f'{_dtype(node)} {np.shape(node)}.')
    if _concrete(node) and _concrete(mask):
      nd, m, n = np.asarray(node), np.asarray(mask), 1 + tshape[1] * tshape[2]
      bad = np.where(m, (nd < 1) | (nd >= n), nd != n)
      if bad.any():
        at = _first(bad)
        raise ValueError(f'node ids must be in [1, N) = [1, {n}) on response tokens and N '
                         f'off them (`node_ids`); node{at} = {nd[tuple(at)]} where mask is '
                         f'{bool(m[tuple(at)])}.')


def pack(prompts, tokens, mask, prompt_len=None, *, pack_len: int, mode: str = 'tree',
         node=None, attention: str = 'paths', block: int = 0, num_pairs: int = 0,
         backend=None) -> Packing:
  """Packs B groups into rows of `pack_len` slots (see the module docstring).

  Args:
    prompts: int [B, P], right-padded when `prompt_len` is given.
    tokens, mask: [B, G, L] responses (mask one run from position 0).
    prompt_len: optional int [B] (>= 1); None = all P.
    pack_len: static T >= P + (unique response tokens of the largest group); see
      `required_len` / `bucket_len`.
    mode: 'tree' (merge shared prefixes) or 'prompt' (share only the prompt).
    node: optional precomputed `node_ids` [B, G, L].
    attention: 'paths', 'mask', 'blocks' (see `Packing`) or 'auto': 'blocks' or
      'paths', whichever `block_costs(backend)` rates cheaper for this batch ('paths'
      for traced inputs, whose pair counts are unknown).
    block: 'blocks' / 'auto': slots per block; 0 = the cheapest of the backend's
      candidates (concrete inputs) or `default_block(pack_len)` (traced).
    num_pairs: 'blocks' with a given block: static block pairs per group; 0 = the
      largest group's count rounded up by `pair_bucket` (concrete inputs) or every
      lower-triangular pair (traced inputs).
    backend: whose `block_costs` to use (default: JAX's default backend).
  Raises:
    ValueError: a malformed input (`check_inputs`), a group that does not fit in
      pack_len or in num_pairs (values checked when concrete), a bad block / num_pairs.
  """
  check_inputs(prompts, tokens, mask, prompt_len, pack_len=pack_len, node=node)
  prompts, tokens, mask = jnp.asarray(prompts), jnp.asarray(tokens), jnp.asarray(mask)
  b, p = prompts.shape
  if attention not in ATTENTION:
    raise ValueError(f"unknown packed attention {attention!r}; valid: {', '.join(ATTENTION)}.")
  for name, x in (('block', block), ('num_pairs', num_pairs)):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
      raise ValueError(f'{name} must be a (static) int >= 0; got {x!r}.')
  if attention not in ('blocks', 'auto') and (block or num_pairs):
    raise ValueError(f'block / num_pairs are for attention "blocks" or "auto", not '
                     f'{attention!r}.')
  if num_pairs and not block:
    raise ValueError('num_pairs needs an explicit block (the count depends on it).')
  g, l = tokens.shape[1:]
  if node is None:
    node = node_ids(tokens, mask, mode)
  plen = jnp.full((b,), p, jnp.int32) if prompt_len is None else jnp.asarray(prompt_len, jnp.int32)
  concrete = _concrete(node)
  if concrete:
    need = p + int(np.max(np.asarray(num_unique(node, 1 + g * l))))
    if need > pack_len:
      raise ValueError(f'a group needs {need} packed slots (prompt {p} + its unique response '
                       f'tokens) but pack_len is {pack_len}; raise train.pack_len (or set it '
                       f'to 0 for automatic buckets), or use packing "none".')
  toks, pos, path, source, logit_row, num_slots = pack_slots(prompts, plen, tokens, mask, node,
                                                             pack_len=pack_len)
  pk = Packing(tokens=toks, positions=pos, path=path, source=source, logit_row=logit_row,
               prompt_len=plen, num_slots=num_slots, num_prompt_slots=p,
               attention='paths' if attention == 'auto' else attention)
  if attention in ('paths', 'mask') or (attention == 'auto' and not concrete):
    return pk
  costs = block_costs(backend)
  candidates = (block,) if block else costs.blocks if concrete else (
      default_block(pack_len, backend),)
  best = None
  for bk in candidates:
    pb = pk.replace(attention='blocks', block=int(bk))
    nb = pb.num_blocks
    full = nb * (nb + 1) // 2
    if num_pairs > full:
      raise ValueError(f'num_pairs {num_pairs} exceeds the {full} lower-triangular pairs of '
                       f'{nb} blocks.')
    m = num_pairs or full
    if concrete:
      count = int(np.max(np.asarray(block_pair_count(pb))))
      if num_pairs and count > num_pairs:
        raise ValueError(f'a group needs {count} attention block pairs but num_pairs is '
                         f'{num_pairs}; pass num_pairs=0 for the bucketed count.')
      m = num_pairs or pair_bucket(count, nb)
    cost = m * (bk * bk + costs.overhead * bk)
    if best is None or cost < best[0]:
      best = (cost, pb.replace(num_pairs=int(m)))
  if attention == 'auto' and best[0] >= costs.paths_weight * g * (p + l) ** 2:
    return pk
  return best[1]


def default_block(pack_len: int, backend=None) -> int:
  """Slots per attention block ('blocks') for rows of `pack_len` slots when the counts are
  unknown: the power of two >= pack_len / 8, clamped to `block_costs(backend).default`."""
  low, high = block_costs(backend).default
  return int(min(high, max(low, 1 << max(0, -(-pack_len // 8) - 1).bit_length())))


def pair_bucket(count: int, num_blocks: int) -> int:
  """`count` block pairs rounded up to a bucket: multiples of 2^(floor(log2 count) - 3),
  so at most 8 lengths per doubling, at most 12.5 % extra pairs, and at most every
  lower-triangular pair of `num_blocks` blocks."""
  full = num_blocks * (num_blocks + 1) // 2
  if count < 1:
    raise ValueError(f'a packing has at least one block pair per block; got {count}.')
  step = max(1, 2 ** (int(count).bit_length() - 4))
  return min(full, -(-int(count) // step) * step)


@jax.jit
def ancestor_mask(packing: Packing):
  """bool [B, T, T]: slot i attends to slot j iff j is i or an ancestor of i.

  Slots outside every path (prompt padding, unused) see only themselves.
  """
  b, t = packing.tokens.shape
  s_len = packing.path.shape[-1]
  rep = packing.source // s_len  # [B, T]
  anc = jnp.take_along_axis(packing.path, rep[:, :, None], axis=1)  # [B, T, S]
  keep = jnp.arange(s_len)[None, None] <= packing.positions[:, :, None]
  rows = jnp.arange(t)[None, :, None]
  mask = jnp.zeros((b, t, t), bool).at[jnp.arange(b)[:, None, None], rows, anc].max(keep)
  j = jnp.arange(t)[None]
  p = packing.num_prompt_slots
  valid = (j < packing.prompt_len[:, None]) | ((j >= p) & (j < packing.num_slots[:, None]))
  return (mask & valid[:, :, None]) | jnp.eye(t, dtype=bool)[None]


def _valid_slots(packing: Packing):
  """bool [B, T]: slots on some path (the true prompt and the used response slots)."""
  j = jnp.arange(packing.pack_len)[None]
  p = packing.num_prompt_slots
  return (j < packing.prompt_len[:, None]) | ((j >= p) & (j < packing.num_slots[:, None]))


def _check_blocks(packing: Packing):
  if packing.attention != 'blocks' or packing.block < 1:
    raise ValueError(f'block attention needs a packing with attention "blocks" and a block '
                     f'size (`pack(attention="blocks")`); got attention {packing.attention!r}, '
                     f'block {packing.block}.')


@jax.jit
def block_needed(packing: Packing):
  """bool [B, nb, nb]: block pair (qb, kb) holds some (query, ancestor-or-self key), or
  qb == kb. Exact at the block level (see the module docstring)."""
  _check_blocks(packing)
  b, t = packing.tokens.shape
  g, s_len = packing.path.shape[1:]
  bk, nb = packing.block, packing.num_blocks
  pos, valid = packing.positions, _valid_slots(packing)
  big = jnp.iinfo(jnp.int32).max
  key_pos = jnp.where(_on_path(packing), pos[:, None], big)  # [B, G, T]
  key_pos = jnp.pad(key_pos, ((0, 0), (0, 0), (0, nb * bk - t)), constant_values=big)
  min_key = key_pos.reshape(b, g, nb, bk).min(-1)  # [B, G, nb]
  rep = packing.source // s_len  # [B, T]
  max_q = jnp.full((b, g, nb), -1, jnp.int32).at[
      jnp.arange(b)[:, None], rep, jnp.arange(t)[None] // bk].max(jnp.where(valid, pos, -1))

  def one(acc, mg):  # one response at a time: [B, nb, nb] live, not [B, G, nb, nb]
    mq, mk = mg
    return acc | (mq[:, :, None] >= mk[:, None, :]), None
  needed, _ = jax.lax.scan(one, jnp.zeros((b, nb, nb), bool),
                           (jnp.moveaxis(max_q, 1, 0), jnp.moveaxis(min_key, 1, 0)))
  return needed | jnp.eye(nb, dtype=bool)[None]


@jax.jit
def block_pair_count(packing: Packing):
  """int32 [B]: the block pairs each group needs (`block_needed`)."""
  return jnp.sum(block_needed(packing), axis=(1, 2), dtype=jnp.int32)


@jax.jit
def block_pairs(packing: Packing):
  """(qb, kb, count): int32 [B, M] query and key blocks of each group's needed pairs,
  sorted by (qb, kb), M = `packing.pair_capacity`; unused entries are (nb, 0), a
  segment the attention drops. count int32 [B] is the number needed: a group with
  count > M does not fit (its pairs past M are missing)."""
  needed = block_needed(packing)
  b, nb = needed.shape[:2]
  flat = needed.reshape(b, nb * nb)
  idx = jax.vmap(lambda f: jnp.nonzero(f, size=packing.pair_capacity, fill_value=nb * nb)[0])(
      flat)
  return ((idx // nb).astype(jnp.int32), (idx % nb).astype(jnp.int32),
          jnp.sum(flat, axis=-1, dtype=jnp.int32))


def _on_path(packing: Packing):
  """bool [B, G, T]: slot j lies on response g's path (and on some path at all)."""
  b, t = packing.tokens.shape
  g = packing.path.shape[1]
  pos = jnp.broadcast_to(packing.positions[:, None], (b, g, t))
  on = jnp.take_along_axis(packing.path, pos, axis=2) == jnp.arange(t)
  return on & _valid_slots(packing)[:, None]


def _blocks_of(x, nb: int, bk: int, axis: int = 1):
  """x [B, ..., T, ...] padded with zeros to nb * bk along `axis` and split in blocks."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, nb * bk - x.shape[axis])
  x = jnp.pad(x, pad)
  return x.reshape(x.shape[:axis] + (nb, bk) + x.shape[axis + 1:])


@jax.jit
def block_mask(packing: Packing, qb, kb):
  """bool [B, M, block, block]: query slot qb * block + a attends to key slot kb * block + c
  (ancestor-or-self; slots past T and off every path see only themselves).

  Each key slot carries a bitset of the responses through it (W = ceil(G / 32) words);
  query i tests bit g_i = source[i] // S, so the mask costs elementwise work, no gathers
  per (query, key)."""
  _check_blocks(packing)
  b, t = packing.tokens.shape
  g, s_len = packing.path.shape[1:]
  bk, nb = packing.block, packing.num_blocks
  words = -(-g // 32)
  on = jnp.pad(_on_path(packing), ((0, 0), (0, 32 * words - g), (0, 0)))
  bits = jnp.sum(on.reshape(b, words, 32, t).astype(jnp.uint32)
                 << jnp.arange(32, dtype=jnp.uint32)[:, None], axis=2, dtype=jnp.uint32)
  take = jax.vmap(lambda x, i: jnp.take(x, i, axis=0, mode='clip'))  # whole blocks
  kbits = take(jnp.moveaxis(_blocks_of(bits, nb, bk, axis=2), 1, 3), kb)  # [B, M, bk, W]
  rep = take(_blocks_of(packing.source // s_len, nb, bk), qb)  # [B, M, bk]
  pos = _blocks_of(packing.positions, nb, bk)
  pq, pk = take(pos, qb), take(pos, kb)
  word = kbits[..., 0][..., None, :]
  for w in range(1, words):  # each query's word of each key's bitset
    word = jnp.where((rep // 32 == w)[..., :, None], kbits[..., w][..., None, :], word)
  on_path = (word >> (rep % 32).astype(jnp.uint32)[..., :, None]) & 1
  anc = (on_path == 1) & (pk[..., None, :] <= pq[..., :, None])
  self_ = (qb == kb)[..., None, None] & jnp.eye(bk, dtype=bool)
  return anc | self_


def iid_block_pairs(prompt_len: int, group_size: int, response_len: int, block: int,
                    pack_len: int = 0) -> int:
  """Block pairs ('blocks') of a group with nothing shared past the prompt: P prompt
  slots, then G responses of L slots each (the layout of `pack` for i.i.d. groups of
  full-length responses; host numpy, for analytic FLOPs). pack_len: T (0 = P + G * L)."""
  p, g, l = prompt_len, group_size, response_len
  t = pack_len or p + g * l
  if min(p, g, l, block) < 1 or t < p + g * l:
    raise ValueError(f'need P, G, L, block >= 1 and pack_len >= P + G * L; got P={p}, G={g}, '
                     f'L={l}, block={block}, pack_len={t}.')
  nb = -(-t // block)
  lo = np.arange(nb) * block  # first slot of each block
  hi = np.minimum(lo + block, p + g * l) - 1  # last used slot (< lo: none)
  resp = lambda s: (s - p) // l  # response of a response slot
  r_lo = np.where(lo >= p, resp(np.maximum(lo, p)), 0)  # responses a block overlaps
  r_hi = np.where(hi >= p, resp(np.maximum(hi, p)), -1)
  used = hi >= lo
  qb, kb = np.tril_indices(nb)
  prompt_key = lo[kb] < p  # a prompt key precedes every query of a later block
  same = np.maximum(r_lo[qb], r_lo[kb]) <= np.minimum(r_hi[qb], r_hi[kb])
  needed = used[qb] & (prompt_key | same)
  return int(np.sum(needed | (qb == kb)))
