"""Turn-level credit for multi-turn agents: `fn(turns, **hparams) -> advantages [..., G, K]`.

Every estimator takes a `credit.turns.Turns` batch and returns float32 turn
advantages [..., G, K], 0 on untaken turns; `<name>_tokens(rollouts, turns,
**hparams)` spreads them over the trained tokens ([..., G, L], 0 where
token_turn < 0 or the rollouts' mask is False). States are compared within a
group only, through its step graph (`trees.step_graph`). All functions are
written for one group ([G, K]) and vmapped over the leading dims, except
`gtpo(normalize='batch')`, whose statistics span the whole input.

Outcome counterparts, each tested: with no state shared between trajectories,
`gigpo` is its episode term (GRPO / Dr. GRPO), `salt` and `graphgpo` are GRPO
on every turn, `gagpo` is 0 (V̂(s) is the trajectory's own return) except
Dr. GRPO on turn 0 when only the start state is shared, and `gtpo` with
γ = 1, outcome-only rewards and equal lengths is GRPO on every turn; `cast` with α = 0
is GRPO on every turn, and its first form (`CAST_VALUE_DIFFERENCE`) sums along a
trajectory to V*(s_n) − V*(s_0).

Inputs are validated on every call (`credit.validate_turns`, values when concrete): a
non-finite reward on a taken turn, a turn_mask that is not a run from turn 0, a
token_turn outside [-1, K), non-finite values_star or NaN / +inf answer_logprobs on a
visited state raise ValueError. Under jit only shapes are checked (validate on the host
first, as `experiments.training.loop.train` does); a NaN input then gives NaN, never 0,
on its trajectory's turns that read it (and on the turns normalised with them), and
leaves the other groups as they are (except `gtpo(normalize='batch')`, whose
statistics span all groups).

Registered in `credit.registry` under the same names with `needs=('turns',)`:
`credit.get('gigpo')(rollouts)` reads `rollouts.turns` (a `Turns` with `token_turn`).
`AGENT_ESTIMATORS` (turn level) and `AGENT_TOKEN_ESTIMATORS` list them by name. `cast` and
`igpo` live in `credit.turn_signals` (re-exported here); the shared pieces in
`credit.turn_base`.
"""

import functools

import jax
import jax.numpy as jnp

from credit.registry import register
from credit.returns import reverse_linear_scan
from credit.turn_base import (_EPS, _bucket_norm, _check_unit, _from_rollouts, _gather,
                              _group_index, _grpo, _lift, _token_level, _validated,
                              _weighted_norm)
from credit.turn_signals import (CAST_COMPRESS, CAST_NORMALIZE, CAST_OUTCOMES,  # noqa: F401
                                 CAST_SIGNALS, CAST_VALUE_DIFFERENCE, cast, igpo)
from credit.turns import Turns, check_turn_shapes, discounted_returns, episode_returns
from trees.step_graph import build_group, unique_ids


# --------------------------------------------------------------------------- GiGPO


@_validated
def gigpo(turns: Turns, gamma: float = 0.95, omega: float = 1.0, mode: str = "mean_norm",
          episode_stats_per_step: bool = True, eps: float = _EPS):
  """GiGPO (Feng et al. 2025, eqs. 3, 5–8): A = A^E + ω·A^S.

  Episode term (eq. 3): A^E_i = R_i − μ (`mode='mean_norm'`, the public
  code's default) or (R_i − μ)/(σ + ε) (`'mean_std_norm'`), R_i the sum of
  trajectory i's turn rewards. With `episode_stats_per_step=True` (verl-agent's
  `compute_mean_std_cross_steps`, on by default there and here) μ and σ are
  over step rows: trajectory i enters n_i times, so long episodes weigh more in
  the baseline (and trajectories of no turns do not enter); False gives GRPO's
  per-trajectory statistics over all G. σ is Bessel-corrected; one row in all
  gives μ = 0, σ = 1; all returns equal give 0.
  Step term (eqs. 5–7): discounted step returns G_{i,k} (γ = 0.95) grouped by
  identical anchor state within the group (any trajectory, any turn, repeated
  visits included), A^S = G − mean of its bucket (/ (Bessel std + ε) in
  `'mean_std_norm'`); buckets of one, or of equal returns, give 0.
  Returns float32 [..., G, K], 0 on untaken turns.
  """
  if mode not in ("mean_norm", "mean_std_norm"):
    raise ValueError(f"gigpo mode must be 'mean_norm' or 'mean_std_norm'; got {mode!r}.")
  _check_unit("gamma", gamma)
  return _lift(_gigpo_group, turns, (gamma, omega, eps), scale=mode == "mean_std_norm",
               per_step=bool(episode_stats_per_step))


