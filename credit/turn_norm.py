"""Turn-level normalisation for multi-turn agents (issue 23's turn family): MT-GRPO (#17),
MAPO for dialogue (#6), MemoPilot (#42) and MR-Search's attempt-level credit (#31).

Each maps `Turns` [..., G, K] to turn advantages [..., G, K] from the environment's turn
rewards (`turns.rewards`; the seeds' judges or tool checks are the environment here) and is
registered, like `credit.agents`' estimators, as a token-level estimator reading
`rollouts.turns` (`needs=('turns',)`; `mr_search` also `'attempts'`).
`TURN_NORM_ESTIMATORS` holds the turn-level functions (`experiments/agent_credit_quality.py`
scores them).
"""

import jax
import jax.numpy as jnp

from credit.agents import gtpo
from credit.groups import loo_centred
from credit.registry import register
from credit.returns import reverse_linear_scan
from credit.turn_base import (_EPS, _bucket_norm, _check_unit, _from_rollouts, _group_index,
                              _grpo, _token_level, _validated)
from credit.turns import Turns, check_turn_shapes, episode_returns
from trees.step_graph import map_groups


@_validated
def mt_grpo(turns: Turns, lam: float = 1.0, scale_by_std: bool = True, eps: float = _EPS):
  """MT-GRPO (#17; Zeng et al. 2025's turn-level advantage): A_{i,k} = Â^T_{i,k} + λ·Â^O_i,
  where Â^T is turn k's own reward r_{i,k} normalised over the group's trajectories that took
  turn k ((r − μ_k)/(σ_k + ε), Bessel σ; a bucket of one or of equal rewards: 0) and Â^O
  GRPO of the episode return. Reading: the paper's two-turn form (A_1 = Â^T + λÂ^O,
  A_2 = Â^O: its last turn has no turn reward of its own) generalised to K turns, every turn
  getting its own reward's Â^T (the last turn's reward is the outcome's, so with
  outcome-only rewards Â^T is non-zero at the final turn only). `lam` = 0 keeps the turn
  term alone. Returns float32 [..., G, K], 0 off taken turns.
  """
  mask = jnp.asarray(turns.turn_mask, bool)
  rewards = jnp.where(mask, jnp.asarray(turns.rewards, jnp.float32), 0.0)
  groups, group = _group_index(mask.shape)
  k = mask.shape[-1]
  bucket = group * k + jnp.broadcast_to(jnp.arange(k), mask.shape)
  a_turn = _bucket_norm(rewards.reshape(-1), bucket.reshape(-1), mask.reshape(-1), groups * k,
                        bool(scale_by_std), eps).reshape(mask.shape)
  returns = episode_returns(rewards, mask)
  a_out = map_groups(lambda r: _grpo(r, bool(scale_by_std), eps), returns.shape[:-1], returns)
  return jnp.where(mask, a_turn + lam * a_out[..., None], 0.0)


@_validated
def mapo_turns(turns: Turns, alpha: float = 0.5, gamma: float = 1.0, scale_by_std: bool = True,
               eps: float = _EPS):
  """MAPO for dialogue (#6): Monte Carlo turn returns G_{i,k} = Σ_{j≥k} γ^{j−k} r_{i,j} with
  mixed normalisation, A = α·(G normalised over the group's trajectories at turn k) +
  (1 − α)·(G normalised over every taken turn of the input batch): the turn-level term
  compares like with like, the batch-level one keeps scale across groups. Registered as
  `mapo_turns` (`mapo` is #47, the confidence family's). Reading: the judge's per-turn rewards
  are the environment's. α = 1 is `gtpo(normalize='group_turn')`, α = 0 `'batch'`.
  Returns float32 [..., G, K].
  """
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"mapo_turns alpha must be in [0, 1]; got {alpha}.")
  by_turn = gtpo.__wrapped__(turns, gamma=gamma, normalize="group_turn",
                             scale_by_std=scale_by_std, eps=eps)
  by_batch = gtpo.__wrapped__(turns, gamma=gamma, normalize="batch", scale_by_std=scale_by_std,
                              eps=eps)
  return alpha * by_turn + (1.0 - alpha) * by_batch


