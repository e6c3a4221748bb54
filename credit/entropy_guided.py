"""Entropy / surprisal token weighting, part 2: DGPO (#13), UCAS (#15) and DCPO (#116).

These read more of the sampling policy's uncertainty than a surprisal quantile: the
reference policy's log-probs (DGPO), a response-level self-confidence (UCAS), a tempered
target distribution (DCPO). Only the sampled token's log-probs and the entropy are in
`Rollouts`, not full next-token distributions; each docstring states how the paper's
distribution-level quantity is read from them. Helpers and conventions: see
`credit.entropy_weighting`.
"""

import jax.numpy as jnp

from credit.entropy_weighting import entropy, masked_mean, surprisal
from credit.groups import all_equal, group_stats
from credit.outcome import grpo
from credit.registry import register
from credit.rollouts import Rollouts


def hellinger(logp, logq, form: str = "binary"):
  """Hellinger distance between π and π_ref read from the sampled token's log-probs.

  'binary': the distance between the two distributions coarsened to {y_t, any other
  token}, H² = ½[(√p − √q)² + (√(1−p) − √(1−q))²] (a lower bound on the full one, by data
  processing; in [0, 1]). 'token': the sampled token's own term, |√p − √q|/√2. Both are
  exactly 0 when p = q.
  """
  p, q = jnp.exp(logp), jnp.exp(logq)
  token = (jnp.sqrt(p) - jnp.sqrt(q)) ** 2
  if form == "token":
    return jnp.sqrt(0.5 * token)
  if form != "binary":
    raise ValueError(f"hellinger form must be 'binary' or 'token'; got {form!r}.")
  rest = (jnp.sqrt(jnp.maximum(-jnp.expm1(logp), 0.0))
          - jnp.sqrt(jnp.maximum(-jnp.expm1(logq), 0.0))) ** 2
  return jnp.sqrt(0.5 * (token + rest))


@register("dgpo", needs=("logprobs", "ref_logprobs", "entropy"))
def dgpo(rollouts: Rollouts, *, mix: float = 0.5, form: str = "binary"):
  """DGPO (#13; no public code found; our reading of the abstract): the sequence advantage
  is redistributed over its tokens by entropy-gated Hellinger scores, in place of a KL
  penalty (run it with the loop's KL coefficient at 0).

  Score c_t = D_H(π, π_ref)_t · H_t: D_H from the sampled token's probabilities under the
  sampling policy and the reference (`hellinger`, `form`), gated by the sampling entropy
  H_t, so low-entropy deviations count little. Weights keep the response's total credit:
  w_t = n_i·c_t/Σ_t c_t over i's n_i trained tokens (1 if Σ c = 0), mixed with uniform:
  A_{i,t} = (1 + `mix`·(w_t − 1))·A_i^GRPO. `mix=0`, or π = π_ref, is `grpo` exactly.
  """
  if not 0.0 <= mix <= 1.0:
    raise ValueError(f"dgpo: mix must be in [0, 1]; got {mix}.")
  if form not in ("binary", "token"):
    raise ValueError(f"dgpo: form must be 'binary' or 'token'; got {form!r}.")
  logp = -surprisal(rollouts, "dgpo")
  if rollouts.ref_logprobs is None:
    raise ValueError("dgpo needs rollouts.ref_logprobs, the reference policy's log-probs "
                     "of the sampled tokens; got None.")
  ref = jnp.asarray(rollouts.ref_logprobs, jnp.float32)
  tok = rollouts.trained_mask
  score = jnp.where(tok, hellinger(logp, ref, form) * entropy(rollouts, "dgpo"), 0.0)
  total = jnp.sum(score, axis=-1, keepdims=True)
  n = jnp.sum(tok, axis=-1, keepdims=True)
  w = jnp.where(total > 0, n * score / jnp.where(total > 0, total, 1.0), 1.0)
  return grpo(rollouts) * (1.0 + mix * (w - 1.0))


