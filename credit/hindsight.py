"""Hindsight, answer-conditioned step credit (issue 23's counterfactual family): PBSD (#164)
and HCAPO (#9) with the gold answer; SIOP (#75) with each response's own answer.

They read one extra teacher-forced pass, `rollouts.hindsight_logprobs` [..., G, L]: the
same policy scoring the response with an answer placed after the prompt (a privileged
teacher; experiments/training/hindsight.py), beside the sampling log-probs (`old_logprobs`,
else `logprobs`). Write d_t = log π(y_t | x, a, y_<t) − log π(y_t | x, y_<t).
By Bayes, Σ_t d_t over a prefix is log p(a | x, prefix) / p(a | x) up to the prior's
constant: how much the prefix raised the answer's posterior. Step j of a response is its
tokens after j step ends through the (j+1)-th (`rollouts.step_ends`); in PBSD and HCAPO only
its reasoning steps get a hindsight term: closed steps, except one closed on the response's
last token (the answer and its EOS, which the teacher could copy).
Readings are in each docstring; PBSD and HCAPO reduce to GRPO exactly at coefficient 0, or
when the hindsight pass equals the sampling pass (d = 0).
"""

import jax.numpy as jnp

from credit.implied_values import _step_sums  # each token's step total
from credit.groups import last_tokens
from credit.outcome import grpo_per_response
from credit.probes import _normalised_over_group
from credit.registry import register
from credit.rollouts import Rollouts, reasoning_steps
from credit.turn_base import _EPS, _grpo
from trees.step_graph import map_groups


def final_answers(tokens, mask, step_ends):
  """Each response's final answer: its tokens after its last reasoning step, without the
  step end on its last token (scratch_add: the sum's digits before EOS). A response whose
  last token closes no step (cut off) has none. Returns (answers int32 [..., G, L],
  left-aligned, −1 after; lengths int32 [..., G]; has bool [..., G])."""
  r = Rollouts(tokens=tokens, mask=mask, rewards=jnp.zeros(mask.shape[:-1]),
               step_ends=step_ends)
  reasoning, ends = reasoning_steps(r)
  m = jnp.asarray(mask, bool)
  n = jnp.sum(m, -1)
  has = (n > 0) & jnp.take_along_axis(ends, jnp.maximum(n - 1, 0)[..., None], -1)[..., 0]
  start = jnp.sum(reasoning, -1)  # the reasoning steps are a prefix
  length = jnp.where(has, n - 1 - start, 0)
  l = m.shape[-1]
  t = jnp.arange(l)
  src = jnp.clip(start[..., None] + t, 0, l - 1)
  ans = jnp.where(t < length[..., None], jnp.take_along_axis(jnp.asarray(tokens, jnp.int32),
                                                            src, -1), -1)
  return ans, length, has


def answer_clusters(tokens, mask, step_ends):
  """SIOP's outcome states by exact match: (same bool [..., G, G]: responses i and j have
  the same final answer, both having a non-empty one; share float32 [..., G]: the fraction
  of the group's answered responses in response i's cluster, m(c_i | q), 0 without one)."""
  return _clusters(*final_answers(tokens, mask, step_ends))


def _clusters(ans, length, has):
  """`answer_clusters` of `final_answers`' outputs."""
  has = has & (length > 0)  # the authors' code drops empty answers
  same = (jnp.all(ans[..., :, None, :] == ans[..., None, :, :], -1)
          & has[..., :, None] & has[..., None, :])
  answered = jnp.sum(has, -1, keepdims=True)
  share = jnp.sum(same, -1) / jnp.maximum(answered, 1)
  return same, jnp.where(has, share, 0.0).astype(jnp.float32)


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


@register("siop", needs=("step_ends", "self_hindsight"))
def siop(rollouts: Rollouts, *, lam: float = 0.5, broadcast: bool = False,
         scale_by_std: bool = True, eps: float = _EPS):
  """SIOP (#75), as the authors' code computes it (dl-m9/SIOP: `siop_process_reward.py`,
  `core_algos.py` 'siop'), with exact-match clusters and its reliability calibration off
  (η = 0: that evidence is NLI over tool observations), so q_i = m(c_i | q), the share of
  the group's answered responses in the cluster of response i's own answer. Label-free: the
  task's reward is not read. Step j's reward is q_i · (log p̂_{j+1} − log p̂_j), p̂ the
  per-token probability of i's answer after the prompt and i's first j steps; by Bayes that
  is the step's evidence Σ_{t in j} d_t over the answer's length, d from the loop's hindsight
  pass with i's own answer after the prompt (`rollouts.hindsight_logprobs`). The last step
  adds (1 − lam) · q_i; a one-step response gets only that; without an answer q_i = 0. The
  group's step rewards (every step of every response) are normalised together ((r − μ)/(σ +
  ε), σ Bessel, 1 when below ε; 0 for fewer than two) and each token gets the sum over its
  step and the later ones (γ = 1). `broadcast`: the authors' ablation, GRPO over each
  response's total reward. Returns float32 [..., G, L].
  """
  if rollouts.hindsight_logprobs is None or rollouts.step_ends is None:
    raise ValueError("siop needs rollouts.hindsight_logprobs (each response's own answer "
                     "after the prompt: the loop's self_hindsight pass) and rollouts.step_ends.")
  policy = rollouts.sampling_logprobs
  if policy is None:
    raise ValueError("siop needs rollouts.logprobs (or old_logprobs): log π(y | prompt).")
  mask = jnp.asarray(rollouts.mask, bool)
  ends = jnp.asarray(rollouts.step_ends, bool) & mask
  d = jnp.where(mask, jnp.asarray(rollouts.hindsight_logprobs, jnp.float32)
                - jnp.asarray(policy, jnp.float32), 0.0)
  answers = final_answers(rollouts.tokens, mask, ends)
  length = answers[1]
  _, q = _clusters(*answers)
  last = last_tokens(mask)
  marks = (ends | last) & mask  # each step's last token, where its reward sits
  several = jnp.sum(marks, -1, keepdims=True) > 1
  gain = _step_sums(d, mask, ends) / jnp.maximum(length, 1)[..., None].astype(jnp.float32)
  r = (jnp.where(marks & several, q[..., None] * gain, 0.0)
       + jnp.where(last, (1.0 - lam) * q[..., None], 0.0))
  if broadcast:
    a = map_groups(lambda x: _grpo(x, bool(scale_by_std), float(eps)), q.shape[:-1],
                   jnp.sum(r, -1))
    return jnp.where(jnp.asarray(rollouts.trained_mask, bool), a[..., None],
                     0.0).astype(jnp.float32)
  axes = (-2, -1)
  n = jnp.sum(marks, axes, keepdims=True)
  mean = jnp.sum(jnp.where(marks, r, 0.0), axes, keepdims=True) / jnp.maximum(n, 1)
  dev = jnp.where(marks, r - mean, 0.0)
  if scale_by_std:
    std = jnp.sqrt(jnp.sum(dev ** 2, axes, keepdims=True) / jnp.maximum(n - 1, 1))
    dev = dev / (jnp.where(std < eps, 1.0, std) + eps)
  z = jnp.where(n > 1, dev, 0.0)
  to_go = jnp.flip(jnp.cumsum(jnp.flip(z, -1), -1), -1)  # this step's and the later ones'
  return jnp.where(jnp.asarray(rollouts.trained_mask, bool), to_go, 0.0).astype(jnp.float32)
