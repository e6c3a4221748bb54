"""Polarity-asymmetric advantages and curricula over the advantage sign.

Each estimator reweights the positive and the negative part of a base estimator's
advantages, A' = w₊·max(A, 0) + w₋·min(A, 0), with fixed weights (`polarity`, `nsr`,
`wapo`) or weights that change over training (`capo`: a step counter in the
estimator's state; `a_grae`: the batch's mean pass rate, or its EMA in the state).

`base` names any registered estimator that needs no optional field and carries no
state (default 'grpo'; e.g. 'dr_grpo', 'rloo', 'reinforce_pp_baseline', 'tempo').
`drop_suppressed=True` also takes the samples whose polarity has weight 0 out of the
policy loss (`credit.loss_mask`), so they leave the loss normalisers too; by default
they stay in with advantage 0.
"""

import jax.numpy as jnp

from credit import outcome  # also registers the default base, 'grpo'
from credit import registry
from credit.groups import to_tokens
from credit.registry import register
from credit.rollouts import Rollouts


def base_advantages(rollouts: Rollouts, base: str, caller: str):
  """float32 [..., G, L]: registered estimator `base` on `rollouts` (with its defaults)."""
  if base == caller:
    raise ValueError(f"{caller}: base must be another estimator; got base={base!r}.")
  est = registry.get(base)
  if registry.needs(base):
    raise ValueError(f"{caller}: base {base!r} needs {registry.needs(base)}, which {caller} "
                     f"does not declare; use a base without needs (e.g. 'grpo', 'rloo').")
  if registry.stateful(base):
    raise ValueError(f"{caller}: base {base!r} carries state; use a stateless base.")
  return est(rollouts)


def split_polarity(adv, positive_weight, negative_weight):
  """w₊·max(A, 0) + w₋·min(A, 0); weights 1 return A exactly."""
  return positive_weight * jnp.maximum(adv, 0.0) + negative_weight * jnp.minimum(adv, 0.0)


def _check_weight(name: str, value):
  if not value >= 0:  # also catches NaN
    raise ValueError(f"{name} must be >= 0; got {value}.")


def _keep_mask(rollouts, base, caller, positive_weight, negative_weight, drop_suppressed):
  """bool [..., G, L]: the tokens left in the loss (all, unless `drop_suppressed`, when the
  tokens whose base advantage has a polarity of weight 0 leave it)."""
  if not drop_suppressed:
    return rollouts.mask
  adv = base_advantages(rollouts, base, caller)
  gone = ((adv > 0) & (positive_weight == 0)) | ((adv < 0) & (negative_weight == 0))
  return rollouts.mask & ~gone


def _polarity_mask(rollouts, adv, *, base="grpo", positive_weight=1.0, negative_weight=1.0,
                   drop_suppressed=False, **_):
  return _keep_mask(rollouts, base, "polarity", positive_weight, negative_weight,
                    drop_suppressed)


@register("polarity", loss_mask=_polarity_mask)
def polarity(rollouts: Rollouts, *, base: str = "grpo", positive_weight: float = 1.0,
             negative_weight: float = 1.0, drop_suppressed: bool = False):
  """A' = w₊·max(A, 0) + w₋·min(A, 0) of the `base` advantages A (the family's
  common form; `nsr`, `wapo`, `capo` and `a_grae` are instances).

  Weights of 1 give `base` exactly (GRPO by default). Returns float32 [..., G, L].
  """
  _check_weight("positive_weight", positive_weight)
  _check_weight("negative_weight", negative_weight)
  del drop_suppressed  # read by the loss mask
  adv = base_advantages(rollouts, base, "polarity")
  return split_polarity(adv, positive_weight, negative_weight)


def _nsr_mask(rollouts, adv, *, base="grpo", positive_weight=0.0, drop_suppressed=False, **_):
  return _keep_mask(rollouts, base, "nsr", positive_weight, 1.0, drop_suppressed)