@_validated
def memopilot(turns: Turns, gamma: float = 1.0, scale_by_std: bool = True, eps: float = _EPS):
  """MemoPilot (#42), our reading of a vague abstract ("turn-wise rewards and a
  context-independent turn-level advantage across rollouts"): each turn's return
  G_{i,k} normalised over all the group's taken turns, whatever their context or turn index
  (`gtpo(normalize='group')`). Returns float32 [..., G, K]."""
  return gtpo.__wrapped__(turns, gamma=gamma, normalize="group", scale_by_std=scale_by_std,
                          eps=eps)


TURN_NORM_ESTIMATORS = {"mt_grpo": mt_grpo, "mapo_turns": mapo_turns, "memopilot": memopilot}
for _name, _fn in TURN_NORM_ESTIMATORS.items():
  register(_name, needs=("turns",))(_from_rollouts(_name, _token_level(_fn)))


@_validated
def mr_search(turns: Turns, alpha: float = 1.0, beta: float = 1.0, discount: float = 1.0):
  """MR-Search (#31; its public code's `grpo_prm_step`): a meta-episode of attempts at one task
  (`envs.household_retry`: after a failed attempt the task restarts with the failure in
  context), credited per attempt. Attempt s of trajectory i is its turns with
  `turns.attempts` = s, and its reward r_{i,s} the sum of their rewards. ORM_i = R_i − mean_{j≠i} R_j (leave-one-out over
  the group, R the episode return); A^step_{i,s} = r_{i,s} − the mean of r_{·,s} over the
  group's other trajectories that made attempt s (0 if none did); A^cum_{i,s} =
  Σ_{s'≥s} discount^(s'−s)·A^step_{i,s'} over i's attempts. A_k = α·ORM_i + β·A^cum_{i,s(k)}.
  As the code: leave-one-out means without std division, α = β = discount = 1. Reading: the
  generated self-reflection is the environment's "retry" token. Reductions (tested): one
  attempt each, β = 0, is leave-one-out GRPO of the returns; against a plain-Python loop.
  Returns float32 [..., G, K], 0 on untaken turns.
  """
  _check_unit("discount", discount)
  check_turn_shapes(turns)
  if turns.attempts is None:
    raise ValueError("mr_search needs turns.attempts (the attempt of each turn in a meta-episode "
                     "of retries; the loop fills them on household_retry).")
  mask = jnp.asarray(turns.turn_mask, bool)
  rewards = jnp.where(mask, jnp.asarray(turns.rewards, jnp.float32), 0.0)
  return _mr_search(jnp.asarray(turns.attempts, jnp.int32), rewards, mask,
                    jnp.float32(alpha), jnp.float32(beta), jnp.float32(discount))


@jax.jit
def _mr_search(attempts, rewards, mask, alpha, beta, discount):
  def one(attempts, rewards, mask):  # one group: [G, K] x 3
    k = mask.shape[-1]
    attempt = jnp.clip(attempts, 0, k - 1)  # at most K attempts of one turn each
    onehot = (attempt[..., None] == jnp.arange(k)) & mask[..., None]  # [G, K turns, K attempts]
    r = jnp.sum(jnp.where(onehot, rewards[..., None], 0.0), 1)  # [G, S]
    present = jnp.any(onehot, 1)
    step = jnp.where(present, loo_centred(r.T, present.T).T, 0.0)  # over the group, per attempt
    cum = reverse_linear_scan(step, discount * present.astype(jnp.float32))
    orm = loo_centred(jnp.sum(rewards, -1))
    a = alpha * orm[:, None] + beta * jnp.take_along_axis(cum, attempt, -1)
    return jnp.where(mask, a, 0.0)

  return map_groups(one, mask.shape[:-2], attempts, rewards, mask)


register("mr_search", needs=("turns", "attempts"))(
    _from_rollouts("mr_search", _token_level(mr_search)))
