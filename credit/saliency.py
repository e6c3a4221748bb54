"""Gradient-saliency token weighting: GRAIL (#55)."""

import jax.numpy as jnp

from credit.context_shift import NORMALIZE, mass_conserving, reweight
from credit.registry import register
from credit.rollouts import Rollouts

# The saliency the loop computes (experiments/training/saliency.py: `token_saliency`).
SALIENCY_KINDS = ("grad_norm", "grad_x_input")


@register("grail", needs=("saliency",))
def grail(rollouts: Rollouts, mix: float = 0.5, power: float = 1.0,
          normalize: str = "response", base: str = "grpo",
          saliency_kind: str = "grad_norm", answer_tokens: int = 0):
  """GRAIL (#55, Gradient-Reweighted Advantage): tokens to which the response's
  likelihood is more locally sensitive get more of its advantage,

    w_t = (1 − mix) + mix · s_t^p · n / Σ_s s_s^p,   A_{i,t} = A_i^base · w_t,

  s_t = `rollouts.saliency` (>= 0), the gradient saliency of token t from one extra
  backward pass (the loop: ||∂J/∂e_t|| of the response log-likelihood J w.r.t. the
  token's input embedding, `saliency_kind='grad_norm'`, or |<∂J/∂e_t, e_t>|,
  'grad_x_input', the abstract's gradient × activation; `answer_tokens` > 0 takes J
  over the response's last `answer_tokens` tokens only, "sensitivity of the final
  answer"; these two are read by the loop, which computes the saliency). Mass-conserving
  within the response (`normalize='group'`: the group), so the response keeps its base
  credit. `mix` in [0, 1] (default 0.5: half uniform, because the last token, never fed
  back inside the response, has saliency 0 and would otherwise get no credit); 0 is
  `base`. `power` p > 0 sharpens (> 1) or flattens (< 1) the weights. A response with
  saliency 0 everywhere keeps its base advantage. Saliencies must be finite and >= 0.
  """
  if rollouts.saliency is None:
    raise ValueError("grail needs rollouts.saliency (per-token gradient saliency, one extra "
                     "backward pass; the loop computes it when the estimator needs "
                     "('saliency',)).")
  if not 0.0 <= mix <= 1.0:
    raise ValueError(f"mix must be in [0, 1]; got {mix}.")
  if not power > 0:
    raise ValueError(f"power must be > 0; got {power}.")
  if normalize not in NORMALIZE:
    raise ValueError(f"normalize must be one of {NORMALIZE}; got {normalize!r}.")
  if saliency_kind not in SALIENCY_KINDS:
    raise ValueError(f"saliency_kind must be one of {SALIENCY_KINDS}; got {saliency_kind!r}.")
  if not (isinstance(answer_tokens, int) and answer_tokens >= 0):
    raise ValueError(f"answer_tokens must be an int >= 0 (0: the whole response); "
                     f"got {answer_tokens!r}.")
  keep = rollouts.trained_mask
  s = jnp.where(keep, jnp.asarray(rollouts.saliency, jnp.float32), 0.0)
  u = s if power == 1.0 else jnp.power(s, power)
  w = 1.0 + mix * (mass_conserving(u, keep, normalize) - 1.0)  # mix = 0: exactly 1
  return reweight(rollouts, jnp.where(keep, w, 0.0), base)