@register("nsr", loss_mask=_nsr_mask)
def nsr(rollouts: Rollouts, *, base: str = "grpo", positive_weight: float = 0.0,
        drop_suppressed: bool = False):
  """Negative sample reinforcement (#82): train on the relative negative gradients only,
  A' = min(A, 0) + λ·max(A, 0) with A the group-relative `base` advantage.

  Reading: "relative negative gradients" = the below-baseline part of GRPO's advantage
  (not the raw −1 of every wrong answer). λ = `positive_weight` = 0 is pure NSR;
  0 < λ < 1 keeps positives down-weighted, W-REINFORCE-style (λ = 0.1); λ = 1 is `base`.
  Returns float32 [..., G, L].
  """
  _check_weight("positive_weight", positive_weight)
  del drop_suppressed
  return split_polarity(base_advantages(rollouts, base, "nsr"), positive_weight, 1.0)


def _wapo_mask(rollouts, adv, *, base="dr_grpo", drop_suppressed=False, **_):
  return _keep_mask(rollouts, base, "wapo", 1.0, 0.0, drop_suppressed)


@register("wapo", loss_mask=_wapo_mask)
def wapo(rollouts: Rollouts, *, base: str = "dr_grpo", drop_suppressed: bool = False):
  """WAPO (#89): update only on the positive-advantage ("winner") completions,
  A' = max(A, 0), with A = R − μ (`base='dr_grpo'`, as the public code).

  The public code pairs it with a one-sided clip (an upper clip only, at 1 + 9) and the
  constant normaliser G·L_max, i.e. `loss.agg='seq-mean-token-sum-norm'`; those are
  loss settings (`loss.eps_high`, `loss.agg`). Returns float32 [..., G, L].
  """
  del drop_suppressed
  return split_polarity(base_advantages(rollouts, base, "wapo"), 1.0, 0.0)


# ----------------------------------------------------------------------------
# CAPO: a hard (or ramped) switch from positive-only to all advantages.


def _step_init(**_):
  return {"step": jnp.zeros((), jnp.int32)}


def _step_update(state, rollouts, **_):
  return {"step": state["step"] + 1}


def _state(rollouts: Rollouts, caller: str):
  if rollouts.credit_state is None:
    raise ValueError(f"{caller} is stateful: it needs rollouts.credit_state "
                     f"(credit.init_state({caller!r}, ...), then credit.update_state).")
  return rollouts.credit_state


def _capo_negative_weight(rollouts, caller, switch_step, ramp_steps):
  if switch_step < 0 or ramp_steps < 0:
    raise ValueError(f"capo needs switch_step >= 0 and ramp_steps >= 0; got "
                     f"{switch_step}, {ramp_steps}.")
  step = _state(rollouts, caller)["step"].astype(jnp.float32)
  if ramp_steps == 0:
    return jnp.where(step >= switch_step, 1.0, 0.0)
  return jnp.clip((step - switch_step) / ramp_steps, 0.0, 1.0)


def _capo_mask(rollouts, adv, *, base="grpo", switch_step=20, ramp_steps=0,
               drop_suppressed=False, **_):
  if not drop_suppressed:
    return rollouts.mask
  w_neg = _capo_negative_weight(rollouts, "capo", switch_step, ramp_steps)
  return _keep_mask(rollouts, base, "capo", 1.0, w_neg, True)


@register("capo", loss_mask=_capo_mask, state=(_step_init, _step_update))
def capo(rollouts: Rollouts, *, base: str = "grpo", switch_step: int = 20,
         ramp_steps: int = 0, drop_suppressed: bool = False):
  """CAPO (#49): imitation then discrimination. A' = max(A, 0) + w₋(n)·min(A, 0), n the
  number of training steps so far (the state, `{'step': int32}`):
  w₋ = 0 for n < `switch_step`, then 1 (`ramp_steps=0`, the paper's hard switch, best
  at 20–30 % of training), or a linear ramp from 0 to 1 over `ramp_steps` steps.

  Reading: "positive-only advantage samples" = negative advantages set to 0 (or, with
  `drop_suppressed`, out of the loss). `switch_step=0` is `base` from the first step.
  Returns float32 [..., G, L].
  """
  del drop_suppressed
  w_neg = _capo_negative_weight(rollouts, "capo", switch_step, ramp_steps)
  return split_polarity(base_advantages(rollouts, base, "capo"), 1.0, w_neg)


