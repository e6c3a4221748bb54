"""Expert-trace and counterfactual turn credit for agents (issue 23): MatchTIR (#27) and
InfoPO (#41); InT (#131), the reference's step in place of the first error, before RL, and
DistIL (#169), the same correction as an imitation step after every update.

`matchtir(turns, ...) -> advantages [..., G, K]` reads `Turns.expert_matches` (the loop fills
them when an estimator needs them: each turn's action matched one-to-one against the
environment expert's trajectory from the same start, `agent_sampling.expert_matches`) and
is registered, like `credit.agents`' estimators, as a token-level estimator reading
`rollouts.turns` (`needs=('turns', 'expert_matches')`). `infopo` reads `Turns.info_gains`
(the loop's masked-feedback probes, `agent_sampling.info_gains`).
"""

import jax.numpy as jnp

from credit.outcome import grpo_per_response
from credit.registry import register
from credit.rollouts import Rollouts
from credit.turn_base import (_EPS, _bucket_norm, _check_unit, _from_rollouts, _group_index, _grpo,
                              _token_level, _validated)
from credit.turns import Turns, discounted_returns, episode_returns
from trees.step_graph import map_groups


@_validated
def matchtir(turns: Turns, omega: float = 1.0, gamma: float = 1.0, scale_by_std: bool = True,
             expert_matches=None, eps: float = _EPS):
  """MatchTIR (#27): turn rewards from a bipartite matching of the trajectory's actions
  against the reference (expert) trace, r_{i,k} = 1 if turn k's action is matched, and a
  dual-level advantage: A_{i,k} = A^traj_i + ω·A^turn_{i,k}, with A^traj the GRPO advantage
  of the episode return (the outcome) and A^turn the discounted match return
  G_{i,k} = Σ_{j≥k} γ^{j−k} r_{i,j} normalised over all the group's taken turns ((G − μ) /
  (σ + ε); a group of one or of equal values: 0). Readings: the reference trace is the
  environment's privileged expert from the same start state (the paper matches predicted
  and ground-truth tool calls of a dataset); a match is an equal whole action. `omega=0` is
  GRPO on every turn. Returns float32 [..., G, K], 0 off taken turns.
  """
  _check_unit("gamma", gamma)
  m = turns.expert_matches if expert_matches is None else expert_matches
  if m is None:
    raise ValueError("matchtir needs turns.expert_matches (the loop fills them from the "
                     "environment's expert: household).")
  mask, a_traj, a_turn, _ = _outcome_and_turn_terms(turns, m, gamma, scale_by_std, eps)
  return jnp.where(mask, a_traj[..., None] + omega * a_turn, 0.0)


def _outcome_and_turn_terms(turns, signal, gamma, scale_by_std, eps):
  """(turn mask, GRPO of the episode return [..., G], the discounted return of the per-turn
  `signal` normalised over each group's taken turns [..., G, K], the returns [..., G])."""
  mask = jnp.asarray(turns.turn_mask, bool)
  r = jnp.where(mask, jnp.asarray(signal, jnp.float32), 0.0)
  g = discounted_returns(r, mask, jnp.float32(gamma))
  groups, group = _group_index(mask.shape)
  a_turn = _bucket_norm(g.reshape(-1), group.reshape(-1), mask.reshape(-1), groups,
                        bool(scale_by_std), eps).reshape(mask.shape)
  a_out, returns = episode_grpo(turns, mask, scale_by_std, eps)
  return mask, a_out, a_turn, returns


def episode_grpo(turns: Turns, mask, scale_by_std, eps):
  """(GRPO of the episode returns [..., G], the returns [..., G]) over the taken turns `mask`."""
  returns = episode_returns(jnp.where(mask, jnp.asarray(turns.rewards, jnp.float32), 0.0), mask)
  a_out = map_groups(lambda x: _grpo(x, bool(scale_by_std), eps), returns.shape[:-1], returns)
  return a_out, returns


EXPERT_TRACE_ESTIMATORS = {"matchtir": matchtir}
register("matchtir", needs=("turns", "expert_matches"))(
    _from_rollouts("matchtir", _token_level(matchtir)))


