"""Tool-call and evidence credit for agents (issue 23's counterfactual family): TACO (#134, tool
credit) and ICA (#155) ask the policy for the gold answer with and without one turn's
observation (the view a tool call, search or click, returned) and credit the turn with the
difference; PiCA (#187) shapes turns by the same probes' potential, anchored at pivot states.

A trajectory's last taken turn is its answer (webshop: `buy`); every earlier taken turn is a
call whose observation a later decision reads. The probes are the loop's teacher-forced passes
(`agent_sampling.answer_logprobs` and `masked_answer_logprobs`): `Turns.answer_logprobs`
[..., G, K+1] with everything in context, `Turns.tool_probes` / `Turns.evidence_probes`
[..., G, K] with turn k's observation masked, read right after the call / at the final
decision. Probabilities are p = exp(mean per-token log p), IGPO's reading of a probe's
expected answer reward. All three are registered, like `credit.agents`' estimators, as
token-level estimators reading `rollouts.turns`.
"""

import jax
import jax.numpy as jnp

from credit.expert_traces import _outcome_and_turn_terms, episode_grpo
from credit.registry import register
from credit.turn_base import (_EPS, _bucket_norm, _check_unit, _from_rollouts, _group_index,
                              _token_level, _validated)
from credit.turns import Turns


def _calls(mask):
  """bool [..., G, K]: taken turns followed by a taken turn (the calls; the last is the answer)."""
  return mask & jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], -1)


def _field(turns: Turns, name: str, value, who: str):
  value = getattr(turns, name) if value is None else value
  if value is None:
    raise ValueError(f"{who} needs turns.{name} (the loop's answer probes with one turn's "
                     f"observation masked, on an environment with a gold answer: webshop, "
                     f"household).")
  return jnp.asarray(value, jnp.float32)


def _answer_probs(turns: Turns, who: str):
  if turns.answer_logprobs is None:
    raise ValueError(f"{who} needs turns.answer_logprobs (the loop's gold-answer probes).")
  return jnp.exp(jnp.asarray(turns.answer_logprobs, jnp.float32))  # [..., G, K+1]


@_validated
def taco_tools(turns: Turns, beta: float = 1.0, route: bool = True, scale_by_std: bool = True,
               tool_probes=None, eps: float = _EPS):
  """TACO's tool credit (#134): two coupled advantage channels.

  DAPR, the call's own value: d_{i,k} = p(gold | history through call k's view) −
  p(gold | the same history with that view masked) = exp(answer_logprobs[k+1]) −
  exp(tool_probes[k]); positive for a view that helped, negative for a misleading one, 0 for
  one that changes nothing. Already a difference (its "without" probe is its baseline), so
  it is not normalised again. OGAR, routing the outcome advantage A_i (GRPO over the group's
  returns) by the call's effect (`route`): the answer turn always gets A_i; a call gets it
  only when its d has A_i's sign (a success credits the calls that helped, a failure blames
  the ones that misled; wasted calls, d of the other sign or 0, get none of it, so no cost
  term is needed). A_{i,k} = OGAR(A_i)_k + β·d_{i,k} on calls, A_i on the answer turn.
  Readings (the abstract is vague): the probe's outcome reward is the answer's geometric-mean
  token probability (no sampled probe answers), the call's outcome is the sign of its DAPR,
  β = 1. Outcome reductions (tested): one-turn trajectories, or β = 0 with `route=False`,
  give GRPO on every turn. Returns float32 [..., G, K], 0 off taken turns.
  """
  mask = jnp.asarray(turns.turn_mask, bool)
  calls = _calls(mask)
  p = _answer_probs(turns, "taco_tools")
  without = jnp.exp(_field(turns, "tool_probes", tool_probes, "taco_tools"))
  d = jnp.where(calls, p[..., 1:] - without, 0.0)
  a = episode_grpo(turns, mask, scale_by_std, eps)[0][..., None]
  gate = ~calls | (jnp.sign(d) == jnp.sign(a)) if route else jnp.ones_like(mask)
  return jnp.where(mask, jnp.where(gate, a, 0.0) + beta * d, 0.0)


