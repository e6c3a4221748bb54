"""Turn structure of multi-turn (agent) rollouts: which state each turn starts from,
its reward, and which tokens belong to it.

A group is G trajectories of up to K turns; trajectory g takes n_g turns, a run
from turn 0 (n_g = 0 is allowed). Its tokens [..., G, L] are the concatenated
turns (prompt and observation tokens interleaved); `token_turn` says which
turn every trained token belongs to. Turn-level estimators (`credit.agents`)
return advantages [..., G, K] and `turn_to_tokens` spreads them over tokens.
"""

from typing import Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

from trees.step_graph import StepGraph, build_step_graph, discounted_turn_returns


@flax.struct.dataclass
class Turns:
  """Turns of G trajectories per group, any leading dims.

  Attributes:
    state_ids: int32 [..., G, K+1], a canonical id (e.g. a hash) of the state at
      the start of turn k (its anchor observation); index n_g, and by convention
      every later index, is the state after the last turn. Only equality within
      a group matters; indices past n_g are never read.
    rewards: float32 [..., G, K] per-turn rewards (for outcome-only tasks, the
      outcome reward on the last turn and 0 elsewhere); read on taken turns only.
    turn_mask: bool [..., G, K], True on the turns that were taken (a run from 0).
    token_turn: int32 [..., G, L], the turn of every token, -1 on tokens that are
      not trained (prompt, observations); None if only turn-level credit is wanted.
    success: bool [..., G], the episode reached a success state, or None.
    values_star: float32 [..., G, K+1], a solver's optimal value V*(s) of every state in
      state_ids (CAST), or None.
    answer_logprobs: float32 [..., G, K+1], log p_θ(gold answer | history before turn k)
      from probe forward passes (index n_g: after the last turn; IGPO), or None.
    solver_steps: float32 [..., G, K+1], a solver's count of the turns still needed to
      succeed from every state in state_ids, N(s) (CAST's step-count advantage), or None.
    milestones: int32 [..., G, K], the sub-goals (milestones) turn k achieves for the
      first time in its trajectory, 0 if none (BEACON's segment boundaries), or None.
    expert_matches: bool [..., G, K], turn k's action is matched to an action of the expert's
      trace from the same start (a one-to-one matching of equal actions; MatchTIR), or None.
    info_gains: float32 [..., G, K], how much turn k's feedback changed the next action's
      log-likelihood against a masked-feedback counterfactual (InfoPO), or None.
    tool_probes: float32 [..., G, K], log p_θ(gold answer | history before turn k+1, with
      turn k's observation masked): the "without the tool" probe right after turn k, whose
      "with" is answer_logprobs[..., k+1] (TACO's DAPR), or None. Read on k < n_g − 1.
    evidence_probes: float32 [..., G, K], log p_θ(gold answer | history before the last
      taken turn, with turn k's observation masked): the final posterior without the view
      turn k retrieved, whose "with" is answer_logprobs[..., n_g − 1] (ICA), or None. Read on
      k < n_g − 1.
    feedback_logprobs: float32 [..., G, K], the policy's mean per-token log p_θ of turn k's
      observation (the feedback its action got) given the history through action k: how well
      its own prediction of the next observation agreed with what came (ReBel's belief
      consistency), or None. Read on taken turns.
    attempts: int32 [..., G, K], the attempt (0, 1, ...) turn k belongs to when an episode is a
      meta-episode of retries at one task (MR-Search; `envs.household_retry`), or None.
      Non-decreasing over taken turns.
  """

  state_ids: jax.Array
  rewards: jax.Array
  turn_mask: jax.Array
  token_turn: Optional[jax.Array] = None
  success: Optional[jax.Array] = None
  values_star: Optional[jax.Array] = None
  answer_logprobs: Optional[jax.Array] = None
  solver_steps: Optional[jax.Array] = None
  milestones: Optional[jax.Array] = None
  expert_matches: Optional[jax.Array] = None
  info_gains: Optional[jax.Array] = None
  tool_probes: Optional[jax.Array] = None
  evidence_probes: Optional[jax.Array] = None
  feedback_logprobs: Optional[jax.Array] = None
  attempts: Optional[jax.Array] = None

  @property
  def group_size(self) -> int:
    return self.turn_mask.shape[-2]

  @property
  def num_turns(self) -> int:
    """K, the static maximum number of turns."""
    return self.turn_mask.shape[-1]

  @property
  def batch_shape(self) -> tuple:
    return tuple(self.turn_mask.shape[:-2])

  @property
  def lengths(self) -> jax.Array:
    """int32 [..., G]: n_g, the number of turns taken."""
    return jnp.sum(self.turn_mask, axis=-1, dtype=jnp.int32)