# ----------------------------------------------------------------------------
# A-GRAE: asymmetric suppression of positives and an easy-to-hard difficulty focus.


def _pass_rates(rewards):
  """[..., 1]: each group's mean reward read as a pass rate (clipped to [0, 1])."""
  return jnp.clip(jnp.mean(rewards, axis=-1, keepdims=True), 0.0, 1.0)


def _agrae_init(ema_decay=0.9, **_):
  return {"ema": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.int32)}


def _agrae_update(state, rollouts, ema_decay=0.9, **_):
  m = jnp.mean(_pass_rates(jnp.asarray(rollouts.rewards, jnp.float32)))
  return {"ema": ema_decay * state["ema"] + (1.0 - ema_decay) * m, "count": state["count"] + 1}


@register("a_grae", state=(_agrae_init, _agrae_update))
def a_grae(rollouts: Rollouts, *, scale_by_std: bool = True, asymmetry: bool = True,
           difficulty: bool = True, alpha: float = 1.0, progress: str = "batch",
           ema_decay: float = 0.9, eps: float = 1e-6):
  """A-GRAE (#69), as its public code: with A the GRPO advantage, p the group's pass rate
  and m the training progress (mean pass rate of the batch's groups),

    difficulty:  A ← (1 − m)·A/(2(1 − √p + ε)) + m·A/(2(√p + ε))  (easy first, then hard)
    asymmetry:   A ← A·min(1, m/α) where A > 0   (suppress correct trajectories early)

  `progress='batch'`: m from this batch (the public code; the mean over every leading
  dim of the call, so one group's own p under vmap); 'ema': the bias-corrected EMA
  (decay `ema_decay`) of the previous batches' m in the state (this batch's m at the
  first step). Rewards are read as pass rates (p, m clipped to [0, 1]); with `difficulty`
  groups with p = 0 or 1 get 0 (all equal for rewards in [0, 1]; a binary group of one).
  Both options off is GRPO (`scale_by_std=False`: Dr. GRPO). float32 [..., G, L].
  """
  if not alpha > 0:
    raise ValueError(f"a_grae needs alpha > 0; got {alpha}.")
  if progress not in ("batch", "ema"):
    raise ValueError(f"a_grae progress must be 'batch' or 'ema'; got {progress!r}.")
  if not 0.0 <= ema_decay < 1.0:
    raise ValueError(f"a_grae needs 0 <= ema_decay < 1; got {ema_decay}.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  adv = outcome.grpo_per_response(rewards, scale_by_std=scale_by_std, eps=eps)
  p = _pass_rates(rewards)
  m = jnp.mean(p)
  if progress == "ema":
    st = _state(rollouts, "a_grae")
    seen = st["count"] > 0
    debiased = st["ema"] / jnp.where(seen, 1.0 - ema_decay ** st["count"].astype(jnp.float32),
                                     1.0)
    m = jnp.where(seen, debiased, m)
  if difficulty:
    root = jnp.sqrt(p)
    focus = (1.0 - m) * 0.5 * adv / (1.0 - root + eps) + m * 0.5 * adv / (root + eps)
    adv = jnp.where((p > 0) & (p < 1), focus, 0.0)  # p = 0 or 1 would divide by ε
  if asymmetry:
    adv = jnp.where(adv > 0, adv * jnp.minimum(1.0, m / alpha), adv)
  return to_tokens(adv, rollouts.mask)