def _gigpo_group(state_ids, rewards, turn_mask, success, gamma, omega, eps, scale, per_step):
  graph = build_group(state_ids, rewards, turn_mask, success, gamma)
  lengths = jnp.sum(turn_mask, axis=-1)
  weight = lengths if per_step else jnp.ones_like(lengths)
  episode = _weighted_norm(episode_returns(rewards, turn_mask), weight, scale, eps)
  node = jnp.where(turn_mask, graph.node[:, :-1], -1)
  count = _gather(graph.visits, node, 0)
  dev = graph.returns - _gather(graph.mean_return, node)
  if scale:
    bessel = _gather(graph.std_return, node) * jnp.sqrt(count / jnp.maximum(count - 1, 1))
    dev = dev / (bessel + eps)
  varies = _gather(graph.max_return, node) > _gather(graph.min_return, node)
  step = jnp.where(turn_mask & (count > 1) & varies, dev, 0.0)
  return jnp.where(turn_mask, episode[:, None] + omega * step, 0.0)


# --------------------------------------------------------------------------- GAGPO


@_validated
def gagpo(turns: Turns, gamma: float = 1.0, lam: float = 1.0, normalize: str = "group",
          eps: float = _EPS):
  """GAGPO (Zhu et al. 2026): GAE(γ, λ) over a non-parametric grouped value proxy.

  V̂(s) = mean discounted return of the group's visits to s (every trajectory,
  every turn); δ_k = r_k + γ·V̂(s_{k+1}) − V̂(s_k) with V̂ = 0 after a
  trajectory's last turn; A_k = Σ_j (γλ)^j δ_{k+j} (Schulman et al. 2016,
  eq. 16). Group normalisation (our reading of "group-wise advantage
  normalization"): `normalize='group'` standardises over all taken turns of
  the group, (A − μ)/(σ + ε), σ Bessel-corrected; A that differ by no more
  than float rounding (1e-5 of the largest |return|) give exactly 0;
  `'group_mean'` only subtracts μ; `'none'` returns the GAE advantages.
  A state visited once has V̂ = its own return, so with no shared states every
  δ is 0 (A = 0); a shared start state alone gives A_0 = G_0 − mean G_0.
  Returns float32 [..., G, K], 0 on untaken turns.
  """
  if normalize not in ("group", "group_mean", "none"):
    raise ValueError(f"gagpo normalize must be 'group', 'group_mean' or 'none'; got "
                     f"{normalize!r}.")
  _check_unit("gamma", gamma)
  _check_unit("lam", lam)
  return _lift(_gagpo_group, turns, (gamma, lam, eps), normalize=normalize)


def _gagpo_group(state_ids, rewards, turn_mask, success, gamma, lam, eps, normalize):
  graph = build_group(state_ids, rewards, turn_mask, success, gamma)
  value = _gather(graph.mean_return, jnp.where(turn_mask, graph.node[:, :-1], -1))
  more = jnp.concatenate([turn_mask[:, 1:], jnp.zeros_like(turn_mask[:, :1])], axis=-1)
  next_value = _gather(graph.mean_return, jnp.where(more, graph.node[:, 1:], -1))
  delta = jnp.where(turn_mask, rewards + gamma * next_value - value, 0.0)
  adv = reverse_linear_scan(delta, gamma * lam * turn_mask.astype(jnp.float32))
  adv = jnp.where(turn_mask, adv, 0.0)
  if normalize == "none":
    return adv
  tol = 1e-5 * jnp.max(jnp.abs(graph.returns))  # float rounding of sums of returns
  flat = _weighted_norm(adv.reshape(-1), turn_mask.reshape(-1), normalize == "group", eps, tol)
  return flat.reshape(adv.shape)


# --------------------------------------------------------------------------- SALT


def _edge_ids(graph, turn_mask):
  """Ids of distinct (state, next state) edges [G, K] (-1 untaken), first-visit flags, count."""
  g, k = turn_mask.shape
  src = graph.node[:, :-1].reshape(-1)
  dst = graph.node[:, 1:].reshape(-1)
  ids, first, count = unique_ids((src, dst), turn_mask.reshape(-1))
  return ids.reshape(g, k), first.reshape(g, k), count