@_validated
def infopo(turns: Turns, beta: float = 0.5, gamma: float = 1.0, scale_by_std: bool = True,
           info_gains=None, eps: float = _EPS):
  """InfoPO (#41): an information-gain turn reward, how much turn k's feedback changed the
  agent's next action against a masked-feedback counterfactual,
  r^info_{i,k} = mean over action k+1's tokens of log π(a | h) − log π(a | h, o_k masked)
  (`turns.info_gains`: the sampled next action's log-ratio, a one-sample estimate of the KL
  between the two next-action distributions), fused with the outcome:
  A_{i,k} = A^out_i + w_g·Â^info_{i,k}, A^out the GRPO advantage of the return, Â^info the
  discounted info-gain return normalised over the group's taken turns. Variance gate (our
  reading of "adaptive variance-gated fusion"): w_g = 1 in a group whose outcomes are all
  equal (the outcome term is 0 there), `beta` otherwise. `beta=0` with varied outcomes is
  GRPO. Returns float32 [..., G, K], 0 off taken turns.
  """
  _check_unit("gamma", gamma)
  gains = turns.info_gains if info_gains is None else info_gains
  if gains is None:
    raise ValueError("infopo needs turns.info_gains (the loop's masked-feedback probes).")
  mask, a_out, a_info, returns = _outcome_and_turn_terms(turns, gains, gamma, scale_by_std,
                                                         eps)
  flat = (jnp.max(returns, -1) == jnp.min(returns, -1))[..., None, None]
  return jnp.where(mask, a_out[..., None] + jnp.where(flat, 1.0, beta) * a_info, 0.0)


EXPERT_TRACE_ESTIMATORS["infopo"] = infopo
register("infopo", needs=("turns", "info_gains"))(_from_rollouts("infopo", _token_level(infopo)))


@register("intervention", needs=("interventions",))
def intervention(rollouts: Rollouts, *, scale_by_std: bool = True, eps: float = _EPS,
                 intervention_steps: int = 10, intervention_lr: float = 3e-4):
  """InT (#131): find each failed response's first error against the reference, replace
  that single step with the reference's, and fine-tune on the prefix + intervention before
  RL. The loop runs that phase when a run starts (experiments/training/interventions.py:
  `intervention_steps` SFT steps at `intervention_lr` on the policy's own failures, the
  loss on the intervention tokens only; scratch_add's step verifier locates the error and
  its demonstration supplies the step); RL's credit is then GRPO's, which this returns.
  Readings: the reference is the task's demonstration (the paper's is a reference
  solution the model compares against); the phase samples with the run's sampler, and its
  tokens count in the run's generated tokens. Returns float32 [..., G, L].
  """
  del intervention_steps, intervention_lr  # the loop's phase reads them
  return _grpo_tokens(rollouts, scale_by_std, eps)


def _grpo_tokens(rollouts: Rollouts, scale_by_std: bool, eps: float):
  """GRPO's A_i on every token of response i (float32 [..., G, L], 0 off the mask)."""
  adv = grpo_per_response(rollouts.rewards, scale_by_std=scale_by_std, eps=eps)
  return jnp.where(rollouts.mask, adv[..., None], 0.0).astype(jnp.float32)


@register("distil", needs=("expert_sft",))
def distil(rollouts: Rollouts, *, scale_by_std: bool = True, eps: float = _EPS,
           expert_lr: float = 3e-4):
  """DistIL (#169): distributional DAgger, a forward cross-entropy to the expert's
  distribution on the states the current policy visits. Reading for a verifier with a
  deterministic expert (scratch_add): the states are the learner's responses at their first
  wrong step (its valid prefix), the expert's distribution there is the reference's next
  step (`task.interventions`, InT's rows), and the objective −log π(expert step | learner
  prefix) is taken with one SFT step (its own Adam at `expert_lr`) after each RL update,
  on that step's samples (the loop, `needs` 'expert_sft'); the RL credit is GRPO's, which
  this returns. Later states of a failed response have no expert action (the task is lost)
  and get none. Returns float32 [..., G, L].
  """
  del expert_lr  # the loop's imitation step reads it
  return _grpo_tokens(rollouts, scale_by_std, eps)
