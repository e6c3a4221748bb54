"""Milestone, hierarchical and subproblem credit (issue 23's first family).

`beacon(turns, ...) -> advantages [..., G, K]` reads `Turns.milestones` (the sub-goals each
turn achieves for the first time; the loop fills them from the environment, household's
`milestones`), and is registered, like `credit.agents`' estimators, as a token-level
estimator reading `rollouts.turns` (`needs=('turns', 'milestones')`). `scrl` normalises the
verifiable reward of each subproblem (reasoning step) across the group and credits the
step's own tokens with it; `hiper` is hierarchical GAE over milestone segments with the
critic's turn values (`needs=('turns', 'values', 'milestones')`); `rebel` compares turns of
the same milestone phase, with the policy's own prediction of its feedback as a dense reward
(`needs=('turns', 'milestones', 'feedback_logprobs')`); `blockwise` baselines each block's
reward within the responses whose earlier blocks went the same way
(`needs=('token_rewards', 'step_ends')` for both, e.g. scratch_add).
"""

import functools

import jax
import jax.numpy as jnp

from credit.groups import masked_whiten
from credit.registry import register
from credit.returns import reverse_linear_scan
from credit.rollouts import Rollouts
from credit.turn_base import (_EPS, _bucket_norm, _check_unit, _grpo, _token_level, _validated,
                              _from_rollouts)
from credit.turns import Turns, check_turn_shapes, episode_returns, turn_to_tokens
from credit.values import turn_values
from trees.step_graph import map_groups


@_validated
def beacon(turns: Turns, gamma: float = 0.9, omega: float = 1.0, scale_by_std: bool = True,
           milestones=None, eps: float = _EPS):
  """BEACON (#28; the seed abstract and its public code's description): milestone-anchored
  dual-scale advantages.

  A turn that achieves a milestone for the first time (`milestones` > 0, default
  `turns.milestones`) is a key turn; it closes a segment that starts after the previous
  key turn. Within a segment closed by key turn κ, turn t gets the shaped reward
  r_t = γ^(κ − t) (partial progress: 1 on the key turn, less the further before it); turns
  after a trajectory's last key turn (no milestone reached) get 0. Segment credit: A^seg_t =
  r_t − the mean of r over the turns of the same segment index j (the j-th segment of each
  trajectory) across the group ("group by (prompt, segment), subtract the mean"); a segment
  index only one turn of the group has gives 0. Episode credit A^E: GRPO over the group's
  returns (`scale_by_std`). A_t = A^E + ω·A^seg_t on taken turns.
  Readings (the abstract is silent): γ 0.9, ω 1, the mean over turns (not over segments),
  no std division of A^seg. Outcome counterpart (tested): with no milestone anywhere, GRPO
  on every turn. Returns float32 [..., G, K], 0 on untaken turns.
  """
  _check_unit("gamma", gamma)
  if not omega >= 0:
    raise ValueError(f"beacon omega must be >= 0; got {omega}.")
  check_turn_shapes(turns)
  milestones = turns.milestones if milestones is None else milestones
  if milestones is None:
    raise ValueError("beacon needs milestones [..., G, K] (the sub-goals each turn achieves "
                     "first), as an argument or in turns.milestones.")
  milestones = jnp.asarray(milestones)
  if milestones.shape != jnp.shape(turns.turn_mask):
    raise ValueError(f"milestones must have turn_mask's shape {jnp.shape(turns.turn_mask)}; "
                     f"got {milestones.shape}.")
  mask = jnp.asarray(turns.turn_mask, bool)
  returns = episode_returns(turns.rewards, mask)
  return _beacon(milestones > 0, mask, returns, jnp.float32(gamma), jnp.float32(omega),
                 jnp.float32(eps), bool(scale_by_std))