def turn_to_tokens(turn_values, token_turn):
  """turn_values[..., g, token_turn[..., g, t]] at every token; 0 where token_turn = -1.

  float [..., G, K], int [..., G, L] -> float32 [..., G, L]. A token_turn outside
  [-1, K) raises ValueError when concrete; under jit (no error possible) such a
  token gets NaN, never another turn's value.
  """
  turn_values = jnp.asarray(turn_values, jnp.float32)
  k = turn_values.shape[-1]
  _check_token_turn_range(token_turn, k)
  token_turn = jnp.asarray(token_turn)
  picked = jnp.take_along_axis(turn_values, jnp.clip(token_turn, 0, k - 1), axis=-1)
  picked = jnp.where((token_turn < -1) | (token_turn >= k), jnp.nan, picked)
  return jnp.where(token_turn == -1, 0.0, picked)


def discounted_returns(rewards, turn_mask, gamma: float):
  """G_k = Σ_{j≥k} γ^{j−k} r_j over taken turns [..., G, K]; 0 on untaken turns."""
  return discounted_turn_returns(rewards, jnp.asarray(turn_mask, bool), gamma)


def episode_returns(rewards, turn_mask):
  """float32 [..., G]: the undiscounted sum of each trajectory's turn rewards."""
  return jnp.sum(jnp.where(turn_mask, jnp.asarray(rewards, jnp.float32), 0.0), axis=-1)


def step_graph(turns: Turns, gamma: float = 1.0) -> StepGraph:
  """`trees.build_step_graph` of the turns' states, rewards and success flags."""
  validate_turns(turns)
  return build_step_graph(turns.state_ids, turns.rewards, turns.turn_mask, turns.success, gamma)


def _array(x):
  return x if isinstance(x, jax.Array) else np.asarray(x)


def _concrete(*xs):
  """True when every array's values can be read on this host: not a tracer (under jit), not
  sharded over several processes (multi-host). Otherwise only shapes are checked."""
  return not any(isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True)
                 for x in xs)


def _first(bad):
  return tuple(int(i) for i in np.argwhere(bad)[0])


def _check_token_turn_range(token_turn, k: int):
  """token_turn in [-1, K) when concrete, else a ValueError naming the first bad token."""
  token_turn = _array(token_turn)
  if not _concrete(token_turn):
    return
  tt = np.asarray(token_turn)
  out = (tt < -1) | (tt >= k)
  if np.any(out):
    where = _first(out)
    raise ValueError(f"token_turn must be in [-1, K) = [-1, {k}); token_turn{list(where)} = "
                     f"{tt[where]}.")


def check_state_values(name: str, values, turn_mask, allow_neg_inf: bool = False):
  """Raises ValueError unless `values` [..., G, K+1] (one per state of state_ids) are real
  numbers and, when concrete, finite in float32 on every state a trajectory visits: indices
  0 .. n_g of trajectories with n_g >= 1 (the states the estimators read; the rest are
  padding). `allow_neg_inf`: -inf is allowed (a log-probability of 0: IGPO's probes)."""
  values = _array(values)
  if not (jnp.issubdtype(values.dtype, jnp.floating) or jnp.issubdtype(values.dtype,
                                                                       jnp.integer)):
    raise ValueError(f"{name} must be real numbers; got dtype {values.dtype}.")
  if not _concrete(values, turn_mask):
    return
  with np.errstate(over="ignore"):
    v = np.asarray(values, np.float32)
  n = np.sum(np.asarray(turn_mask, bool), axis=-1)[..., None]
  visited = (np.arange(v.shape[-1]) <= n) & (n >= 1)
  bad = np.isnan(v) | (v == np.inf) | ((v == -np.inf) & (not allow_neg_inf))
  if np.any(bad & visited):
    where = _first(bad & visited)
    allowed = " (-inf is allowed: probability 0)" if allow_neg_inf else ""
    raise ValueError(f"{name} must be finite{allowed} (in float32) on the states trajectories "
                     f"visit (indices 0 .. n_g); {name}{list(where)} = "
                     f"{np.asarray(values)[where]}.")


