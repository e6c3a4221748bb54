"""Step graphs: the states a group of multi-turn trajectories visited, merged into nodes.

A group is G trajectories of up to K turns; trajectory g takes n_g turns (a run
from turn 0), `state_ids[g, k]` is the state at the start of turn k (its
anchor observation) and `state_ids[g, n_g]` the state after its last turn;
indices past n_g are ignored. States with equal ids within a group are one
node, whichever trajectory and turn reached them (ids are only compared for
equality, and only within a group), so a group has at most N = G·(K+1) nodes
(static). Turn k of trajectory g is the edge node[g, k] -> node[g, k+1].

Nodes are numbered 0, 1, ... by their first visit in (g, k) row-major order,
found by one lexicographic sort (O(N log N)); reductions over nodes are
`jax.ops.segment_*`, with the id N meaning "no node". Everything is written
for one group and lifted to leading dims with vmap (`map_groups`).
"""

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class StepGraph:
  """The step graph of each group. Shapes: [..., G, K+1] per state slot, [..., N] per node.

  Attributes:
    node: int32 [..., G, K+1], the node of state_ids[g, k]; -1 for k > n_g.
    num_nodes: int32 [...], nodes in use (ids 0 .. num_nodes - 1).
    visits: int32 [..., N], taken turns that start at the node ((g, k) with k < n_g;
      a trajectory that returns to a state counts each visit).
    mean_return, std_return: float32 [..., N], mean and population std of the
      discounted return from the node over its visits (0 without visits; the
      mean of equal returns is exactly that return).
    min_return, max_return: float32 [..., N], over the visits (0 without visits).
    returns: float32 [..., G, K], the discounted return from each taken turn,
      G_{g,k} = Σ_{j≥k} γ^{j−k} r_{g,j}; 0 on untaken turns.
    adjacency: bool [..., N, N], adjacency[u, v]: some taken turn goes from u to v.
    terminal: bool [..., N], some trajectory ends at the node.
    success: bool [..., N], some successful trajectory ends at the node.
    distance_to_success: float32 [..., N], the fewest turns from the node to a
      success node along the group's edges (0 on success nodes); inf where none
      is reachable and on unused slots.
  """

  node: jax.Array
  num_nodes: jax.Array
  visits: jax.Array
  mean_return: jax.Array
  std_return: jax.Array
  min_return: jax.Array
  max_return: jax.Array
  returns: jax.Array
  adjacency: jax.Array
  terminal: jax.Array
  success: jax.Array
  distance_to_success: jax.Array

  @property
  def max_nodes(self) -> int:
    """N = G·(K+1), the static number of node slots per group."""
    return self.visits.shape[-1]

  @property
  def edge_valid(self) -> jax.Array:
    """bool [..., G, K]: turn (g, k) is an edge (it was taken)."""
    return (self.node[..., :-1] >= 0) & (self.node[..., 1:] >= 0)


def map_groups(fn, batch_shape, *arrays):
  """fn written for one group, applied to arrays with leading dims `batch_shape` (vmap).

  Every array's first len(batch_shape) dims are flattened into one vmapped
  axis and restored on every output leaf. None arguments pass through as None.
  """
  batch_shape = tuple(batch_shape)
  nb = len(batch_shape)
  flat = [None if x is None else jnp.reshape(x, (-1,) + jnp.shape(x)[nb:]) for x in arrays]
  axes = [None if x is None else 0 for x in flat]
  out = jax.vmap(fn, in_axes=axes)(*flat)
  return jax.tree.map(lambda y: y.reshape(batch_shape + y.shape[1:]), out)


def unique_ids(keys, valid):
  """Compact ids of equal key tuples, numbered by first occurrence (one group).

  Args:
    keys: a tuple of int arrays [M] (compared as tuples, lexicographically).
    valid: bool [M]; invalid entries get id -1 and are never merged.
  Returns:
    (ids int32 [M], first bool [M] True on the first occurrence of each id,
    count int32 [] the number of ids).
  """
  m = valid.shape[0]
  slot = jnp.arange(m, dtype=jnp.int32)
  keys = tuple(jnp.asarray(k) for k in keys)
  order = jnp.lexsort((slot,) + keys[::-1] + (~valid,)).astype(jnp.int32)
  sorted_keys = [k[order] for k in keys] + [valid[order]]
  differs = jnp.zeros(m - 1, bool)
  for k in sorted_keys:  # over the key columns, not over data
    differs = differs | (k[1:] != k[:-1])
  new_run = jnp.concatenate([jnp.ones(1, bool), differs])
  run = jnp.cumsum(new_run) - 1
  run_first = jax.ops.segment_min(order, run, num_segments=m)  # earliest slot of each run
  first_slot = jnp.zeros(m, jnp.int32).at[order].set(run_first[run])
  first = valid & (first_slot == slot)
  rank = (jnp.cumsum(first) - 1).astype(jnp.int32)
  ids = jnp.where(valid, rank[first_slot], -1)
  return ids, first, jnp.sum(first, dtype=jnp.int32)


def discounted_turn_returns(rewards, turn_mask, gamma):
  """G_k = Σ_{j≥k} γ^{j−k} r_j over taken turns, along the last axis; 0 on untaken ones.

  A sequential reverse scan over the K turns (K is small), so equal reward
  suffixes give bitwise-equal returns wherever they start.
  """
  x = jnp.where(turn_mask, rewards, 0.0).astype(jnp.float32)
  a = jnp.where(turn_mask, jnp.asarray(gamma, jnp.float32), 0.0)
  a, x = jnp.broadcast_arrays(a, x)

  def step(later, inputs):
    a_k, x_k = inputs
    now = x_k + a_k * later
    return now, now

  _, out = jax.lax.scan(step, jnp.zeros(x.shape[:-1], jnp.float32),
                        (jnp.moveaxis(a, -1, 0), jnp.moveaxis(x, -1, 0)), reverse=True)
  return jnp.where(turn_mask, jnp.moveaxis(out, 0, -1), 0.0)


