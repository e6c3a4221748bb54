"""Hindsight, answer-conditioned step credit (issue 23's counterfactual family): PBSD (#164)
and HCAPO (#9).

Both read one extra teacher-forced pass, `rollouts.hindsight_logprobs` [..., G, L]: the
same policy scoring the response with the task's gold answer placed after the prompt (a
privileged teacher; experiments/training/hindsight.py), beside the sampling log-probs
(`old_logprobs`, else `logprobs`). Write d_t = log π(y_t | x, a*, y_<t) − log π(y_t | x, y_<t).
By Bayes, Σ_t d_t over a prefix is log p(a* | x, prefix) / p(a* | x) up to the prior's
constant: how much the prefix raised the answer's posterior. Step j of a response is its
tokens after j step ends through the (j+1)-th (`rollouts.step_ends`); only its reasoning
steps get a hindsight term: closed steps, except one closed on the response's last token
(the answer and its EOS, which the teacher could copy).
Readings are in each docstring; both reduce to GRPO exactly at coefficient 0, or when the
hindsight pass equals the sampling pass (d = 0).
"""

import jax.numpy as jnp

from credit.implied_values import _step_sums  # each token's step total
from credit.outcome import grpo_per_response
from credit.probes import _normalised_over_group
from credit.registry import register
from credit.rollouts import Rollouts, reasoning_steps


def _log_ratio(rollouts: Rollouts, who: str):
  """(d [..., G, L] (0 off reasoning steps), the reasoning steps' trained tokens, their
  step ends, each token's step total of d)."""
  if rollouts.hindsight_logprobs is None or rollouts.step_ends is None:
    raise ValueError(f"{who} needs rollouts.hindsight_logprobs and rollouts.step_ends (a "
                     f"chain-of-thought task's answer-conditioned pass: scratch_add in the loop).")
  policy = rollouts.sampling_logprobs
  if policy is None:
    raise ValueError(f"{who} needs rollouts.logprobs (or old_logprobs): log π(y | prompt).")
  closed, ends = reasoning_steps(rollouts)
  d = jnp.asarray(rollouts.hindsight_logprobs, jnp.float32) - jnp.asarray(policy, jnp.float32)
  d = jnp.where(closed, d, 0.0)
  return d, closed, ends & closed, _step_sums(d, closed, ends)


@register("pbsd", needs=("step_ends", "hindsight_logprobs"))
def pbsd(rollouts: Rollouts, *, beta: float = 1.0, scale_by_std: bool = True,
         eps: float = 1e-6):
  """PBSD (#164): the posterior-to-prior ratio of the verified answer, turned by Bayes into
  the teacher/student likelihood ratio and decomposed step by step, reweights the outcome
  advantage. Step j's evidence e_j = Σ_{t in step j} d_t (the log Bayes factor the step
  contributes to a*). Reading ("a reweighting scheme" that turns the sparse outcome into
  turn-level credit): the response's outcome advantage A_i (GRPO) is redistributed over
  its n reasoning steps with mean-one weights w_j = n · softmax_j(β · sign(A_i) · e_j): a
  success credits most the steps that support the answer, a failure blames most the steps
  that undermine it; the answer's tokens keep A_i. Σ_j w_j = n, so the response's total
  credit over its steps is unchanged. β = 0 is GRPO. Returns float32 [..., G, L].
  """
  _, closed, is_end, evidence = _log_ratio(rollouts, "pbsd")
  outcome = grpo_per_response(rollouts.rewards, scale_by_std=scale_by_std, eps=eps)
  z = beta * jnp.sign(outcome)[..., None] * evidence  # on every token of its step
  top = jnp.max(jnp.where(is_end, z, -jnp.inf), -1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  total = jnp.sum(jnp.where(is_end, jnp.exp(z - top), 0.0), -1, keepdims=True)
  n = jnp.sum(is_end, -1, keepdims=True)
  w = jnp.where(closed, n * jnp.exp(z - top) / jnp.maximum(total, 1e-30), 1.0)
  mask = jnp.asarray(rollouts.trained_mask, bool)
  return jnp.where(mask, outcome[..., None] * w, 0.0).astype(jnp.float32)


@register("hcapo", needs=("step_ends", "hindsight_logprobs"))
def hcapo(rollouts: Rollouts, *, omega: float = 0.5, clip: float = 1.0,
          scale_by_std: bool = True, eps: float = 1e-6):
  """HCAPO (#9): the policy itself as a hindsight critic of each step, plus a multi-scale
  advantage. Reading, after hindsight credit assignment (Harutyunyan et al., 2019, the
  return-conditioned form A(s, a) = (1 − π(a|s) / h(a|s, Z)) · Z): the hindsight policy h
  is the answer-conditioned pass, Z the response's reward R_i, and a step's ratio is the
  per-token geometric mean, so step j's hindsight advantage is
  q_j = (1 − exp(−clip(d̄_j, −c, c))) · R_i with d̄_j the mean of d_t over the step and c =
  `clip` (a step the teacher finds likelier once the answer is known is credited, one it
  finds unlikelier is blamed, only in rewarded responses). Multi-scale: the step-scale
  q_j, normalised over the group's steps ((q − μ)/(σ + ε), as P2S), is added to the
  response-scale A_i (GRPO): A = A_i + ω · q̃_j on step j's tokens, A_i on the answer's.
  ω = 0 is GRPO. Returns float32 [..., G, L].
  """
  _, closed, is_end, total = _log_ratio(rollouts, "hcapo")
  count = _step_sums(closed.astype(jnp.float32), closed, is_end)
  mean = total / jnp.maximum(count, 1.0)
  r = jnp.asarray(rollouts.rewards, jnp.float32)[..., None]
  q = (1.0 - jnp.exp(-jnp.clip(mean, -clip, clip))) * r
  return outcome_plus_step_term(rollouts, q, closed, is_end, omega, scale_by_std, eps)


def outcome_plus_step_term(rollouts, per_step, closed, is_end, coef, scale_by_std, eps):
  """A = A_GRPO + coef · q̃_j on the tokens of reasoning step j, A_GRPO elsewhere, with
  q̃ = `per_step` (each step's value, read at its end) normalised over the group's steps
  ((q − μ)/(σ + ε), P2S's normalisation). HCAPO and PUM."""
  outcome = grpo_per_response(rollouts.rewards, scale_by_std=scale_by_std, eps=eps)
  q = _normalised_over_group(per_step, is_end, eps)
  step_term = _step_sums(jnp.where(is_end, q, 0.0), closed, is_end)  # end -> its step
  mask = jnp.asarray(rollouts.trained_mask, bool)
  return jnp.where(mask, outcome[..., None] + coef * step_term, 0.0).astype(jnp.float32)
