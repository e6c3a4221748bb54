"""Self-probe potentials on reasoning steps (issue 23's probe family): SPAE (#22), P2S
(#148), MIG (#173).

Each reads `rollouts.step_probes` (`credit.rollouts.StepProbes` [..., G, S+1]: the policy's
own teacher-forced likelihood of the task's gold continuation after the response's first k
steps; the loop computes them with `experiments/training/probes.py`) and
`rollouts.step_ends`. Step j (j = 0, 1, ...) of a response is its tokens after j step ends
through the (j+1)-th; its potential moves from probe j to probe j+1. A step without a
probe after it (the answer after the last reasoning step, or a step past the S probes) gets
no process term: MIG's "process rewards on the chain of thought, outcome on the whole
completion", and SPAE's probes sit inside the reasoning only.

The three combine a group-relative outcome term (GRPO's A_i, `grpo_per_response`) with a
per-step term; with `coef=0` (P2S, MIG) or `xi=0` and no saturation (SPAE) they are GRPO
bit for bit.
"""

import jax
import jax.numpy as jnp

from credit.outcome import grpo_per_response
from credit.registry import register
from credit.rollouts import Rollouts


def _checked(rollouts: Rollouts, who: str):
  """(probes, step index of each token [..., G, L], mask) with a clear error if absent."""
  if rollouts.step_probes is None or rollouts.step_ends is None:
    raise ValueError(f"{who} needs rollouts.step_probes and rollouts.step_ends (a chain-of-"
                     f"thought task's gold-continuation probes: scratch_add in the loop).")
  p = rollouts.step_probes
  lead = rollouts.tokens.shape[:-1]
  for name in ("logprobs", "entropy", "mask"):
    x = getattr(p, name)
    if x.shape[:-1] != lead or x.shape[-1] < 2:
      raise ValueError(f"step_probes.{name} must be [..., G, S+1] with [..., G] = {lead} and "
                       f"S >= 1; got {x.shape}.")
  mask = jnp.asarray(rollouts.mask, bool)
  ends = jnp.asarray(rollouts.step_ends, bool) & mask
  return p, jnp.cumsum(ends, -1) - ends, mask


def _step_values(per_step, step, mask):
  """per_step [..., G, S] (step j's value) -> [..., G, L] on each token of its step j; 0 on
  masked tokens and on steps j >= S."""
  s = per_step.shape[-1]
  got = jnp.take_along_axis(per_step, jnp.minimum(step, s - 1), -1)
  return jnp.where(mask & (step < s), got, 0.0)


def _has_next(probes):
  """bool [..., G, S]: step j has probes j and j+1 (its potential before and after)."""
  m = jnp.asarray(probes.mask, bool)
  return m[..., :-1] & m[..., 1:]


def _normalised_over_group(x, ok, eps):
  """(x − μ)/(σ + ε) with μ, σ (Bessel) over the group's valid steps [..., G, S] (all of
  them together: DeepSeekMath's process supervision, §4.1.3); 0 where not ok, and 0 for a
  group whose valid values are all equal or with fewer than two."""
  axes = (-2, -1)
  w = ok.astype(jnp.float32)
  n = jnp.sum(w, axes, keepdims=True)
  mean = jnp.sum(w * x, axes, keepdims=True) / jnp.maximum(n, 1.0)
  dev = jnp.where(ok, x - mean, 0.0)
  std = jnp.sqrt(jnp.sum(dev ** 2, axes, keepdims=True) / jnp.maximum(n - 1.0, 1.0))
  spread = (jnp.max(jnp.where(ok, x, -jnp.inf), axes, keepdims=True)
            - jnp.min(jnp.where(ok, x, jnp.inf), axes, keepdims=True))
  varies = (n > 1) & ~(spread <= 0)  # NaN stays NaN (spread NaN: not <= 0)
  return jnp.where(ok & varies, dev / (std + eps), 0.0)


def _outcome_plus_steps(rollouts, step_reward, ok, step, mask, coef, scale_by_std, eps):
  """A = A_GRPO(R) on every token + coef · (group-normalised step reward) on its step."""
  outcome = grpo_per_response(rollouts.rewards, scale_by_std=scale_by_std, eps=eps)
  process = _normalised_over_group(step_reward, ok, eps)
  adv = outcome[..., None] + coef * _step_values(process, step, mask)
  return jnp.where(mask, adv, 0.0).astype(jnp.float32)


@register("p2s", needs=("step_ends", "step_probes"))
def p2s(rollouts: Rollouts, *, coef: float = 0.5, scale_by_std: bool = True,
        eps: float = 1e-6):
  """P2S (#148): the Path Faithfulness Reward of step j is the policy's probability of the
  gold chain of thought's suffix given the response's reasoning through step j,
  PFR_j = exp(mean per-token log p(gold suffix | prefix through step j)) (probe j+1; the
  per-token geometric mean, so suffixes of different lengths compare). Readings (the
  abstract says only that PFR "can be integrated with any outcome-based reward"): step j's
  tokens get A_i + coef · (PFR_j − μ)/(σ + ε), μ and σ over all valid steps of the group
  (process supervision's normalisation), the outcome advantage A_i (GRPO) on every token;
  the gold chain is the task's demonstration, not a synthesised and filtered one.
  Returns float32 [..., G, L].
  """
  probes, step, mask = _checked(rollouts, "p2s")
  ok = _has_next(probes)
  pfr = jnp.exp(jnp.asarray(probes.logprobs, jnp.float32)[..., 1:])
  return _outcome_plus_steps(rollouts, pfr, ok, step, mask, coef, scale_by_std, eps)