@functools.partial(jax.jit, static_argnums=(6,))
def _beacon(key, mask, returns, gamma, omega, eps, scale_by_std):
  def one(key, mask, returns):  # one group: [G, K], [G, K], [G]
    g, k = mask.shape
    key = key & mask
    idx = jnp.arange(k)
    # The closing key turn of each turn (k if none), and its segment index.
    close = jax.lax.cummin(jnp.where(key, idx, k), axis=1, reverse=True)
    seg = jnp.cumsum(key, axis=1) - key
    shaped = jnp.where(close < k, gamma ** (close - idx).astype(jnp.float32), 0.0)
    flat = lambda x: x.reshape(-1)
    valid = flat(mask)
    bucket = jnp.where(valid, flat(seg), k)
    count = jax.ops.segment_sum(valid.astype(jnp.float32), bucket, num_segments=k + 1)
    total = jax.ops.segment_sum(jnp.where(valid, flat(shaped), 0.0), bucket,
                                num_segments=k + 1)
    mean = total / jnp.maximum(count, 1.0)
    a_seg = jnp.where(valid & (count[bucket] > 1), flat(shaped) - mean[bucket], 0.0)
    a_ep = _grpo(returns, scale_by_std, eps)
    return jnp.where(mask, a_ep[:, None] + omega * a_seg.reshape(g, k), 0.0)

  return map_groups(one, mask.shape[:-2], key, mask, returns)


beacon_tokens = _token_level(beacon)
register("beacon", needs=("turns", "milestones"))(_from_rollouts("beacon", beacon_tokens))


@_validated
def rebel(turns: Turns, gamma: float = 0.95, lam: float = 0.5, belief_coef: float = 1.0,
          scale_by_std: bool = False, eps: float = _EPS):
  """ReBel (#25; the seed abstract and its public code's `compute_rebel_advantage`):
  belief-aware grouping and belief consistency as a dense reward.

  A_k = A^ep + λ·(c(R^env)_k + β·c(R^bel)_k) on taken turns, with A^ep GRPO of the episode
  returns R (`scale_by_std=False`: R − mean, the code's default 'mean_norm'); R^env_k =
  γ^(n−1−k)·R (the outcome discounted back from the last of the n taken turns); R^bel_k =
  Σ_{j≥k} γ^(j−k) b_j, b_j = exp(`turns.feedback_logprobs`_j) ∈ [0, 1]; c(x)_k = x_k − the
  mean of x over the group's taken turns in turn k's belief group (a group of one gives 0).
  Readings (our agents write no belief text): the belief group is the milestone phase, the
  number of sub-goals reached before turn k (Σ_{j<k} `turns.milestones`_j, capped at K; the
  code's 'gt_phase' key, the environment's phase, without the belief's flags); the belief's
  agreement with the next observation (its r_pred) is the policy's own geometric-mean
  probability of the observation that followed. λ = 0.5, γ = 0.95, β = 1 as the code.
  Reductions (tested): λ = 0 is GRPO on every turn; with b ≡ 0 and one phase, the R^env
  term alone. Returns float32 [..., G, K], 0 on untaken turns.
  """
  _check_unit("gamma", gamma)
  if not (lam >= 0 and belief_coef >= 0):
    raise ValueError(f"rebel lam and belief_coef must be >= 0; got {lam}, {belief_coef}.")
  check_turn_shapes(turns)
  if turns.milestones is None or turns.feedback_logprobs is None:
    raise ValueError("rebel needs turns.milestones (the belief phase) and "
                     "turns.feedback_logprobs (the belief's agreement with the next "
                     "observation); the loop fills both on household.")
  mask = jnp.asarray(turns.turn_mask, bool)
  returns = episode_returns(turns.rewards, mask)
  return _rebel(jnp.asarray(turns.milestones, jnp.int32), jnp.asarray(turns.feedback_logprobs,
                jnp.float32), mask, returns, jnp.float32(gamma), jnp.float32(lam),
                jnp.float32(belief_coef), jnp.float32(eps), bool(scale_by_std))