def check_turn_shapes(turns: Turns):
  """Static checks only (shapes and dtypes; fine under jit). Raises ValueError."""
  state_ids, rewards, turn_mask = map(_array, (turns.state_ids, turns.rewards, turns.turn_mask))
  if turn_mask.ndim < 2:
    raise ValueError(f"turn_mask must be [..., G, K]; got shape {turn_mask.shape}.")
  *batch, g, k = turn_mask.shape
  if g < 1 or k < 1:
    raise ValueError(f"turns need G >= 1 trajectories and K >= 1 turns; got turn_mask "
                     f"of shape {turn_mask.shape}.")
  if turn_mask.dtype != jnp.bool_:
    raise ValueError(f"turn_mask must be boolean; got dtype {turn_mask.dtype}.")
  if state_ids.shape != (*batch, g, k + 1):
    raise ValueError(f"state_ids must be [..., G, K+1] = {(*batch, g, k + 1)} (one more state "
                     f"than turns); got {state_ids.shape}.")
  if not jnp.issubdtype(state_ids.dtype, jnp.integer):
    raise ValueError(f"state_ids must be integers (e.g. int32 hashes); got dtype "
                     f"{state_ids.dtype}.")
  if rewards.shape != turn_mask.shape:
    raise ValueError(f"rewards must be [..., G, K] = {turn_mask.shape}; got {rewards.shape}.")
  if not (jnp.issubdtype(rewards.dtype, jnp.floating) or jnp.issubdtype(rewards.dtype,
                                                                        jnp.integer)):
    raise ValueError(f"rewards must be real numbers; got dtype {rewards.dtype}.")
  if turns.success is not None:
    success = _array(turns.success)
    if success.shape != (*batch, g):
      raise ValueError(f"success must be [..., G] = {(*batch, g)}; got {success.shape}.")
    if success.dtype != jnp.bool_:
      raise ValueError(f"success must be boolean; got dtype {success.dtype}.")
  for name in ("values_star", "answer_logprobs", "solver_steps"):
    value = getattr(turns, name)
    if value is not None and _array(value).shape != state_ids.shape:
      raise ValueError(f"{name} must have state_ids' shape [..., G, K+1] = {state_ids.shape}; "
                       f"got {_array(value).shape}.")
  if turns.expert_matches is not None:
    em = _array(turns.expert_matches)
    if em.shape != turn_mask.shape or em.dtype != jnp.bool_:
      raise ValueError(f"expert_matches must be boolean of turn_mask's shape {turn_mask.shape}; "
                       f"got {em.dtype} {em.shape}.")
  for name in ("info_gains", "tool_probes", "evidence_probes", "feedback_logprobs"):
    value = getattr(turns, name)
    if value is not None and (_array(value).shape != turn_mask.shape
                              or not jnp.issubdtype(_array(value).dtype, jnp.floating)):
      raise ValueError(f"{name} must be floats of turn_mask's shape {turn_mask.shape}; "
                       f"got {_array(value).dtype} {_array(value).shape}.")
  if turns.attempts is not None:
    attempts = _array(turns.attempts)
    if attempts.shape != turn_mask.shape or not jnp.issubdtype(attempts.dtype, jnp.integer):
      raise ValueError(f"attempts must be integers of turn_mask's shape {turn_mask.shape}; "
                       f"got {attempts.dtype} {attempts.shape}.")
  if turns.milestones is not None:
    milestones = _array(turns.milestones)
    if milestones.shape != turn_mask.shape or not jnp.issubdtype(milestones.dtype,
                                                                jnp.integer):
      raise ValueError(f"milestones must be integers of turn_mask's shape {turn_mask.shape}; "
                       f"got {milestones.dtype} {milestones.shape}.")
  if turns.token_turn is not None:
    token_turn = _array(turns.token_turn)
    if token_turn.ndim != turn_mask.ndim or token_turn.shape[:-1] != (*batch, g):
      raise ValueError(f"token_turn must be [..., G, L] with [..., G] = {(*batch, g)}; got "
                       f"{token_turn.shape}.")
    if not jnp.issubdtype(token_turn.dtype, jnp.integer):
      raise ValueError(f"token_turn must be integers; got dtype {token_turn.dtype}.")