def _first_in_row(ids, valid):
  """bool [G, K]: (g, k) is the first turn of trajectory g with this id."""
  k = ids.shape[-1]
  earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # earlier[k, j]: j < k
  dup = jnp.any((ids[:, :, None] == ids[:, None, :]) & earlier & valid[:, None, :], axis=-1)
  return valid & ~dup


@_validated
def salt(turns: Turns, scale_by_std: bool = True, eps: float = _EPS):
  """SALT (Li et al. 2025): a step's advantage is the mean of the trajectory
  advantages of every trajectory through it.

  Steps are edges (state, next state) of the group's step graph (for
  deterministic environments the same as (state, action) up to actions with
  equal effect); each trajectory through an edge counts once, however often it
  takes it. Trajectory advantages are GRPO (Bessel σ, `scale_by_std=False`:
  Dr. GRPO) of the episode returns (sums of turn rewards). Steps no other
  trajectory shares keep their trajectory's GRPO advantage; shared neutral
  steps average towards 0. Returns float32 [..., G, K], 0 on untaken turns.
  """
  return _lift(_salt_group, turns, (eps,), scale_by_std=bool(scale_by_std))


def _salt_group(state_ids, rewards, turn_mask, success, eps, scale_by_std):
  g, k = turn_mask.shape
  graph = build_group(state_ids, rewards, turn_mask, success)
  traj = _grpo(episode_returns(rewards, turn_mask), scale_by_std, eps)
  edge, _, _ = _edge_ids(graph, turn_mask)
  once = _first_in_row(edge, turn_mask)
  seg = jnp.where(once, edge, g * k).reshape(-1)
  total = jax.ops.segment_sum(jnp.broadcast_to(traj[:, None], (g, k)).reshape(-1), seg,
                              num_segments=g * k + 1)
  count = jax.ops.segment_sum(jnp.ones(g * k), seg, num_segments=g * k + 1)
  mean = total / jnp.maximum(count, 1.0)
  return jnp.where(turn_mask, _gather(mean, edge), 0.0)


# --------------------------------------------------------------------------- GraphGPO


@_validated
def graphgpo(turns: Turns, omega: float = 0.9, success_reward: float = 1.0,
             beta_episode: float = 1.0, beta_graph: float = 1.0, edges: str = "distinct",
             scale_by_std: bool = True, eps: float = _EPS):
  """GraphGPO: A = β_E·A^E + β_G·A^G on the group's state-transition graph.

  d(s) = fewest turns from s to a success node (the end state of a successful
  trajectory: `turns.success`, or episode return > 0 when it is None);
  unreachable states get max finite d + 1 (1 if no state reaches success).
  Edge return g(s -> s') = R_succ·ω^{d(s')}; A^G standardises g over the edges
  leaving the same state s, (g − μ_s)/(σ_s + ε), σ the population std:
  `edges='distinct'` (default, the graph's view) over the distinct edges out
  of s, `'visits'` over every taken turn out of s. A state with one outgoing
  edge, or equal g, gives 0. A^E is GRPO over episode returns (`scale_by_std`).
  ω, β and R_succ defaults are ours. Returns float32 [..., G, K].
  """
  if edges not in ("distinct", "visits"):
    raise ValueError(f"graphgpo edges must be 'distinct' or 'visits'; got {edges!r}.")
  _check_unit("omega", omega, closed_low=False)
  return _lift(_graphgpo_group, turns, (omega, success_reward, beta_episode, beta_graph, eps),
               edges=edges, scale_by_std=bool(scale_by_std))


def _graphgpo_group(state_ids, rewards, turn_mask, success, omega, success_reward,
                    beta_episode, beta_graph, eps, edges, scale_by_std):
  g, k = turn_mask.shape
  graph = build_group(state_ids, rewards, turn_mask, success)
  n = graph.max_nodes
  d = graph.distance_to_success
  reach = jnp.isfinite(d) & (jnp.arange(n) < graph.num_nodes)
  d = jnp.where(reach, d, jnp.max(jnp.where(reach, d, 0.0)) + 1.0)
  value = success_reward * omega ** _gather(d, jnp.where(turn_mask, graph.node[:, 1:], -1))
  src = jnp.where(turn_mask, graph.node[:, :-1], -1)
  edge, first, _ = _edge_ids(graph, turn_mask)
  members = first if edges == "distinct" else turn_mask
  adv = _bucket_norm(value.reshape(-1), src.reshape(-1), members.reshape(-1), n,
                     scale_by_std=True, eps=eps, ddof=0).reshape(g, k)
  if edges == "distinct":  # every visit of an edge takes its first visit's value
    adv = _spread(adv, edge, first)
  step = jnp.where(turn_mask, adv, 0.0)
  episode = _grpo(episode_returns(rewards, turn_mask), scale_by_std, eps)
  return jnp.where(turn_mask, beta_episode * episode[:, None] + beta_graph * step, 0.0)


