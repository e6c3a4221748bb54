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
`experiments.models.decoder`), or as a dense [T, T] mask (`ancestor_mask`).

The next-token distribution that scores response token t sits at its parent's
slot (the last prompt slot p - 1 for t = 0). Logits are computed on U' = T - P + 1
rows: row 0 is slot p - 1 and row u >= 1 is slot P + u - 1; `logit_row[g, t]` is
the row that scores token t of response g.

Everything is [B, ...] over groups, static in (B, G, L, P, T), and jittable.
"""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from trees import prefix_tree

MODES = ('tree', 'prompt')
ATTENTION = ('paths', 'mask')


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
    attention: static 'paths' (attend along each response's path) or 'mask' (dense
      [T, T] `ancestor_mask`); both exact, see `experiments.models.decoder`.
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

  @property
  def pack_len(self) -> int:
    return self.tokens.shape[-1]


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
def _pack_all(prompts, plen, tokens, mask, node, *, pack_len):
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
         node=None, attention: str = 'paths') -> Packing:
  """Packs B groups into rows of `pack_len` slots (see the module docstring).

  Args:
    prompts: int [B, P], right-padded when `prompt_len` is given.
    tokens, mask: [B, G, L] responses (mask one run from position 0).
    prompt_len: optional int [B] (>= 1); None = all P.
    pack_len: static T >= P + (unique response tokens of the largest group); see
      `required_len` / `bucket_len`.
    mode: 'tree' (merge shared prefixes) or 'prompt' (share only the prompt).
    node: optional precomputed `node_ids` [B, G, L].
    attention: 'paths' or 'mask' (see `Packing`).
  Raises:
    ValueError: a malformed input (`check_inputs`), or a group that does not fit in
      pack_len (values checked when concrete).
  """
  check_inputs(prompts, tokens, mask, prompt_len, pack_len=pack_len, node=node)
  prompts, tokens, mask = jnp.asarray(prompts), jnp.asarray(tokens), jnp.asarray(mask)
  b, p = prompts.shape
  if attention not in ATTENTION:
    raise ValueError(f"unknown packed attention {attention!r}; valid: {', '.join(ATTENTION)}.")
  g, l = tokens.shape[1:]
  if node is None:
    node = node_ids(tokens, mask, mode)
  plen = jnp.full((b,), p, jnp.int32) if prompt_len is None else jnp.asarray(prompt_len, jnp.int32)
  if _concrete(node):
    need = p + int(np.max(np.asarray(num_unique(node, 1 + g * l))))
    if need > pack_len:
      raise ValueError(f'a group needs {need} packed slots (prompt {p} + its unique response '
                       f'tokens) but pack_len is {pack_len}; raise train.pack_len (or set it '
                       f'to 0 for automatic buckets), or use packing "none".')
  toks, pos, path, source, logit_row, num_slots = _pack_all(prompts, plen, tokens, mask, node,
                                                            pack_len=pack_len)
  return Packing(tokens=toks, positions=pos, path=path, source=source, logit_row=logit_row,
                 prompt_len=plen, num_slots=num_slots, num_prompt_slots=p, attention=attention)


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