@functools.partial(jax.jit, static_argnums=(8,))
def _rebel(milestones, feedback, mask, returns, gamma, lam, beta, eps, scale_by_std):
  def one(milestones, feedback, mask, returns):  # one group: [G, K] x 3, [G]
    g, k = mask.shape
    m = mask.astype(jnp.float32)
    n = jnp.sum(mask, -1, keepdims=True)
    r_env = jnp.where(mask, gamma ** (n - 1 - jnp.arange(k)).astype(jnp.float32)
                      * returns[:, None], 0.0)
    r_bel = reverse_linear_scan(jnp.where(mask, jnp.exp(feedback), 0.0), gamma * m)
    phase = jnp.minimum(jnp.cumsum(jnp.where(mask, milestones, 0), -1) - milestones, k)
    centre = lambda x: _bucket_norm(x.reshape(-1), phase.reshape(-1), mask.reshape(-1), k + 1,
                                    False, eps, ddof=0).reshape(g, k)
    step = centre(r_env) + beta * centre(r_bel)
    return jnp.where(mask, _grpo(returns, scale_by_std, eps)[:, None] + lam * step, 0.0)

  return map_groups(one, mask.shape[:-2], milestones, feedback, mask, returns)


register("rebel", needs=("turns", "milestones", "feedback_logprobs"))(
    _from_rollouts("rebel", _token_level(rebel)))


def hierarchical_gae(rewards, values, mask, key, gamma, lam, high_lam, omega):
  """HiPER's hierarchical advantage estimation over turns [..., G, K] (`hiper`): segments end
  at key turns (`key`: a milestone reached) and at each trajectory's last taken turn."""
  m = mask.astype(jnp.float32)
  r, v = jnp.where(mask, rewards, 0.0), jnp.where(mask, values, 0.0)
  shift = lambda x, fill: jnp.concatenate([x[..., 1:], jnp.full_like(x[..., :1], fill)], -1)
  delta = (r + gamma * shift(v, 0.0) - v) * m
  end = mask & (key | ~shift(mask, False))
  low = reverse_linear_scan(delta, gamma * lam * m * ~end)  # executor: GAE within a segment
  seg_return = reverse_linear_scan(delta, gamma * m * ~end)  # R_j + γ^n V(s_next) − V(s_t)
  start = mask & jnp.concatenate([jnp.ones_like(end[..., :1]), end[..., :-1]], -1)
  high = reverse_linear_scan(jnp.where(start, seg_return, 0.0),  # planner: GAE over segments
                             gamma * m * jnp.where(end, high_lam, 1.0))
  return jnp.where(mask, low + omega * jnp.where(start, high, 0.0), 0.0)


@register("hiper", needs=("turns", "values", "milestones"))
def hiper(rollouts: Rollouts, gamma: float = 1.0, lam: float = 1.0, high_lam: float = 1.0,
          omega: float = 1.0, whiten: bool = True, eps: float = 1e-8):
  """HiPER (#21): hierarchical advantage estimation (HAE) for a plan-execute factorisation.
  Reading for a flat policy: a subgoal's execution is a segment of turns closed by a turn
  that reaches a milestone (`turns.milestones` > 0; the last segment closes at the
  trajectory's end), and the planner's decision is the segment's first turn. With V(s_k) the
  critic's turn values (as `ppo_turns`) and δ_k = r_k + γ·V(s_{k+1}) − V(s_k):
  executor A^L_k = GAE(γ, λ) of the δ within k's segment (the trace cut at its end, which
  still bootstraps from V(s_end+1)); planner, on segment j's first turn s_j, the segment-level
  GAE over aggregated returns, δ^H_j = Σ_{k∈j} γ^{k−s_j} r_k + γ^{n_j}·V(s_{j+1}) − V(s_j),
  A^H_j = δ^H_j + γ^{n_j}·λ_H·A^H_{j+1}. A_k = A^L_k + ω·A^H_j on s_j, A^L_k elsewhere;
  whitened over the batch's taken turns (`whiten`) and spread over each turn's action tokens.
  Readings (the abstract does not give HAE's equations): one critic for both levels, ω = 1,
  λ = λ_H = 1. Reductions (tested): ω = 0 without milestones is `ppo_turns`; the planner term
  against a plain-Python segment loop. Returns float32 [..., G, L], 0 off the action tokens.
  """
  _check_unit("gamma", gamma)
  _check_unit("lam", lam)
  _check_unit("high_lam", high_lam)
  milestones = rollouts.turns.milestones if rollouts.turns is not None else None
  if milestones is None:
    raise ValueError("hiper needs rollouts.turns.milestones (the sub-goals each turn reaches "
                     "first: household).")
  v, rewards, token_turn, mask = turn_values(rollouts, "hiper")
  adv = hierarchical_gae(rewards, v, mask, jnp.asarray(milestones) > 0, jnp.float32(gamma),
                         jnp.float32(lam), jnp.float32(high_lam), jnp.float32(omega))
  if whiten:
    adv = masked_whiten(adv, mask, eps)
  return jnp.where(token_turn >= 0, turn_to_tokens(adv, token_turn), 0.0)