@_validated
def ica(turns: Turns, beta: float = 1.0, scale_by_std: bool = True, evidence_probes=None,
        eps: float = _EPS):
  """ICA (#155): information-aware credit, each retrieved view's posterior contribution to
  the outcome, given back to the turn that retrieved it.

  c_{i,k} = p(gold | history before the final decision) − p(gold | the same with turn k's
  view masked) = exp(answer_logprobs[n−1]) − exp(evidence_probes[k]), on the calls k < n − 1.
  The contributions of all the group's calls are z-normalised together (ĉ; mean and Bessel
  std, ε; one call, or all equal, give 0) and added to GRPO's outcome advantage:
  A_{i,k} = A_i + β·ĉ_{i,k} on calls, A_i on the answer turn. Readings (the abstract is
  vague): the posterior is the policy's own probability of the gold answer at the last
  decision, leave-one-view-out (not the paper's snapshot-level analysis), normalised like
  InfoPO's and MatchTIR's turn terms; not outcome-signed (a view that pointed at the gold
  answer helped even in a trajectory that then failed); β = 1. Outcome reductions (tested):
  one-turn trajectories or β = 0 give GRPO on every turn. Returns float32 [..., G, K],
  0 off taken turns.
  """
  mask = jnp.asarray(turns.turn_mask, bool)
  calls = _calls(mask)
  p = _answer_probs(turns, "ica")
  last = jnp.maximum(jnp.sum(mask, -1) - 1, 0)[..., None]  # [..., G, 1]
  final = jnp.take_along_axis(p, last, -1)
  without = jnp.exp(_field(turns, "evidence_probes", evidence_probes, "ica"))
  c = jnp.where(calls, final - without, 0.0)
  groups, group = _group_index(mask.shape)
  c_hat = _bucket_norm(c.reshape(-1), group.reshape(-1), calls.reshape(-1), groups,
                       bool(scale_by_std), eps).reshape(mask.shape)
  a = episode_grpo(turns, mask, scale_by_std, eps)[0][..., None]
  return jnp.where(mask, a + beta * jnp.where(calls, c_hat, 0.0), 0.0)


@_validated
def pica(turns: Turns, beta: float = 1.0, gamma: float = 1.0, scale_by_std: bool = True,
         eps: float = _EPS):
  """PiCA (#187): pivot-anchored potential-based step rewards for search agents.

  Potential Φ(h_j) = p(gold answer | history before turn j) (`turns.answer_logprobs`, IGPO's
  probes: the policy's own context, no template). Pivots, the "golden sub-queries and
  sub-answers derived from historical trajectories": states (`turns.state_ids`) that a
  successful trajectory of the same group reached (webshop: the right results page, the
  target's page, the goal size chosen). The potential moves only there: Φ̃_0 = Φ_0,
  Φ̃_{k+1} = Φ_{k+1} if call k reaches a pivot state, else Φ̃_k, and call k's shaping reward
  is r_k = Φ̃_{k+1} − Φ̃_k (PBRS with γ = 1: a trajectory's rewards telescope to the potential
  at its last pivot less Φ_0); the answer turn gets none. A_{i,k} = A_i + β·r̂_{i,k}: GRPO of the
  return plus the discounted return of r normalised over the group's taken turns (as
  InfoPO's and MatchTIR's turn terms). Readings (the abstract is vague): pivots are exact
  states reached by a success, the potential the answer's geometric-mean token probability,
  β = 1. Outcome reduction (tested): a group without a success, or β = 0, is GRPO on every
  turn. Returns float32 [..., G, K], 0 off taken turns.
  """
  _check_unit("gamma", gamma)
  if turns.success is None:
    raise ValueError("pica needs turns.success (pivots are the states successes reached).")
  mask = jnp.asarray(turns.turn_mask, bool)
  k = mask.shape[-1]
  p = _answer_probs(turns, "pica")  # [..., G, K+1]
  ids = jnp.asarray(turns.state_ids)
  j = jnp.arange(k + 1)
  reached = (j >= 1) & (j <= jnp.sum(mask, -1, keepdims=True))  # states after taken turns
  gold = reached & jnp.asarray(turns.success, bool)[..., None]
  same = ids[..., :, :, None, None] == ids[..., None, None, :, :]  # [..., G, K+1, G, K+1]
  pivot = jnp.any(same & gold[..., None, None, :, :], axis=(-2, -1))
  anchor = (j == 0) | (jnp.concatenate([jnp.zeros_like(mask[..., :1]), _calls(mask)], -1)
                       & pivot)
  last = jax.lax.cummax(jnp.where(anchor, j, 0), axis=anchor.ndim - 1)
  phi = jnp.take_along_axis(p, last, -1)
  r = jnp.where(_calls(mask), phi[..., 1:] - phi[..., :-1], 0.0)
  _, a_out, a_turn, _ = _outcome_and_turn_terms(turns, r, gamma, scale_by_std, eps)
  return jnp.where(mask, a_out[..., None] + beta * a_turn, 0.0)


TOOL_CREDIT_ESTIMATORS = {"taco_tools": taco_tools, "ica": ica, "pica": pica}
register("taco_tools", needs=("turns", "answer_logprobs", "tool_probes"))(
    _from_rollouts("taco_tools", _token_level(taco_tools)))
register("ica", needs=("turns", "answer_logprobs", "evidence_probes"))(
    _from_rollouts("ica", _token_level(ica)))
register("pica", needs=("turns", "answer_logprobs"))(_from_rollouts("pica", _token_level(pica)))
