"""Entropy / surprisal token weighting, part 1: STARE (#18), TACO (#38), A3PO (#118) and
Miner (#29) rescale GRPO's advantage token by token.

Every method reads the sampled token's surprisal s_t = −log π_old(y_t)
(`rollouts.sampling_logprobs`) and, where it says so, the sampling policy's next-token
entropy H_t (`rollouts.entropy`, nats). Batch statistics (surprisal quantiles, the batch
entropy, Miner's calibration) are taken over the trained tokens (`trained_mask`) of the
whole call, all leading dims together; under vmap, of each mapped slice. DGPO, UCAS and
DCPO are in `credit.entropy_guided`.
"""

import jax.numpy as jnp

from credit.groups import all_equal
from credit.outcome import grpo
from credit.registry import register
from credit.rollouts import Rollouts


def surprisal(rollouts: Rollouts, name: str):
  """float32 [..., G, L]: −log π_old(y_t); ValueError naming the field if absent."""
  logprobs = rollouts.sampling_logprobs
  if logprobs is None:
    raise ValueError(f"{name} needs rollouts.logprobs (or old_logprobs), the sampled "
                     "tokens' log-probabilities under the sampling policy; got None.")
  return -jnp.asarray(logprobs, jnp.float32)


def entropy(rollouts: Rollouts, name: str):
  """float32 [..., G, L]: the sampling policy's entropy; ValueError naming the field."""
  if rollouts.entropy is None:
    raise ValueError(f"{name} needs rollouts.entropy, the sampling policy's next-token "
                     "entropy at each response position; got None.")
  return jnp.asarray(rollouts.entropy, jnp.float32)


def masked_mean(x, mask):
  """Scalar mean of x over the True entries of mask (whole batch); 0 when there are none."""
  return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def top_fraction(score, candidates, fraction: float):
  """bool like `score`: the candidates in the top `fraction` of all candidates of the batch
  by score, i.e. those with fewer than fraction·n candidates scoring strictly higher
  (n = number of candidates). That is ⌈fraction·n⌉ tokens without ties; every token tied
  at the cut is kept. Scores must be finite."""
  flat = jnp.where(candidates, score, -jnp.inf).ravel()
  higher = flat.size - jnp.searchsorted(jnp.sort(flat), score, side="right")
  return candidates & (higher < fraction * jnp.sum(candidates))


def _check_fraction(name, fraction):
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"{name}: top_ratio must be in [0, 1]; got {fraction}.")


# --- STARE (#18) -----------------------------------------------------------------------

STARE_DEFAULTS = dict(variant="O1", top_ratio=0.1, reweight_pos=1.1, reweight_neg=0.9,
                      target_entropy=0.3, adaptive=False, alpha=0.01, w_max=1.5, m_min=0.5,
                      entropy_ema=0.0)


def _stare_init(*, reweight_pos, reweight_neg, **_):
  """The gate coefficients W, M and the running batch entropy (none seen yet)."""
  return dict(reweight_pos=jnp.float32(reweight_pos), reweight_neg=jnp.float32(reweight_neg),
              entropy=jnp.float32(0.0), seen=jnp.bool_(False))


def _stare_control(state, rollouts, *, target_entropy, adaptive, alpha, w_max, m_min,
                   entropy_ema, **_):
  """(state after this batch, gate): the entropy estimate takes this batch's mean entropy
  (EMA'd with `entropy_ema`); with `adaptive`, W ← clip(W + α·sgn(H_tgt − H), 1, w_max)
  and M ← clip(M − α·sgn(H_tgt − H), m_min, 1). A batch with no trained token leaves the
  state as it was. The gate is on while the estimate is below the target."""
  mask = rollouts.trained_mask
  has = jnp.any(mask)
  batch = masked_mean(entropy(rollouts, "stare"), mask)
  h = jnp.where(state["seen"], entropy_ema * state["entropy"] + (1 - entropy_ema) * batch, batch)
  h = jnp.where(has, h, state["entropy"])
  w, m = state["reweight_pos"], state["reweight_neg"]
  if adaptive:
    sign = jnp.sign(target_entropy - h)
    w = jnp.where(has, jnp.clip(w + alpha * sign, 1.0, w_max), w)
    m = jnp.where(has, jnp.clip(m - alpha * sign, m_min, 1.0), m)
  seen = state["seen"] | has
  new = dict(reweight_pos=jnp.float32(w), reweight_neg=jnp.float32(m),
             entropy=jnp.float32(h), seen=seen)
  return new, seen & (h < target_entropy)


def _stare_update(state, rollouts, **hparams):
  return _stare_control(state, rollouts, **hparams)[0]


@register("stare", needs=("logprobs", "entropy"), state=(_stare_init, _stare_update),
          **STARE_DEFAULTS)