@register("scrl", needs=("token_rewards", "step_ends"))
def scrl(rollouts: Rollouts, scale_by_std: bool = True, eps: float = _EPS):
  """SCRL (#76): subproblem-level normalisation. Response i's tokens are cut into spans at
  `rollouts.step_ends` (span j: the tokens after step end j − 1 through step end j; a
  trailing span after the last step end), span j's verifiable reward r_{i,j} is the sum of
  `rollouts.token_rewards` over it (scratch_add: 1/(D+1) at each valid step's end and at
  the EOS of a right answer), and every token of span j gets
  A_{i,j} = (r_{i,j} − mean_j)/(std_j + ε), mean and Bessel std over the group's responses
  at the same position j (a response without span j counts r = 0 there; all-equal gives
  0; a group of one: μ = 0, σ = 1). The final subproblem is the original problem (its
  reward sits on the answer's span). Reading: no outcome term beyond the last span's own;
  `scale_by_std=False` keeps r − mean. Returns float32 [..., G, L], 0 on masked tokens.
  """
  tr, span, mask = _spans(rollouts, "scrl")
  return _by_span(tr, span, mask, (_grpo_columns, bool(scale_by_std), float(eps)))


@functools.partial(jax.jit, static_argnums=(3,))
def _by_span(tr, span, mask, span_adv):
  """Each group's span rewards per [G, J] (J = L positions), `fn(per, *args)` -> [G, J]
  given back on every token of its span; 0 on masked tokens. span_adv = (fn, *args), static
  and hashed by value (one compile per estimator and options)."""
  l = tr.shape[-1]
  fn, *args = span_adv

  def one(tr, span, mask):  # one group [G, L]
    per = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=l))(tr, span)
    return jnp.where(mask, jnp.take_along_axis(fn(per, *args), span, -1), 0.0)

  return map_groups(one, mask.shape[:-2], tr, span, mask)


def _grpo_columns(x, scale_by_std, eps):
  """GRPO of each column of x [G, J] over its G rows (`_grpo`'s conventions): SCRL."""
  return jax.vmap(lambda c: _grpo(c, scale_by_std, eps), in_axes=1, out_axes=1)(x)


def _spans(rollouts: Rollouts, who: str):
  """(token rewards, span index of each token, mask) [..., G, L]: spans cut at step ends."""
  if rollouts.token_rewards is None or rollouts.step_ends is None:
    raise ValueError(f"{who} needs rollouts.token_rewards and rollouts.step_ends (a "
                     f"chain-of-thought task's per-step rewards: scratch_add, countdown_steps).")
  mask = jnp.asarray(rollouts.mask, bool)
  ends = jnp.asarray(rollouts.step_ends, bool) & mask
  tr = jnp.where(mask, jnp.asarray(rollouts.token_rewards, jnp.float32), 0.0)
  return tr, jnp.cumsum(ends, -1) - ends, mask


@register("blockwise", needs=("token_rewards", "step_ends"))
def blockwise(rollouts: Rollouts, scale_by_std: bool = False, eps: float = _EPS):
  """Blockwise advantages with an outcome-conditioned baseline (#50, OCB). Blocks are the
  spans cut at `rollouts.step_ends` (as `scrl`), block j's reward r_{i,j} the sum of
  `rollouts.token_rewards` over it, and its intermediate outcome c_{i,j} whether every
  earlier block of response i was rewarded (r > 0; True for j = 0). Block j's tokens get
  A_{i,j} = r_{i,j} − the mean of r_{·,j} over the group's responses with the same c_{·,j}
  (a stratum of one, or all equal: 0; `scale_by_std` divides by the stratum's Bessel std
  + ε): a later block is compared only with blocks that started from an equally good
  prefix, instead of nested rollouts. Readings (the abstract does not fix them): the
  prefix-derived outcome is the all-earlier-blocks-rewarded flag; each block's objective is
  its own step reward, the answer's block the outcome. Returns float32 [..., G, L].
  """
  tr, span, mask = _spans(rollouts, "blockwise")
  return _by_span(tr, span, mask, (_ocb_columns, bool(scale_by_std), float(eps)))


