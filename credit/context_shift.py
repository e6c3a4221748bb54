"""Context-shift token credit: GCPO (#4) and PGPO (#33).

Both reweight an outcome advantage (GRPO by default, `base`) token by token with how much
the prompt matters for each sampled token, read from one extra teacher-forced pass with
the context changed: `rollouts.context_logprobs` [..., G, L] = log π(y_t | changed prompt,
y_<t), next to the sampling log-probs log π(y_t | prompt, y_<t) (`old_logprobs`, else
`logprobs`). Write x_t = log π(y_t | prompt) − log π(y_t | changed prompt).

The training loop (experiments/training/loop.py) makes the changed context: by default the
prompt of the next group in the batch (`jnp.roll` by one over the prompts, their lengths
too), i.e. "a different problem of the same task" — the negative prompt of GCPO and the
ablated input of PGPO; a task may define `context_prompts(prompts, info)` instead.
`experiments/credit_quality.py` scores both exactly on token_tree (the tabular policy
under the next prompt's key).

Token weights are mass-conserving: w_t = u_t · n / Σ_s |u_s| over the response's trained
tokens (n of them), so Σ_t w_t = n when u >= 0 and the response's total credit is its
base advantage's; a response whose u is 0 everywhere gets w = 1. A_{i,t} = A_i · w_{i,t},
0 off `trained_mask`. When the changed context changes nothing (x = 0) both reduce to
`base` exactly.
"""

import jax.numpy as jnp

from credit.registry import get, register
from credit.rollouts import Rollouts

NORMALIZE = ("response", "group")


def _check_in(name: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"{name} must be one of {valid}; got {value!r}.")


def _log_ratio(rollouts: Rollouts, method: str):
  """x = log π(y | prompt) − log π(y | changed prompt) [..., G, L], 0 off trained_mask."""
  policy = rollouts.sampling_logprobs
  if policy is None:
    raise ValueError(f"{method} needs rollouts.logprobs (or old_logprobs): log π(y | prompt).")
  if rollouts.context_logprobs is None:
    raise ValueError(f"{method} needs rollouts.context_logprobs (log π(y | changed prompt), "
                     "one teacher-forced pass with the context changed; the loop computes it "
                     "when the estimator needs ('context_logprobs',)).")
  keep = rollouts.trained_mask
  x = jnp.asarray(policy, jnp.float32) - jnp.asarray(rollouts.context_logprobs, jnp.float32)
  return jnp.where(keep, x, 0.0), keep


def mass_conserving(u, mask, normalize: str = "response"):
  """w = u · n / Σ|u| over each response's (`normalize='response'`) or each group's
  (`'group'`) tokens in `mask` (n of them); w = 1 where that sum is 0; 0 off `mask`."""
  _check_in("normalize", normalize, NORMALIZE)
  u = jnp.where(mask, u, 0.0)
  axes = (-1,) if normalize == "response" else (-2, -1)
  total = jnp.sum(jnp.abs(u), axis=axes, keepdims=True)
  n = jnp.sum(mask, axis=axes, keepdims=True, dtype=jnp.float32)
  w = jnp.where(total > 0, u * n / jnp.where(total > 0, total, 1.0), 1.0)
  return jnp.where(mask, w, 0.0).astype(jnp.float32)


def reweight(rollouts: Rollouts, weights, base: str):
  """A_{i,t} = base(rollouts)_{i,t} · w_{i,t}."""
  return (get(base)(rollouts) * weights).astype(jnp.float32)