def stare(rollouts: Rollouts, *, variant, top_ratio, reweight_pos, reweight_neg,
          target_entropy, adaptive, alpha, w_max, m_min, entropy_ema):
  """STARE (#18; public code hp-luo/STARE, `compute_stare_token_weights`):
  A_{i,t} = ω_{i,t}·A_i^GRPO.

  L+ = the top-`top_ratio` surprisal tokens among all trained tokens of the batch with
  A > 0, L− the same among A < 0. Variant 'O1': ω = W on L+, else 1; 'C2' also ω = M on L−.
  Closed-loop target-entropy gate (the stateful part, `credit_state`): the weights apply
  only while the batch entropy H̄ (mean of `rollouts.entropy` over trained tokens; an EMA
  over steps with `entropy_ema` > 0, our option) is below `target_entropy`, else ω = 1.
  With `adaptive`, W and M are stepped by ±`alpha` each batch toward more reweighting while
  H̄ < target (paper §4.4), clipped to [1, w_max] and [m_min, 1]; as in the public code, the
  step uses this batch's entropy before the advantages are taken, and `update` returns the
  same state. Without a state (`credit_state` None) the first state is used. The seed
  audit's "1 ± κ·g" reading is replaced by the public code's on/off gate. W = M = 1 (or the
  gate off) gives `grpo` exactly. Ties at the quantile cut are all selected.
  """
  if variant not in ("O1", "C2"):
    raise ValueError(f"stare: variant must be 'O1' or 'C2'; got {variant!r}.")
  _check_fraction("stare", top_ratio)
  if reweight_pos <= 0 or reweight_neg <= 0 or m_min <= 0 or w_max < 1 or m_min > 1:
    raise ValueError("stare: weights must be positive, w_max >= 1 and 0 < m_min <= 1; got "
                     f"W={reweight_pos}, M={reweight_neg}, w_max={w_max}, m_min={m_min}.")
  if alpha < 0 or target_entropy < 0 or not 0 <= entropy_ema < 1:
    raise ValueError("stare: needs alpha >= 0, target_entropy >= 0, 0 <= entropy_ema < 1; "
                     f"got {alpha}, {target_entropy}, {entropy_ema}.")
  hparams = dict(target_entropy=target_entropy, adaptive=adaptive, alpha=alpha, w_max=w_max,
                 m_min=m_min, entropy_ema=entropy_ema)
  state = rollouts.credit_state
  if state is None:
    state = _stare_init(reweight_pos=reweight_pos, reweight_neg=reweight_neg)
  new, gate = _stare_control(state, rollouts, **hparams)
  w, m = (new["reweight_pos"], new["reweight_neg"]) if adaptive else (reweight_pos, reweight_neg)
  s = surprisal(rollouts, "stare")
  base = grpo(rollouts)
  tok = rollouts.trained_mask
  weight = jnp.where(top_fraction(s, tok & (base > 0), top_ratio), w, 1.0)
  if variant == "C2":
    weight = jnp.where(top_fraction(s, tok & (base < 0), top_ratio), m, weight)
  return base * jnp.where(gate, weight, 1.0)


# --- TACO (#38) ------------------------------------------------------------------------


@register("taco", needs=("logprobs", "entropy"))
def taco(rollouts: Rollouts, *, alpha: float = 0.01, lam: float = 0.9):
  """TACO tail-aware credit calibration (#38; public code xiuyilou/TACO,
  `compute_taco_token_advantages`): tail risk r_t = s_t − H_t + log α (how much rarer the
  token is than the distribution's typical token, past a margin −log α); tokens with
  r_t > 0 get ω_t = 1 − λ(1 − e^{−r_t}) ∈ (1 − λ, 1), others 1; only positive advantages
  are scaled: A_{i,t} = ω_t·A_i where A_i^GRPO > 0, A_i elsewhere. λ = 0 is `grpo` exactly.
  """
  if alpha <= 0:
    raise ValueError(f"taco: alpha must be > 0; got {alpha}.")
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f"taco: lam must be in [0, 1]; got {lam}.")
  risk = surprisal(rollouts, "taco") - entropy(rollouts, "taco") + jnp.log(alpha)
  weight = jnp.where(risk > 0, 1.0 - lam * (1.0 - jnp.exp(-jnp.maximum(risk, 0.0))), 1.0)
  base = grpo(rollouts)
  return jnp.where(base > 0, weight * base, base)


# --- A3PO (#118, vague) ----------------------------------------------------------------

A3PO_DEFAULTS = dict(top_ratio=0.2, pos_scale=0.5, neg_scale=0.5, decay_steps=100)


def _a3po_init(**_):
  return dict(step=jnp.zeros((), jnp.int32))


def _a3po_update(state, rollouts, **_):
  return dict(step=state["step"] + 1)