def _ocb_columns(per, scale_by_std, eps):
  """Blockwise's baseline on one group's block rewards per [G, J]: within each column, the
  mean (and std) over the rows with the same all-earlier-blocks-rewarded flag."""
  ok = jnp.cumprod(per > 0, axis=1)
  prefix = jnp.concatenate([jnp.ones_like(ok[:, :1]), ok[:, :-1]], axis=1) > 0  # [G, J]

  def column(r, c):  # one block position: baseline within each stratum of c
    adv = jnp.zeros_like(r)
    for value in (False, True):
      w = (c == value).astype(jnp.float32)
      n = jnp.sum(w)
      dev = r - jnp.sum(w * r) / jnp.maximum(n, 1.0)
      std = jnp.sqrt(jnp.sum(w * dev ** 2) / jnp.maximum(n - 1.0, 1.0))
      spread = jnp.max(jnp.where(w > 0, r, -jnp.inf)) - jnp.min(jnp.where(w > 0, r, jnp.inf))
      a = dev / (std + eps) if scale_by_std else dev
      # A stratum of one or of equal rewards: 0; a NaN (only under jit) stays NaN.
      a = jnp.where((n > 1) & ~(spread <= 0), a, jnp.where(jnp.isnan(spread), jnp.nan, 0.0))
      adv = jnp.where(w > 0, a, adv)
    return adv

  return jax.vmap(column, in_axes=1, out_axes=1)(per, prefix)


@register("hrpo", needs=("token_rewards", "step_ends"))
def hrpo(rollouts: Rollouts, reason_weight: float = 1.0, scale_by_std: bool = True,
         eps: float = _EPS):
  """HRPO (#2, AdaSR): phase-level relative advantages instead of one sequence advantage.
  A response has two phases: its reasoning (every token through its last step end that is
  not on its last token: scratch_add's column steps) and its final deliberation (the rest:
  the answer and its EOS; a response without a reasoning step is all final phase). Each
  phase has its own verifiable reward and its own group-relative advantage: the reasoning
  phase r¹ = Σ `token_rewards` over it (scratch_add: 1/(D+1) per valid step), the final
  phase the outcome R; A¹ = GRPO(r¹), A² = GRPO(R) over the group. Final-phase tokens get
  A²; reasoning tokens w·A¹ + (1 − w)·A², w = `reason_weight` (1: the abstract's
  decomposition; 0: GRPO exactly). Readings: the abstract's streaming and deep phases map to
  the chain of thought and the answer; its format and adaptive-thinking rewards are not
  modelled (the step verifier is the reasoning phase's reward). Returns float32 [..., G, L].
  """
  tr, _, mask = _spans(rollouts, "hrpo")
  ends = jnp.asarray(rollouts.step_ends, bool) & mask
  n = jnp.sum(mask, -1, keepdims=True)
  final = jnp.take_along_axis(ends, jnp.maximum(n - 1, 0), -1) & (n > 0)
  reasoning = mask & (jnp.cumsum(ends, -1) - ends < jnp.sum(ends, -1, keepdims=True) - final)
  r1 = jnp.sum(jnp.where(reasoning, tr, 0.0), -1)
  grpo = lambda r: map_groups(lambda x: _grpo(x, bool(scale_by_std), float(eps)),
                              r.shape[:-1], r)
  a1, a2 = grpo(r1), grpo(jnp.asarray(rollouts.rewards, jnp.float32))
  adv = jnp.where(reasoning, reason_weight * a1[..., None] + (1 - reason_weight) * a2[..., None],
                  a2[..., None])
  return jnp.where(mask, adv, 0.0).astype(jnp.float32)