@register("mig", needs=("step_ends", "step_probes"))
def mig(rollouts: Rollouts, *, coef: float = 0.5, scale_by_std: bool = True,
        eps: float = 1e-6):
  """MIG (#173): step-wise marginal information gain over a monotonic historical watermark.
  With φ_k the mean per-token log-likelihood of the gold continuation after k steps
  (nats: information about the solution), step j gains g_j = max(0, φ_{j+1} − W_j), where
  the watermark W_j = max(φ_0, ..., φ_j) only rises: a step that merely recovers a level
  reached before earns nothing (the abstract's noise filter). Decoupled masking: the
  process term coef · (g_j − μ)/(σ + ε) (normalised over the group's valid steps) goes on
  the chain-of-thought steps only, the outcome advantage A_i (GRPO) on every token.
  Readings: φ from our gold-continuation probe; the Dual-Gated SFT objective is not part of
  this estimator. Returns float32 [..., G, L].
  """
  probes, step, mask = _checked(rollouts, "mig")
  phi = jnp.where(probes.mask, jnp.asarray(probes.logprobs, jnp.float32), -jnp.inf)
  watermark = jax.lax.cummax(phi, axis=phi.ndim - 1)[..., :-1]
  ok = _has_next(probes)
  gain = jnp.where(ok, jnp.maximum(phi[..., 1:] - watermark, 0.0), 0.0)
  return _outcome_plus_steps(rollouts, gain, ok, step, mask, coef, scale_by_std, eps)


def spae_potential(probes):
  """SPAE's Step Potential Φ = 1.5·acc·conf + 0.5·acc − conf in [−1, 1] [..., G, S+1], with
  acc = exp(mean log p(gold continuation)) (correctness) and conf = exp(−mean entropy)
  over the same tokens (confidence), the formula of the paper's public probing example
  (which uses the answer's summed log-prob; the per-token mean here, since our continuations
  are long). Confident and right → 1; confident and wrong → −1."""
  acc = jnp.exp(jnp.asarray(probes.logprobs, jnp.float32))
  conf = jnp.exp(-jnp.asarray(probes.entropy, jnp.float32))
  return 1.5 * acc * conf + 0.5 * acc - conf


@register("spae", needs=("step_ends", "step_probes"))
def spae(rollouts: Rollouts, *, xi: float = 0.2, saturation: float = 0.9,
         penalty: float = 0.5, scale_by_std: bool = True, eps: float = 1e-6):
  """SPAE (#22; its public README's equation): Â_{i,j} = A_i · f(Φ_{i,M(j)}) +
  ξ · g(ΔΦ_{i,M(j)}), M(j) the step of token j, Φ = `spae_potential`.
  - Potential difference shaping: g(ΔΦ) = ΔΦ_j = Φ_{j+1} − Φ_j over step j (Φ_0, the
    probe before any step, is used: the example probes only after steps, so its first
    difference is 0).
  - Potential saturation penalty: once a probe's Φ exceeds `saturation` (0.9, the
    example's solved threshold), the reasoning steps after it get f = 1 − penalty for
    A_i > 0 and 1 + penalty for A_i < 0 (less credit for correct but redundant checking,
    more blame for overturning a solved state); f = 1 elsewhere. Our reading: the README
    says the penalty "downweights outcome credit", the abstract that it penalises.
  Tokens without a probe after their step (the answer) keep A_i. `xi=0, penalty=0` is
  GRPO bit for bit. Returns float32 [..., G, L].
  """
  probes, step, mask = _checked(rollouts, "spae")
  phi = spae_potential(probes)
  ok = _has_next(probes)
  delta = jnp.where(ok, phi[..., 1:] - phi[..., :-1], 0.0)
  # Saturated before step j: some probe k <= j (valid) has Φ_k > saturation.
  hit = jnp.asarray(probes.mask, bool) & (phi > saturation)
  saturated = jnp.cumsum(hit, -1)[..., :-1] > 0  # [..., G, S]
  outcome = grpo_per_response(rollouts.rewards, scale_by_std=scale_by_std, eps=eps)[..., None]
  f = jnp.where(outcome > 0, 1.0 - penalty, 1.0 + penalty)
  f_tok = jnp.where(_step_values(ok & saturated, step, mask) > 0, f, 1.0)
  adv = outcome * f_tok + xi * _step_values(delta, step, mask)
  return jnp.where(mask, adv, 0.0).astype(jnp.float32)
