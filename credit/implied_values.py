"""Credit from the policy's (or the reference's) own log-probabilities.

x_t = log π(y_t) − log π_ref(y_t), π the sampling policy (`old_logprobs`, else
`logprobs`), π_ref the frozen reference (`ref_logprobs`). Under KL-regularised RL
(strength β) the optimal policy satisfies β·x_t = r_t + V(s_{t+1}) − V(s_t), so
log-ratios are implied advantages and their partial sums implied values.
"""

import jax.numpy as jnp

from credit.groups import all_equal, group_stats, last_tokens
from credit.outcome import grpo
from credit.registry import register
from credit.returns import gae_advantages, reverse_linear_scan
from credit.rollouts import Rollouts


def _log_ratio(rollouts: Rollouts, caller: str):
  """float32 [..., G, L]: x_t on unmasked tokens, 0 elsewhere."""
  policy = rollouts.sampling_logprobs
  if policy is None or rollouts.ref_logprobs is None:
    raise ValueError(f"{caller} needs rollouts.logprobs (or old_logprobs) and "
                     f"rollouts.ref_logprobs.")
  return jnp.where(rollouts.mask, jnp.asarray(policy, jnp.float32)
                   - jnp.asarray(rollouts.ref_logprobs, jnp.float32), 0.0)


def _centred(rewards, scale_by_std: bool, eps: float):
  """(R − μ with GRPO's conventions, the divisor): exactly GRPO's numerator and
  denominator; all-equal groups get 0 and divisor 1 (not ε)."""
  mean, std = group_stats(rewards)
  centred, scale = rewards - mean, jnp.ones_like(std)
  if scale_by_std:
    scale = std + eps
  if rewards.shape[-1] > 1:
    equal = all_equal(rewards)
    centred = jnp.where(equal, 0.0, centred)
    scale = jnp.where(equal, 1.0, scale)
  return centred, scale


@register("vimpo", needs=("logprobs", "ref_logprobs"))
def vimpo(rollouts: Rollouts, *, beta: float = 0.05, lam: float = 1.0,
          scale_by_std: bool = True, eps: float = 1e-6):
  """VIMPO (#32): GAE(γ = 1, λ) over the policy-implied values, no critic.

  The KL-optimality condition read forward from the prompt value V₀ gives the value of
  every prefix, V(s_t) = V₀ + β·Σ_{k<t} x_k (no reward before the end), and the
  terminal condition V(s_T) = 0 closes it: δ_t = β·x_t before the last token and
  δ_{T−1} = R − V(s_{T−1}). V₀ is the group mean of the implied prompt values
  R_j − β·Σ_k x_{j,k} (each response's, anchored at its end; the value loss of the
  paper drives them to agree). With λ = 1, A_t = R_i − V₀ − β·Σ_{k<t} x_{i,k}.

  Reading: the abstract gives no formula; this is the actor advantage only (the
  paper's value loss, regressing β·Σ x on R − V₀, is a loss term; `policy_loss='apa'`
  is its per-token analogue). Scaled by 1/(σ_R + ε) when `scale_by_std` (by 1 for
  all-equal groups, which keep their KL terms). A group of one takes GRPO's V₀ = μ = 0:
  A_t = R − β·Σ_{k<t} x_k. β = 0 (or π = π_ref) with λ = 1 is `grpo` exactly (`dr_grpo`
  without `scale_by_std`). float32 [..., G, L].
  """
  if not beta >= 0:
    raise ValueError(f"vimpo needs beta >= 0; got {beta}.")
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f"vimpo needs 0 <= lam <= 1; got {lam}.")
  x = _log_ratio(rollouts, "vimpo")
  mask = rollouts.mask
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  centred, scale = _centred(rewards, scale_by_std, eps)  # R − μ
  total = jnp.sum(x, axis=-1)  # Σ_k x_{i,k}
  g = rewards.shape[-1]
  mean_total = jnp.mean(total, axis=-1, keepdims=True) if g > 1 else jnp.zeros_like(total)
  before = jnp.cumsum(x, axis=-1) - x  # Σ_{k<t} x_k
  # Values relative to μ (V − μ): V₀ − μ = −β·mean_j Σ x_j; the terminal value stays 0
  # and the last token's reward is R − μ, so every δ is unchanged.
  values = beta * (before - mean_total[..., None])
  last = last_tokens(mask)
  token_rewards = jnp.where(last, centred[..., None], 0.0)
  adv = gae_advantages(token_rewards, values, mask, 1.0, lam)
  return jnp.where(mask, adv / scale[..., None], 0.0).astype(jnp.float32)