def validate_turns(turns: Turns, rollouts=None) -> Turns:
  """Raises ValueError on malformed turns; returns them unchanged otherwise.

  Checks shapes and dtypes (`check_turn_shapes`) and, when the values are
  concrete (not under jit, not sharded over hosts): state_ids fit in int32;
  turn_mask a run from turn 0; rewards finite (float32) on taken turns;
  values_star and solver_steps finite and answer_logprobs not NaN or +inf on the states a
  trajectory visits (`check_state_values`), tool_probes and evidence_probes not NaN or +inf
  on the turns a taken turn follows, feedback_logprobs not NaN or +inf on taken turns;
  attempts >= 0 and non-decreasing on taken turns; token_turn in [-1, K) and only
  pointing at taken turns. With `rollouts` (a `credit.Rollouts`, or anything
  with a `mask` [..., G, L]), token_turn must have the tokens' shape and be -1
  on masked tokens. Every turn estimator of `credit.agents` runs it on its
  input; under jit only the static checks run (validate on the host first).
  """
  check_turn_shapes(turns)
  mask = _array(turns.turn_mask)
  rewards = _array(turns.rewards)
  state_ids = _array(turns.state_ids)
  if _concrete(state_ids) and np.asarray(state_ids).dtype.itemsize > 4:
    info = np.iinfo(np.int32)
    if np.any((np.asarray(state_ids) < info.min) | (np.asarray(state_ids) > info.max)):
      raise ValueError("state_ids must fit in int32 (they are compared as int32); hash them "
                       "to 32 bits first.")
  if _concrete(mask):
    later = np.asarray(mask)[..., 1:] & ~np.asarray(mask)[..., :-1]
    if np.any(later):
      where = _first(later)
      raise ValueError(f"turn_mask must be a run from turn 0 (taken turns first); trajectory "
                       f"{list(where[:-1])} takes turn {where[-1] + 1} but not turn {where[-1]}.")
  if _concrete(mask, rewards):
    with np.errstate(over="ignore"):
      r = np.asarray(rewards, np.float32)
    bad = np.asarray(mask) & ~np.isfinite(r)
    if np.any(bad):
      where = _first(bad)
      raise ValueError(f"rewards must be finite (in float32) on taken turns; "
                       f"rewards{list(where)} = {np.asarray(rewards)[where]}.")
  if turns.values_star is not None:
    check_state_values("values_star", turns.values_star, mask)
  if turns.answer_logprobs is not None:
    check_state_values("answer_logprobs", turns.answer_logprobs, mask, allow_neg_inf=True)
  if turns.solver_steps is not None:
    check_state_values("solver_steps", turns.solver_steps, mask)
  if turns.info_gains is not None and _concrete(turns.info_gains, mask):
    bad = np.asarray(mask, bool) & ~np.isfinite(np.asarray(turns.info_gains, np.float32))
    if np.any(bad):
      raise ValueError(f"info_gains must be finite on taken turns; info_gains"
                       f"{list(_first(bad))} is not.")
  for name in ("tool_probes", "evidence_probes"):  # read before a later taken turn
    value = getattr(turns, name)
    if value is not None and _concrete(value, mask):
      with np.errstate(over="ignore"):
        v = np.asarray(value, np.float32)
      followed = np.asarray(mask, bool) & np.concatenate(
          [np.asarray(mask, bool)[..., 1:], np.zeros_like(np.asarray(mask, bool)[..., :1])], -1)
      bad = followed & (np.isnan(v) | (v == np.inf))
      if np.any(bad):
        raise ValueError(f"{name} must be log-probabilities (finite or -inf) on turns followed "
                         f"by a taken turn; {name}{list(_first(bad))} = {v[_first(bad)]}.")
  if turns.feedback_logprobs is not None and _concrete(turns.feedback_logprobs, mask):
    with np.errstate(over="ignore"):
      v = np.asarray(turns.feedback_logprobs, np.float32)
    bad = np.asarray(mask, bool) & (np.isnan(v) | (v == np.inf))
    if np.any(bad):
      raise ValueError(f"feedback_logprobs must be log-probabilities (finite or -inf) on "
                       f"taken turns; feedback_logprobs{list(_first(bad))} = {v[_first(bad)]}.")
  if turns.attempts is not None and _concrete(turns.attempts, mask):
    a, m = np.asarray(turns.attempts), np.asarray(mask, bool)
    step = np.diff(a, axis=-1) >= 0
    if np.any(m & (a < 0)) or np.any(m[..., 1:] & ~step):
      raise ValueError("attempts must be >= 0 and non-decreasing over each trajectory's taken "
                       "turns (the attempt each turn belongs to).")
  if turns.milestones is not None and _concrete(turns.milestones, mask):
    if np.any(np.asarray(turns.milestones)[np.asarray(mask, bool)] < 0):
      raise ValueError("milestones must be >= 0 on taken turns (a count of sub-goals).")
  if turns.token_turn is None:
    if rollouts is not None:
      raise ValueError("token_turn is None: the turns cannot be matched to the rollouts' tokens.")
    return turns
  token_turn = _array(turns.token_turn)
  k = mask.shape[-1]
  if rollouts is not None and token_turn.shape != np.shape(rollouts.mask):
    raise ValueError(f"token_turn must have the tokens' shape {np.shape(rollouts.mask)}; got "
                     f"{token_turn.shape}.")
  _check_token_turn_range(token_turn, k)
  if _concrete(token_turn, mask):
    tt = np.asarray(token_turn)
    taken = np.take_along_axis(np.asarray(mask), np.clip(tt, 0, k - 1), axis=-1)
    untaken = (tt >= 0) & ~taken
    if np.any(untaken):
      where = _first(untaken)
      raise ValueError(f"token_turn{list(where)} = {tt[where]} points at a turn that was not "
                       f"taken (turn_mask is False there).")
    if rollouts is not None and _concrete(_array(rollouts.mask)):
      stray = (tt >= 0) & ~np.asarray(rollouts.mask, bool)
      if np.any(stray):
        where = _first(stray)
        raise ValueError(f"token_turn{list(where)} = {tt[where]} assigns a masked token "
                         f"(rollouts.mask is False there) to a turn; use -1.")
  return turns