def _spread(values, ids, first):
  """values at the first occurrence of each id, copied to all its occurrences [G, K]."""
  m = values.size
  seg = jnp.where(first, ids, m).reshape(-1)
  per_id = jax.ops.segment_sum(jnp.where(first, values, 0.0).reshape(-1), seg,
                               num_segments=m + 1)
  return _gather(per_id, ids)


# --------------------------------------------------------------------------- GTPO


@_validated
def gtpo(turns: Turns, gamma: float = 1.0, normalize: str = "group_turn",
         scale_by_std: bool = True, eps: float = _EPS):
  """GTPO-style turn-level credit: normalised discounted turn returns.

  G_{i,k} = Σ_{j≥k} γ^{j−k} r_{i,j}; A = (G − μ)/(σ + ε), σ Bessel-corrected,
  over `normalize='group_turn'` (the group's trajectories that took turn k,
  MT-GRPO-style), `'group'` (all taken turns of the group) or `'batch'` (all
  taken turns of the whole input, every leading dim; vmapping the function
  normalises per mapped slice). A bucket of one, or of equal returns, gives 0.
  Bias: when the policy decides when to stop, the trajectories that reach turn
  k are a policy-dependent subset, so 'group_turn' compares late turns only
  among long episodes and its baseline depends on the action at each turn
  (e.g. ending early changes who is compared at k + 1): the expected advantage
  is not 0 and the gradient is biased; 'group' (or per-state baselines) avoid
  conditioning on the turn index. Returns float32 [..., G, K].
  """
  if normalize not in ("group_turn", "group", "batch"):
    raise ValueError(f"gtpo normalize must be 'group_turn', 'group' or 'batch'; got "
                     f"{normalize!r}.")
  _check_unit("gamma", gamma)
  check_turn_shapes(turns)
  return _gtpo(jnp.asarray(turns.rewards, jnp.float32), jnp.asarray(turns.turn_mask, bool),
               jnp.asarray(gamma, jnp.float32), jnp.asarray(eps, jnp.float32), normalize,
               bool(scale_by_std))


@functools.partial(jax.jit, static_argnums=(4, 5))
def _gtpo(rewards, mask, gamma, eps, normalize, scale_by_std):
  returns = discounted_returns(rewards, mask, gamma)
  groups, group = _group_index(mask.shape)
  k = mask.shape[-1]
  turn = jnp.broadcast_to(jnp.arange(k), mask.shape)
  bucket = {"group_turn": group * k + turn, "group": group,
            "batch": jnp.zeros(mask.shape, jnp.int32)}[normalize]
  adv = _bucket_norm(returns.reshape(-1), bucket.reshape(-1), mask.reshape(-1), groups * k,
                     scale_by_std, eps)
  return adv.reshape(mask.shape)


# --------------------------------------------------------------------------- tokens


gigpo_tokens = _token_level(gigpo)
gagpo_tokens = _token_level(gagpo)
salt_tokens = _token_level(salt)
graphgpo_tokens = _token_level(graphgpo)
gtpo_tokens = _token_level(gtpo)
cast_tokens = _token_level(cast)
igpo_tokens = _token_level(igpo)

AGENT_ESTIMATORS = {"gigpo": gigpo, "gagpo": gagpo, "salt": salt, "graphgpo": graphgpo,
                    "gtpo": gtpo, "cast": cast, "igpo": igpo}
AGENT_TOKEN_ESTIMATORS = {"gigpo": gigpo_tokens, "gagpo": gagpo_tokens, "salt": salt_tokens,
                          "graphgpo": graphgpo_tokens, "gtpo": gtpo_tokens,
                          "cast": cast_tokens, "igpo": igpo_tokens}
# The optional `Turns` fields an estimator reads besides state ids, rewards and the turn mask.
TURN_NEEDS = {"cast": ("solver_steps", "values_star"), "igpo": ("answer_logprobs",)}


for _name, _fn in AGENT_TOKEN_ESTIMATORS.items():
  register(_name, needs=("turns",) + TURN_NEEDS.get(_name, ()))(_from_rollouts(_name, _fn))