def _gather(values, index, fill=0):
  """values[index] with `fill` where index < 0 (one group: values [N], index any shape)."""
  n = values.shape[0]
  return jnp.where(index >= 0, values[jnp.clip(index, 0, n - 1)], jnp.asarray(fill, values.dtype))


@jax.jit
def gather_nodes(values, node):
  """Per-node values [..., N] at node indices [..., *S] (same leading dims); 0 where node < 0."""
  batch = values.shape[:-1]
  return map_groups(_gather, batch, values, node)


def _segment(op, x, seg, n, identity):
  """op of x over segments 0..n-1; seg == n (or anything invalid mapped to n) is dropped."""
  out = op(jnp.where(seg < n, x, identity).reshape(-1), seg.reshape(-1), num_segments=n + 1)
  return out[:n]


def build_group(state_ids, rewards, turn_mask, success=None, gamma=1.0) -> StepGraph:
  """The step graph of one group. state_ids [G, K+1], rewards [G, K], turn_mask [G, K],
  success bool [G] or None (then: episode return > 0)."""
  g, k1 = state_ids.shape
  n = g * k1
  turn_mask = jnp.asarray(turn_mask, bool)
  rewards = jnp.where(turn_mask, jnp.asarray(rewards, jnp.float32), 0.0)
  lengths = jnp.sum(turn_mask, axis=-1, dtype=jnp.int32)
  valid = jnp.arange(k1) <= lengths[:, None]
  ids, _, num_nodes = unique_ids((jnp.asarray(state_ids).reshape(-1),), valid.reshape(-1))
  node = ids.reshape(g, k1)

  returns = discounted_turn_returns(rewards, turn_mask, gamma)
  src = jnp.where(turn_mask, node[:, :-1], n)  # n: dropped by the segment reductions
  dst = jnp.where(turn_mask, node[:, 1:], n)
  visits = _segment(jax.ops.segment_sum, jnp.ones_like(returns), src, n, 0.0)
  mean = _segment(jax.ops.segment_sum, returns, src, n, 0.0) / jnp.maximum(visits, 1.0)
  dev = returns - _gather(mean, jnp.where(turn_mask, src, -1))
  var = _segment(jax.ops.segment_sum, dev ** 2, src, n, 0.0) / jnp.maximum(visits, 1.0)
  seen = visits > 0
  lo = jnp.where(seen, _segment(jax.ops.segment_min, returns, src, n, jnp.inf), 0.0)
  hi = jnp.where(seen, _segment(jax.ops.segment_max, returns, src, n, -jnp.inf), 0.0)
  mean = jnp.where(hi == lo, lo, mean)  # equal returns: their mean exactly (no rounding)

  adjacency = jnp.zeros((n + 1, n + 1), bool).at[src, dst].set(True)[:n, :n]
  end = jnp.take_along_axis(node, lengths[:, None], axis=-1)[:, 0]
  if success is None:
    success = jnp.sum(rewards, axis=-1) > 0
  terminal = jnp.zeros(n + 1, bool).at[end].set(True)[:n]
  success_node = jnp.zeros(n + 1, bool).at[jnp.where(success, end, n)].set(True)[:n]

  def relax(state):  # Bellman-Ford with unit edge weights: d(u) = min(d(u), 1 + d(v)).
    d, _, i = state
    step = _segment(jax.ops.segment_min, _gather(d, jnp.where(turn_mask, dst, -1), jnp.inf) + 1.0,
                    src, n, jnp.inf)
    new = jnp.minimum(d, step)
    return new, jnp.any(new < d), i + 1

  d0 = jnp.where(success_node, 0.0, jnp.inf).astype(jnp.float32)
  distance, _, _ = jax.lax.while_loop(lambda s: s[1] & (s[2] < n), relax,
                                      (d0, jnp.asarray(True), jnp.asarray(0)))
  return StepGraph(node=node, num_nodes=num_nodes, visits=visits.astype(jnp.int32),
                   mean_return=mean, std_return=jnp.sqrt(var), min_return=lo, max_return=hi,
                   returns=returns, adjacency=adjacency, terminal=terminal, success=success_node,
                   distance_to_success=distance)


@jax.jit
def build_step_graph(state_ids, rewards, turn_mask, success=None, gamma=1.0) -> StepGraph:
  """The step graph of every group (jitted; leading dims are vmapped).

  Args:
    state_ids: int [..., G, K+1], the state at the start of each turn, index n_g
      the state after the last turn (later indices are ignored).
    rewards: float [..., G, K] per-turn rewards (read on taken turns only).
    turn_mask: bool [..., G, K], True on taken turns (a run from turn 0).
    success: bool [..., G], the trajectory ended in a success state, or None:
      then a trajectory succeeded when its (undiscounted) episode return is > 0.
    gamma: discount of the per-node returns.
  Returns:
    `StepGraph` with N = G·(K+1) node slots per group.
  """
  state_ids = jnp.asarray(state_ids)
  if state_ids.ndim < 2:
    raise ValueError(f"state_ids must be [..., G, K+1]; got shape {state_ids.shape}.")
  batch = state_ids.shape[:-2]
  fn = lambda s, r, m, ok: build_group(s, r, m, ok, gamma)
  return map_groups(fn, batch, state_ids, rewards, turn_mask, success)