def _step_sums(x, mask, step_ends):
  """[..., L]: each token's step total Σ_{k in its step} x_k; a step ends at a True of
  `step_ends` (inclusive), the tokens after the last step end form one more step."""
  ends = step_ends & mask
  starts = jnp.concatenate([jnp.ones_like(ends[..., :1]), ends[..., :-1]], axis=-1)
  keep_back = (~ends).astype(jnp.float32)  # z_t = x_t + z_{t+1} inside a step
  keep_fwd = (~starts).astype(jnp.float32)  # y_t = x_t + y_{t−1} inside a step
  after = reverse_linear_scan(x, keep_back)  # Σ over t..end of its step
  upto = jnp.flip(reverse_linear_scan(jnp.flip(x, -1), jnp.flip(keep_fwd, -1)), -1)
  return jnp.where(mask, after + upto - x, 0.0)


def progress(rollouts: Rollouts, *, coef: float = 1.0, granularity: str = "token",
             center: bool = True, scale_by_std: bool = True, eps: float = 1e-6):
  """Progress advantage (#52): the log-ratio x = log π/π_ref as the implied optimal
  advantage, added to GRPO: A_{i,t} = A^GRPO_i + coef·(p_{i,t} − p̄).

  p = x_t (`granularity='token'`) or the sum of x over the reasoning step holding t
  ('step', from `step_ends`: a step's score, the paper's step-level use). p̄ is the
  mean of p over the group's unmasked tokens when `center` (the log-ratio's mean
  is KL(π‖π_ref) >= 0); else 0. The paper scores trained trajectories with x (its uses
  are `credit.progress_scores`); this training bonus is the project's use, and it
  rewards the tokens the policy has already moved towards (coef is β; it collapses:
  docs/collapses.md). coef = 0 or π = π_ref is `grpo` exactly.
  """
  if granularity not in ("token", "step"):
    raise ValueError(f"progress_advantage granularity must be 'token' or 'step'; got "
                     f"{granularity!r}.")
  if not coef >= 0:
    raise ValueError(f"progress_advantage needs coef >= 0; got {coef}.")
  x = _log_ratio(rollouts, "progress_advantage")
  mask = rollouts.mask
  if granularity == "step":
    if rollouts.step_ends is None:
      raise ValueError("progress_advantage_step needs rollouts.step_ends.")
    x = _step_sums(x, mask, jnp.asarray(rollouts.step_ends, bool))
  if center:
    axes = (-2, -1)
    mean = jnp.sum(x, axis=axes, keepdims=True) / jnp.maximum(
        jnp.sum(mask, axis=axes, keepdims=True), 1)
    x = x - mean
  base = grpo(rollouts, scale_by_std=scale_by_std, eps=eps)
  return jnp.where(mask, base + coef * x, 0.0)


register("progress_advantage", needs=("logprobs", "ref_logprobs"))(progress)
register("progress_advantage_step", needs=("logprobs", "ref_logprobs", "step_ends"),
         granularity="step")(progress)


@register("endogenous", needs=("ref_logprobs",))
def endogenous(rollouts: Rollouts, *, coef: float = 0.1, verifiable_weight: float = 1.0,
               length_normalize: bool = False, scale_by_std: bool = True,
               eps: float = 1e-6):
  """Endogenous reward (#149): the reference model's logits as a soft Q-function
  (inverse soft Bellman, α = 1): r_t = Q(s_t, y_t) − V(s_{t+1}) = log π_ref(y_t) +
  V(s_t) − V(s_{t+1}), V = logsumexp of the logits. Summed over a response with
  V(s_T) = 0 the potential terms leave V(s_0), the same for the whole group, so the
  group-relative reward is E_i = Σ_t log π_ref(y_{i,t}) (mean over tokens with
  `length_normalize`: not the paper's, removes the sum's bias to short answers).

  A = GRPO on R'_i = `verifiable_weight`·R_i + coef·E_i (coef is α's scale; 0 and
  weight 1 is `grpo` exactly; weight 0 is the endogenous reward alone, as the paper).
  Needs `ref_logprobs` (the base model's). float32 [..., G, L].
  """
  if not coef >= 0 or not verifiable_weight >= 0:
    raise ValueError(f"endogenous needs coef >= 0 and verifiable_weight >= 0; got "
                     f"{coef}, {verifiable_weight}.")
  if rollouts.ref_logprobs is None:
    raise ValueError("endogenous needs rollouts.ref_logprobs (the base model's log-probs).")
  mask = rollouts.mask
  ref = jnp.where(mask, jnp.asarray(rollouts.ref_logprobs, jnp.float32), 0.0)
  score = jnp.sum(ref, axis=-1)
  if length_normalize:
    score = score / jnp.maximum(jnp.sum(mask, axis=-1), 1)
  rewards = verifiable_weight * jnp.asarray(rollouts.rewards, jnp.float32) + coef * score
  return grpo(rollouts.replace(rewards=rewards), scale_by_std=scale_by_std, eps=eps)