@register("a3po", needs=("logprobs",), state=(_a3po_init, _a3po_update), **A3PO_DEFAULTS)
def a3po(rollouts: Rollouts, *, top_ratio, pos_scale, neg_scale, decay_steps):
  """A3PO (#118; the abstract is vague, this is our reading of it and of the paper's
  summary: asymmetric by polarity, token-level, adaptive over training):
  A_{i,t} = (1 + κ_±·d_k)·A_i^GRPO on selected tokens, A_i elsewhere.

  Positive samples (A > 0): the top-`top_ratio` surprisal tokens among all positive-sample
  trained tokens of the batch (the low-probability ones) get κ+ = `pos_scale`. Negative
  samples (A < 0): the lowest-`top_ratio` surprisal tokens (the high-probability ones) get
  κ− = `neg_scale`. "Adaptive" is read as a schedule: d_k = max(0, 1 − k/`decay_steps`) at
  training step k (the state, a step counter; `decay_steps=0` keeps d = 1). κ± = 0, or
  k >= decay_steps, is `grpo` exactly. Ties at the cut are all selected.
  """
  _check_fraction("a3po", top_ratio)
  if pos_scale < 0 or neg_scale < 0 or decay_steps < 0:
    raise ValueError("a3po: pos_scale, neg_scale and decay_steps must be >= 0; got "
                     f"{pos_scale}, {neg_scale}, {decay_steps}.")
  state = rollouts.credit_state if rollouts.credit_state is not None else _a3po_init()
  decay = 1.0
  if decay_steps > 0:
    decay = jnp.maximum(0.0, 1.0 - state["step"].astype(jnp.float32) / decay_steps)
  s = surprisal(rollouts, "a3po")
  base = grpo(rollouts)
  tok = rollouts.trained_mask
  rare_pos = top_fraction(s, tok & (base > 0), top_ratio)
  likely_neg = top_fraction(-s, tok & (base < 0), top_ratio)
  weight = jnp.where(rare_pos, 1.0 + pos_scale * decay,
                     jnp.where(likely_neg, 1.0 + neg_scale * decay, 1.0))
  return base * weight


# --- Miner (#29) -----------------------------------------------------------------------


@register("miner", needs=("logprobs",))
def miner(rollouts: Rollouts, *, gamma: float = 2.0, correct_scale: float = 1.0,
          incorrect_scale: float = 0.0, calibration: float = 0.0015,
          mastered_above: float = 0.0, eps: float = 1e-6):
  """Miner (#29; public code pixas/Miner, `compute_ent_inc_advantage`, README recipe):
  GRPO, plus intrinsic credit on groups whose rewards are all equal (GRPO gives them 0).

  ℓ_i = mean_t log π_old(y_{i,t}) over i's trained tokens; ℓ̄ its group mean (over
  non-empty responses). Positive homogeneous groups (all R > `mastered_above`) reward the
  less likely responses: u_i = `correct_scale`·max(0, ℓ̄ − ℓ_i); negative homogeneous ones
  u_i = `incorrect_scale`·min(0, ℓ̄ − ℓ_i) (0 by default, as in the recipe). Focal token
  credit: A_{i,t} = u_i·(1 − π_old(y_{i,t}))^γ (amplifies uncertain tokens). Adaptive
  calibration (`calibration` = c > 0): the intrinsic credit is scaled by
  min(1, c·Σ|A^GRPO| / Σ|intrinsic|) over the whole batch, so a batch with no GRPO signal
  gets none (as in the public code). A group of one is GRPO. `correct_scale =
  incorrect_scale = 0` is `grpo` exactly. The public code's clip_high/clip_low and
  entropy-scheduled α are left out (off in its recipe).
  """
  if gamma < 0 or correct_scale < 0 or incorrect_scale < 0 or calibration < 0:
    raise ValueError("miner: gamma, correct_scale, incorrect_scale and calibration must be "
                     f">= 0; got {gamma}, {correct_scale}, {incorrect_scale}, {calibration}.")
  logp = -surprisal(rollouts, "miner")
  base = grpo(rollouts, eps=eps)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  if rewards.shape[-1] == 1:
    return base
  tok = rollouts.trained_mask
  n = jnp.sum(tok, axis=-1)
  seq = jnp.sum(jnp.where(tok, logp, 0.0), axis=-1) / jnp.maximum(n, 1)
  nonempty = n > 0
  mean = (jnp.sum(jnp.where(nonempty, seq, 0.0), axis=-1, keepdims=True)
          / jnp.maximum(jnp.sum(nonempty, axis=-1, keepdims=True), 1))
  homogeneous = all_equal(rewards)
  mastered = homogeneous & (rewards[..., :1] > mastered_above)
  u = jnp.where(mastered, correct_scale * jnp.maximum(0.0, mean - seq),
                jnp.where(homogeneous, incorrect_scale * jnp.minimum(0.0, mean - seq), 0.0))
  focal = jnp.maximum(-jnp.expm1(logp), 0.0) ** gamma  # (1 − p)^γ
  extra = jnp.where(tok, u[..., None] * focal, 0.0)
  if calibration > 0:
    total = jnp.sum(jnp.abs(extra))
    ratio = calibration * jnp.sum(jnp.abs(base)) / jnp.where(total > 0, total, 1.0)
    extra = extra * jnp.minimum(1.0, ratio)
  return base + extra