@register("ucas", needs=("logprobs", "entropy"))
def ucas(rollouts: Rollouts, *, beta_pos: float = 0.25, beta_neg: float = 0.35,
         penalty: float = 0.05, confidence: str = "entropy", eps: float = 1e-6):
  """UCAS (#15; public code xvolcano02/UCAS, `compute_ucas_advantage`).

  Stage 1, response level: self-confidence C_i = Σ_t c_{i,t} over trained tokens,
  z-scored in the group (z_i = (C_i − μ)/(σ + ε), Bessel σ; 0 if all equal; a group of one
  μ = 0, σ = 1); A'_i = A_i^GRPO·e^{−β₊ z_i} if A_i > 0 (confident correct answers get
  less), A_i^GRPO·e^{β₋ z_i} otherwise (confident wrong ones are pushed down harder).
  Stage 2, token level: A_{i,t} = A'_i − λ·ℓ̂_{i,t}, ℓ̂ the sampled token's certainty
  min-max scaled over the batch's trained tokens (0.5 if all equal); where A'_i > 0 the
  result is clamped at 0 so a correct answer never turns negative.
  Reading: the paper's per-token certainty KL(U‖π) and raw logits need the full
  distribution; `confidence='entropy'` uses c = −H_t (negentropy, KL(π‖U) up to the
  constant log V), 'logprob' uses c = log π_old(y_t); ℓ̂ uses log π_old(y_t), the logit
  less the position's log-normaliser. As in the public code, λ > 0 also gives tokens of
  groups with all-equal rewards (GRPO 0) a small negative credit. β± = λ = 0 is `grpo`.
  """
  if beta_pos < 0 or beta_neg < 0 or penalty < 0:
    raise ValueError(f"ucas: beta_pos, beta_neg and penalty must be >= 0; got "
                     f"{beta_pos}, {beta_neg}, {penalty}.")
  logp = -surprisal(rollouts, "ucas")
  if confidence == "entropy":
    c = -entropy(rollouts, "ucas")
  elif confidence == "logprob":
    c = logp
  else:
    raise ValueError(f"ucas: confidence must be 'entropy' or 'logprob'; got {confidence!r}.")
  tok = rollouts.trained_mask
  conf = jnp.sum(jnp.where(tok, c, 0.0), axis=-1)
  mean, std = group_stats(conf)
  z = (conf - mean) / (std + eps)
  if conf.shape[-1] > 1:
    z = jnp.where(all_equal(conf), 0.0, z)
  base = grpo(rollouts, eps=eps)
  z = z[..., None]
  shaped = base * jnp.where(base > 0, jnp.exp(-beta_pos * z), jnp.exp(beta_neg * z))
  lo = jnp.min(jnp.where(tok, logp, jnp.inf))
  hi = jnp.max(jnp.where(tok, logp, -jnp.inf))
  flat = jnp.abs(hi - lo) <= 1e-8 + 1e-5 * jnp.abs(lo)  # torch.isclose, as the public code
  scaled = jnp.where(flat, 0.5, (logp - lo) / jnp.where(flat, 1.0, hi - lo + 1e-6))
  raw = shaped - penalty * scaled
  out = jnp.where(shaped > 0, jnp.maximum(raw, 0.0), raw)
  return jnp.where(rollouts.mask, out, 0.0)


@register("dcpo", needs=("logprobs", "entropy"))
def dcpo(rollouts: Rollouts, *, entropy_target: float = 0.5, temperature_high: float = 1.2,
         temperature_low: float = 0.8, alpha_max: float = 0.1,
         reward_threshold: float = 0.05, eps: float = 1e-6):
  """DCPO (#116; the abstract is vague: "entropy regulation as distribution-level
  regularization toward a better target distribution"; read from public code
  597358816/DCPO, `ray_trainer.fit`, `algorithm=DCPO`): GRPO mixed with a pull toward a
  tempered copy of the policy on correct responses,
  A_{i,t} = (1 − α)·A_i^GRPO + α·1[R_i > `reward_threshold`]·π_T(y_t)/π(y_t).

  T = `temperature_high` (flatter: raises entropy) while the batch entropy H̄ <=
  `entropy_target`, `temperature_low` above it; a = min(|H_tgt − H̄|, `alpha_max`)/ρ with
  ρ the batch's fraction of correct responses, α = a/(1 + a) (α = 0 when ρ = 0).
  Our readings: H̄ is this batch's mean `rollouts.entropy` over trained tokens (the public
  code uses the previous update's entropy); the full distribution is not available, so
  log π_T(y)/π(y) = (1/T − 1) log p − log Σ_v p_v^{1/T} is taken to first order in 1/T − 1,
  log Σ_v p_v^β ≈ (1 − β)·H, giving π_T/π ≈ exp((1 − 1/T)(s_t − H_t)) (log clipped to ±20).
  `alpha_max = 0` (or H̄ = H_tgt) is `grpo` exactly.
  """
  if temperature_high <= 0 or temperature_low <= 0:
    raise ValueError(f"dcpo: temperatures must be > 0; got {temperature_high}, "
                     f"{temperature_low}.")
  if alpha_max < 0 or entropy_target < 0:
    raise ValueError(f"dcpo: alpha_max and entropy_target must be >= 0; got {alpha_max}, "
                     f"{entropy_target}.")
  s, h = surprisal(rollouts, "dcpo"), entropy(rollouts, "dcpo")
  batch_h = masked_mean(h, rollouts.trained_mask)
  temperature = jnp.where(batch_h <= entropy_target, temperature_high, temperature_low)
  ratio = jnp.exp(jnp.clip((1.0 - 1.0 / temperature) * (s - h), -20.0, 20.0))
  correct = jnp.asarray(rollouts.rewards, jnp.float32) > reward_threshold
  rho = jnp.mean(correct)
  a = jnp.minimum(jnp.abs(entropy_target - batch_h), alpha_max) / jnp.where(rho > 0, rho, 1.0)
  alpha = jnp.where(rho > 0, a / (1.0 + a), 0.0)
  target = jnp.where(correct[..., None], ratio, 0.0)
  out = (1.0 - alpha) * grpo(rollouts, eps=eps) + alpha * target
  return jnp.where(rollouts.mask, out, 0.0)
