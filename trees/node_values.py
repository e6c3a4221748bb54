"""Segment reductions over the nodes of prefix trees, and gathers back to tokens.

Every reduction takes a per-response quantity x [..., G] (aggregated over the
responses through each node; the root sees all G) or a per-token quantity
x [..., G, L] (aggregated over the tokens at each node; the root has none) and
returns per-node values [..., N]. Nodes with nothing to reduce get 0, so every
output is finite. All reductions are `jax.ops.segment_*` over `tree.node`.
"""

import functools

import jax
import jax.numpy as jnp

from trees.prefix_tree import PrefixTree, expand_levels


def per_group(fn, static=()):
  """Lifts fn(tree, *arrays, **static) written for one group to any leading dims (jitted)."""

  @functools.wraps(fn)
  @functools.partial(jax.jit, static_argnames=tuple(static))
  def lifted(tree: PrefixTree, *arrays, **kwargs):
    batch = tree.batch_shape
    flat = lambda x: jnp.asarray(x).reshape((-1,) + jnp.shape(x)[len(batch):])
    out = jax.vmap(lambda t, *a: fn(t, *a, **kwargs))(
        jax.tree.map(flat, tree), *map(flat, arrays))
    return jax.tree.map(lambda y: y.reshape(batch + y.shape[1:]), out)

  return lifted


def _segment(op, tree, x, identity):
  """op over the tokens of each node. x: [G] (broadcast over tokens) or [G, L]."""
  x = jnp.asarray(x, jnp.float32)
  if x.shape == tree.mask.shape[:1]:
    x = jnp.broadcast_to(x[:, None], tree.mask.shape)
  elif x.shape != tree.mask.shape:
    raise ValueError(f"expected per-response [G]={tree.mask.shape[:1]} or per-token "
                     f"[G, L]={tree.mask.shape} values; got shape {x.shape}.")
  values = jnp.where(tree.mask, x, identity).reshape(-1)
  return op(values, tree.node.reshape(-1), num_segments=tree.num_nodes)


def _is_per_response(x):
  return jnp.ndim(x) == 1


def _count(tree, x):
  out = _segment(jax.ops.segment_sum, tree, jnp.ones(jnp.shape(x)), 0.0)
  return out.at[0].set(x.shape[0]) if _is_per_response(x) else out


def _sum(tree, x):
  out = _segment(jax.ops.segment_sum, tree, x, 0.0)
  return out.at[0].set(jnp.sum(x)) if _is_per_response(x) else out


def _mean(tree, x):
  return _sum(tree, x) / jnp.maximum(_count(tree, x), 1.0)


def _std(tree, x, ddof=0):
  count, mean = _count(tree, x), _mean(tree, x)
  centred = jnp.asarray(x, jnp.float32)
  if _is_per_response(x):
    centred = centred[:, None]
  sq = _sum(tree, (centred - _to_tokens(tree, mean)) ** 2 * tree.mask)
  if _is_per_response(x):  # The root's deviations are over all responses.
    sq = sq.at[0].set(jnp.sum((x - mean[0]) ** 2))
  return jnp.sqrt(jnp.where(count > ddof, sq / jnp.maximum(count - ddof, 1.0), 0.0))


def _extremum(op, identity):
  def reduce(tree, x):
    out = _segment(op, tree, x, identity)
    if _is_per_response(x):
      out = out.at[0].set(op(x, jnp.zeros(x.shape, jnp.int32), num_segments=1)[0])
    return jnp.where(_count(tree, x) > 0, out, 0.0)
  return reduce


def _to_tokens(tree, node_values, before=False):
  ids = tree.parent if before else tree.node
  return jnp.take(node_values, ids, mode="fill", fill_value=0)


node_count = per_group(_count)
node_count.__doc__ = "Responses (x [..., G]) or tokens (x [..., G, L]) at each node. -> [..., N]"
node_sum = per_group(_sum)
node_sum.__doc__ = "Sum of x over each node's responses or tokens. -> [..., N]"
node_mean = per_group(_mean)
node_mean.__doc__ = "Mean of x over each node (0 where empty); V(v) for x = rewards. -> [..., N]"
node_std = per_group(_std, static=("ddof",))
node_std.__doc__ = "Std of x over each node, `ddof` as numpy (0 where count <= ddof). -> [..., N]"
node_max = per_group(_extremum(jax.ops.segment_max, -jnp.inf))
node_max.__doc__ = "Maximum of x over each node (0 where empty). -> [..., N]"
node_min = per_group(_extremum(jax.ops.segment_min, jnp.inf))
node_min.__doc__ = "Minimum of x over each node (0 where empty). -> [..., N]"
to_tokens = per_group(_to_tokens, static=("before",))
to_tokens.__doc__ = """Gathers per-node values [..., N] to tokens [..., G, L] (0 on masked tokens).

`before=False` gives the value at the state after each token (s_{t+1}),
`before=True` at the state before it (s_t; the root at t = 0).
"""


def _prefix_values(tree, rewards):
  """One group: node means per level from prefix sums in trie order, expanded to tokens.

  V(s_t) is the previous token's V(s_{t+1}), and the root's value is the
  level-0 entry (the run of all G), so where a response's run does not change
  the two values come from the same arithmetic and are equal bit for bit.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  sums = jnp.concatenate([jnp.zeros(1), jnp.cumsum(rewards[tree.order])])
  count = tree.run_last - tree.run_first + 1
  table = (sums[tree.run_last + 1] - sums[tree.run_first]) / count  # [G, levels]
  v_after = expand_levels(table, tree.level)
  v_before = jnp.concatenate([table[:, :1], v_after[:, :-1]], axis=1)
  return jnp.where(tree.mask, v_before, 0.0), jnp.where(tree.mask, v_after, 0.0)


def prefix_values(tree: PrefixTree, rewards) -> tuple[jax.Array, jax.Array]:
  """TEMPO's Prefix-to-Tree values V(s_t) and V(s_{t+1}) at every token.

  Equal to `to_tokens(tree, node_mean(tree, rewards), before=...)`, computed
  per level from prefix sums over the trie-order runs, then expanded to tokens
  by one column gather, instead of a scatter over [G, L].

  Args:
    tree: a `PrefixTree` of [..., G, L] groups.
    rewards: float [..., G] outcome rewards.

  Returns:
    (v_before, v_after), each float32 [..., G, L], 0 on masked tokens:
    v_before[g, t] is the mean reward of the responses that share response
    g's first t tokens (the whole group at t = 0); v_after[g, t] the same
    over its first t + 1 tokens.
  """
  return _batched_prefix_values(tree, rewards)


_batched_prefix_values = per_group(_prefix_values)
