"""Gradient masks: keep the policy gradient off the reasoning, on the answer only."""

import jax.numpy as jnp

from credit.polarity import base_advantages
from credit.registry import register
from credit.rollouts import Rollouts


def answer_positions(rollouts: Rollouts, answer_tokens: int = 0):
  """bool [..., G, L]: each response's answer, the last step: the unmasked tokens after
  its last step end that has tokens after it (`step_ends`; a response without a step end
  is all answer), or, with `answer_tokens` = k > 0, its last k tokens (no step ends)."""
  mask = jnp.asarray(rollouts.mask, bool)
  if answer_tokens < 0:
    raise ValueError(f"answer_tokens must be >= 0 (0: the last step); got {answer_tokens}.")
  if answer_tokens > 0:
    length = jnp.sum(mask, axis=-1, keepdims=True)
    return mask & (jnp.arange(mask.shape[-1]) >= length - answer_tokens)
  if rollouts.step_ends is None:
    raise ValueError("answer_only needs rollouts.step_ends (or answer_tokens > 0).")
  ends = jnp.asarray(rollouts.step_ends, bool) & mask
  step = jnp.cumsum(ends, axis=-1) - ends  # each token's step index
  last = jnp.max(jnp.where(mask, step, -1), axis=-1, keepdims=True)
  return mask & (step == last)


def _answer_mask(rollouts, adv, *, answer_tokens=0, **_):
  return answer_positions(rollouts, answer_tokens)


@register("answer_only", needs=("step_ends",), loss_mask=_answer_mask)
def answer_only(rollouts: Rollouts, *, base: str = "grpo", answer_tokens: int = 0):
  """Forecasting gradient mask (#143): the `base` estimator's advantages, with the
  policy loss restricted to the answer (`credit.loss_mask`), so the reasoning before it
  gets no gradient ("keep the gradient off the reasoning, ... a gradient mask").

  The answer is the response's last step (`step_ends`; in `scratch_add` the final sum
  and EOS, after the D-th ','), or its last `answer_tokens` tokens when > 0. The
  advantages themselves are `base`'s everywhere (the mask acts in the loss), so with
  every token in the answer this is `base`. float32 [..., G, L].
  """
  if answer_tokens < 0:
    raise ValueError(f"answer_tokens must be >= 0 (0: the last step); got {answer_tokens}.")
  if answer_tokens == 0 and rollouts.step_ends is None:
    raise ValueError("answer_only needs rollouts.step_ends (or answer_tokens > 0).")
  return base_advantages(rollouts, base, "answer_only")