@register("gcpo", needs=("logprobs", "context_logprobs"))
def gcpo(rollouts: Rollouts, transform: str = "abs", mix: float = 1.0,
         normalize: str = "response", base: str = "grpo"):
  """GCPO (#4, Guidance Contrastive PO): token advantages proportional to the difference
  of the sampled token's log-probs under the positive and the negative prompt,

    d_t = f(x_t),  x_t = log π(y_t | prompt) − log π(y_t | negative prompt),
    w_t = (1 − mix) + mix · d_t · n / Σ_s |d_s|,   A_{i,t} = A_i^base · w_t.

  The abstract is vague; the reading here: the positive prompt is the real one, the
  negative one the loop's changed context (another problem); "proportional" is
  mass-conserving within the response (`normalize='group'`: within the group), so the
  response keeps its base credit and only its distribution over tokens changes.
  `transform` f: 'abs' (default: |x|, how much the prompt moves the token either way; in
  a failed response the tokens the prompt makes *less* likely are the likely errors, so
  they keep their blame), 'relu' (max(x, 0): only tokens the prompt makes more likely,
  the guidance direction) or 'signed' (x: tokens the negative prompt prefers get the
  opposite sign). `mix` in [0, 1]: 0 is `base`, 1 (default) is
  purely proportional. A response with d = 0 on every token keeps its base advantage.
  """
  _check_in("transform", transform, ("relu", "abs", "signed"))
  if not 0.0 <= mix <= 1.0:
    raise ValueError(f"mix must be in [0, 1]; got {mix}.")
  x, keep = _log_ratio(rollouts, "gcpo")
  d = {"relu": jnp.maximum(x, 0.0), "abs": jnp.abs(x), "signed": x}[transform]
  w = 1.0 + mix * (mass_conserving(d, keep, normalize) - 1.0)  # mix = 0: exactly 1
  return reweight(rollouts, jnp.where(keep, w, 0.0), base)


@register("pgpo", needs=("logprobs", "context_logprobs"))
def pgpo(rollouts: Rollouts, estimator: str = "k3", threshold: float = 1.0,
         absolute: bool = False, weight: str = "proportional", floor: float = 0.2,
         max_ratio: float = 10.0, normalize: str = "response", base: str = "grpo"):
  """PGPO (#33, Perception-Grounded PO): token dependency D_t = KL(π(·|prompt) ||
  π(·|changed prompt)) at step t, a threshold gate and mass-conserving reweighting:

    g_t = [D_t > τ],  u_t = g_t · v_t + (1 − g_t) · floor,
    w_t = u_t · n / Σ_s u_s,   A_{i,t} = A_i^base · w_t.

  D_t is estimated from the sampled token y_t ~ π(·|prompt) with x_t as above:
  `estimator='k3'` (default) e^{−x} − 1 + x (unbiased, >= 0), 'relu' max(x, 0) (the
  positive part of the unbiased k1 = x), 'abs' |x|. (The exact KL needs both next-token
  distributions; the loop's one extra pass gives the sampled token's log-prob only.)
  τ = `threshold` · mean_s D_s over the response's tokens (`absolute=True`: `threshold`
  in nats). Gated tokens get v_t = min(D_t / mean_s D_s, `max_ratio`)
  (`weight='proportional'`) or 1 (`'binary'`); the rest `floor` (>= 0; the "suppressed
  linguistic prior" tokens). The paper's ablated input is the image; here it is the
  loop's changed prompt. A response (`normalize='group'`: a group) with no gated token,
  e.g. dependency 0 everywhere, keeps its base advantage exactly.
  """
  _check_in("estimator", estimator, ("k3", "relu", "abs"))
  _check_in("weight", weight, ("proportional", "binary"))
  if threshold < 0:
    raise ValueError(f"threshold must be >= 0; got {threshold}.")
  if floor < 0:
    raise ValueError(f"floor must be >= 0; got {floor}.")
  if not max_ratio > 0:
    raise ValueError(f"max_ratio must be > 0; got {max_ratio}.")
  x, keep = _log_ratio(rollouts, "pgpo")
  dep = {"k3": jnp.expm1(-x) + x, "relu": jnp.maximum(x, 0.0), "abs": jnp.abs(x)}[estimator]
  dep = jnp.where(keep, dep, 0.0)
  n = jnp.sum(keep, axis=-1, keepdims=True, dtype=jnp.float32)
  mean = jnp.sum(dep, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)
  tau = threshold if absolute else threshold * mean
  gate = keep & (dep > tau)
  safe = jnp.where(mean > 0, mean, 1.0)
  v = jnp.minimum(dep / safe, max_ratio) if weight == "proportional" else jnp.ones_like(dep)
  u = jnp.where(gate, v, floor)
  # No gated token: u is uniform, so w = 1 (exactly, not a rounded floor·n / Σ floor).
  gated = jnp.any(gate, axis=(-1,) if normalize == "response" else (-2, -1), keepdims=True)
  w = jnp.where(gated, mass_conserving(u, keep, normalize), jnp.where(keep, 1.0, 0.0))
  return reweight(rollouts, w, base)
