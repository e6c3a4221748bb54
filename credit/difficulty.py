"""Difficulty- and pass-rate-conditioned reweighting of outcome advantages.

Difficulty is the group's pass rate: the mean reward, or the fraction of responses with
R > `threshold` where a method counts successes. Cross-step history is estimator state
(`register(state=...)`): HA-DW's anchor is one global pass-rate tracker, as in the paper;
AAPO's reference reward is kept per prompt when prompts recur (a fixed pool,
`Rollouts.prompt_ids`), else globally. Confidence- and entropy-conditioned estimators are
in `credit.confidence`.
"""

import math

import jax
import jax.numpy as jnp

from credit.confidence import check_range, grpo_per_response, response_length
from credit.groups import all_equal, to_tokens
from credit.history import per_prompt_mean, pool_ids
from credit.registry import register
from credit.rollouts import Rollouts


def _success_rate(rewards, threshold):
  """[..., 1]: the fraction of the group with R > threshold."""
  return jnp.mean(rewards > threshold, axis=-1, keepdims=True, dtype=jnp.float32)


@register("mapo")
def mapo(rollouts: Rollouts, mix: float = 1.0, threshold: float = 0.5, eps: float = 1e-6):
  """MAPO (#47, Mixed Advantage Policy Optimization, eqs. 4–6): with p = N/G the group's
  success rate (R > `threshold`) and λ(p) = 1 − 4p(1 − p) its trajectory certainty,

    A_i = (1 − λ)·(R_i − μ)/σ + λ·(R_i − μ)/μ,

  the z-score (GRPO; our σ is Bessel-corrected plus ε, the paper's the population std)
  for uncertain groups and the advantage percent deviation for near-certain ones.
  `mix` scales λ (ours: 0 gives GRPO exactly, 1 is the paper). The percent deviation
  divides by |μ| + ε (the paper has rewards in [0, 1], μ > 0 unless all fail). All-equal
  rewards give exactly 0; a group of one gets GRPO's pass-through.
  """
  check_range("mix", mix, 0.0, 1.0)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  adv = grpo_per_response(rewards, eps=eps)
  if rewards.shape[-1] == 1:
    return to_tokens(adv, rollouts.mask)
  p = _success_rate(rewards, threshold)
  lam = mix * (1.0 - 4.0 * p * (1.0 - p))
  mean = jnp.mean(rewards, axis=-1, keepdims=True)
  apd = jnp.where(all_equal(rewards), 0.0, (rewards - mean) / (jnp.abs(mean) + eps))
  return to_tokens((1.0 - lam) * adv + lam * apd, rollouts.mask)


def _check_window(window):
  if int(window) != window or window < 2:
    raise ValueError(f"window must be an integer >= 2; got {window}.")


def _hadw_init(window: int = 50, **_):
  _check_window(window)
  window = int(window)
  return {"anchor": jnp.zeros((), jnp.float32), "history": jnp.zeros((window,), jnp.float32),
          "count": jnp.zeros((), jnp.int32)}


def _hadw_update(state, rollouts, eta: float = 0.1, **_):
  """The evolving difficulty anchor (§3.1): y = the batch's mean reward; the first batch
  sets C = y; then C ← (1 − η_t)·C + η_t·y with η_t = η·σ_t, σ_t the population std of
  the last `window` anchors (1 while fewer than two), clipped to [0, 1]."""
  history, count = jnp.asarray(state["history"]), jnp.asarray(state["count"])
  window = history.shape[0]
  y = jnp.mean(jnp.asarray(rollouts.rewards, jnp.float32))
  seen = jnp.minimum(count, window)
  valid = jnp.arange(window) < seen
  mean = jnp.sum(jnp.where(valid, history, 0.0)) / jnp.maximum(seen, 1)
  var = jnp.sum(jnp.where(valid, (history - mean) ** 2, 0.0)) / jnp.maximum(seen, 1)
  sigma = jnp.where(seen >= 2, jnp.sqrt(var), 1.0)
  rate = jnp.where(count == 0, 1.0, jnp.clip(eta * sigma, 0.0, 1.0))
  anchor = (1.0 - rate) * state["anchor"] + rate * y
  return {"anchor": anchor, "history": history.at[count % window].set(anchor),
          "count": count + 1}


@register("hadw", state=(_hadw_init, _hadw_update))
def hadw(rollouts: Rollouts, eta: float = 0.1, lambda_scale: float = 1.0, window: int = 50,
         eps: float = 1e-6):
  """HA-DW (#53, History-Aware Adaptive Difficulty Weighting): GRPO times

    Φ_i = λ·exp(−sgn(A_i)·sgn(p̂ − C)·|p̂ − C|),

  p̂ the group's mean reward, C the history-aware difficulty anchor (the state after
  folding in this batch, as in the paper's pseudo-code: `_hadw_update`). Groups easier than
  the anchor (p̂ > C) get smaller positive and larger negative advantages, harder ones the
  reverse. λ = `lambda_scale`; with λ = 1 a group at the anchor (p̂ = C) keeps GRPO's
  advantages exactly. The anchor is one global state (a batch-level pass-rate tracker,
  as in the paper). `rollouts.credit_state` None means the initial state.
  """
  check_range("eta", eta, 0.0, 1.0)
  check_range("lambda_scale", lambda_scale, 0.0, lo_open=True)
  _check_window(window)
  state = rollouts.credit_state if rollouts.credit_state is not None else _hadw_init(window)
  anchor = _hadw_update(state, rollouts, eta)["anchor"]
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  adv = grpo_per_response(rewards, eps=eps)
  diff = jnp.mean(rewards, axis=-1, keepdims=True) - anchor
  phi = lambda_scale * jnp.exp(-jnp.sign(adv) * jnp.sign(diff) * jnp.abs(diff))
  return to_tokens(adv * phi, rollouts.mask)


def _aapo_init(prompts: int = 0, **_):
  shape = (int(prompts),) if prompts else ()
  return {"reference": jnp.zeros(shape, jnp.float32), "count": jnp.zeros(shape, jnp.int32)}


def _aapo_update(state, rollouts, momentum: float = 0.1, **_):
  """EMA (rate `momentum`) of the mean reward: of the batch (a global state), or of each
  prompt's groups in the batch (a state per prompt of a pool); a first visit sets it."""
  state = jax.tree.map(jnp.asarray, state)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  if state["reference"].ndim == 0:
    y, seen = jnp.mean(rewards), True
  else:
    pool = state["reference"].shape[0]
    y, seen = per_prompt_mean(pool_ids(rollouts, pool, "aapo_history"),
                              jnp.mean(rewards, -1), pool)
  rate = jnp.where(state["count"] == 0, 1.0, momentum)
  return {"reference": jnp.where(seen, (1.0 - rate) * state["reference"] + rate * y,
                                 state["reference"]),
          "count": state["count"] + seen}


def _aapo_term(rewards, ref, coef, clip_low, clip_high, eps):
  """GRPO + c·clip(R − b, −clip_low, clip_high), per response [..., G]."""
  return grpo_per_response(rewards, eps=eps) + coef * jnp.clip(rewards - ref, -clip_low,
                                                                clip_high)


def _aapo_checks(coef, clip_low, clip_high):
  check_range("coef", coef, 0.0)
  check_range("clip_low", clip_low, 0.0)
  check_range("clip_high", clip_high, 0.0)


@register("aapo", needs=("ref_rewards",))
def aapo(rollouts: Rollouts, coef: float = 1.0, clip_low: float = 0.2, clip_high: float = 0.28,
         eps: float = 1e-6):
  """AAPO (#48, Advantage-Augmented Policy Optimization): GRPO plus a clipped advantage
  momentum against the reference model,

    A_i = A_i^GRPO + c·clip(R_i − b, −`clip_low`, `clip_high`),

  b the reward of a response the frozen reference model sampled for the same prompt
  (`rollouts.ref_rewards`, one per group), as the public code computes it (clip −0.2 /
  +0.28). The term keeps a signal in groups whose GRPO advantages vanish. c = `coef` (0
  gives GRPO exactly). AAPO's cross-entropy loss (no ratio) is a loss choice, not part of
  this. `aapo_history` is the earlier reading, b from the rewards seen in training.
  """
  _aapo_checks(coef, clip_low, clip_high)
  if rollouts.ref_rewards is None:
    raise ValueError("aapo needs rollouts.ref_rewards: the reward of a response the reference "
                     "model sampled for each prompt (the loop's ReferenceSamples pass).")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  ref = jnp.asarray(rollouts.ref_rewards, jnp.float32)[..., None]
  return to_tokens(_aapo_term(rewards, ref, coef, clip_low, clip_high, eps), rollouts.mask)


@register("aapo_history", state=(_aapo_init, _aapo_update))
def aapo_history(rollouts: Rollouts, coef: float = 1.0, clip_low: float = 0.2,
                 clip_high: float = 0.28, momentum: float = 0.1, eps: float = 1e-6):
  """AAPO (#48) with b tracked over training instead of sampled from the reference model
  (`aapo`): with prompts that recur (a state made for a pool, `credit.init_state(...,
  prompts=N)`; the loop's `rl.prompt_pool`) an EMA (rate `momentum`) of that prompt's mean
  reward at its earlier visits (a first visit uses its own group's mean), else an EMA of the
  batch mean reward before this batch (one global state; the first batch uses its own mean).
  The project's reading before the reference samples were built; no extra sampling.
  """
  _aapo_checks(coef, clip_low, clip_high)
  check_range("momentum", momentum, 0.0, 1.0, lo_open=True)
  state = rollouts.credit_state if rollouts.credit_state is not None else _aapo_init()
  state = jax.tree.map(jnp.asarray, state)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  if state["reference"].ndim == 0:
    ref = jnp.where(state["count"] == 0, jnp.mean(rewards), state["reference"])
  else:
    ids = pool_ids(rollouts, state["reference"].shape[0], "aapo_history")
    ref = jnp.where(state["count"][ids] == 0, jnp.mean(rewards, -1),
                    state["reference"][ids])[..., None]
  return to_tokens(_aapo_term(rewards, ref, coef, clip_low, clip_high, eps), rollouts.mask)


@register("adora")
def adora(rollouts: Rollouts, weight: float = 0.1, favoured_weight: float = 1.0,
          threshold: float = 0.5, truncation_length=None, eps: float = 1e-6):
  """ADORA (#23, Advantage Dynamics via Online Rollout Adaptation), the length criterion
  of the public code: a group is temporarily advantageous when its longest correct
  response (R > `threshold`) is longer than the mean length of its incorrect ones that
  were not truncated (length < `truncation_length`, default L), i.e. correct reasoning is
  getting longer; its GRPO advantages are scaled by `favoured_weight` (1; > 1 is the
  paper's amplification for strong models), the others' by `weight` (0.1, the code's λ).
  Both 1 give GRPO exactly. Empty sets count as −∞ (the verl code): a group without
  correct responses is not favoured, one without incorrect ones is. Stateless: the
  classification is redone every step ("temporarily"); the paper's difficulty criterion
  is not implemented (the abstract does not define it).
  """
  check_range("weight", weight, 0.0)
  check_range("favoured_weight", favoured_weight, 0.0)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  length = response_length(rollouts)
  cap = rollouts.mask.shape[-1] if truncation_length is None else truncation_length
  pos = rewards > threshold
  neg = ~pos & (length < cap)
  max_pos = jnp.max(jnp.where(pos, length, -jnp.inf), axis=-1, keepdims=True)
  n_neg = jnp.sum(neg, axis=-1, keepdims=True)
  mean_neg = jnp.where(n_neg > 0, jnp.sum(jnp.where(neg, length, 0.0), -1, keepdims=True)
                       / jnp.maximum(n_neg, 1), -jnp.inf)
  w = jnp.where(max_pos > mean_neg, favoured_weight, weight)
  return to_tokens(grpo_per_response(rewards, eps=eps) * w, rollouts.mask)


@register("ddca")
def ddca(rollouts: Rollouts, beta: float = 0.2, threshold: float = 0.5, dynamic: bool = True,
         eps: float = 1e-6, length_eps: float = 1e-8):
  """DDCA (#88, Dynamic Decoupled Conditional Advantage; the public code's
  `advantage_dca_grpo`): GRPO on correctness plus a length advantage computed only within
  the correct responses C (R > `threshold`):

    s_i = sigmoid((|o_i| − mean_C |o|)/(std_C |o| + ε)),  A^len_i = −(s_i − mean_C s) on C,
    A_i = A_i^GRPO + β·ρ·A^len_i,  ρ = |C|/G (`dynamic`; 1 without: DCA),

  std_C the population std. Shorter correct responses gain, and less so on hard prompts
  (low pass rate ρ). β = `beta` (0 gives GRPO exactly). Incorrect responses, and groups
  with fewer than two correct ones, get no length term.
  """
  check_range("beta", beta, 0.0)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  length = response_length(rollouts)
  correct = rewards > threshold
  n = jnp.sum(correct, axis=-1, keepdims=True)
  denom = jnp.maximum(n, 1)
  mean = jnp.sum(jnp.where(correct, length, 0.0), -1, keepdims=True) / denom
  std = jnp.sqrt(jnp.sum(jnp.where(correct, (length - mean) ** 2, 0.0), -1, keepdims=True)
                 / denom)
  s = jax.nn.sigmoid((length - mean) / (std + length_eps))
  s_bar = jnp.sum(jnp.where(correct, s, 0.0), -1, keepdims=True) / denom
  a_len = jnp.where(correct, -(s - s_bar), 0.0)
  if dynamic:
    a_len = a_len * n / rewards.shape[-1]
  return to_tokens(grpo_per_response(rewards, eps=eps) + beta * a_len, rollouts.mask)


_OBJECTIVES = ("outcome", "process", "brevity")


@register("dvao", needs=("token_rewards",))
def dvao(rollouts: Rollouts, objectives=("outcome", "process"), weighting: str = "variance",
         eps: float = 1e-6):
  """DVAO (#78, Dynamic Variance-adaptive Advantage Optimization): one GRPO advantage
  A^k per objective k, combined with weights from each objective's within-group reward
  variance, so objectives with a stronger signal count more and constant ones not at all:

    A_i = Σ_k w_k·A^k_i,  w_k = v_k / Σ_j v_j,  v_k = Var_group(r^k)  (Bessel; 'std': σ_k).

  `objectives` (our reading: rollouts carry one outcome reward, so the others are built
  from what they have): 'outcome' R; 'process' Σ_t token_rewards (the per-step verifier
  rewards; needs `token_rewards`); 'brevity' −|o|/L. One objective is GRPO exactly. A group
  where every objective is constant gets 0; a group of one weighs the objectives equally.
  """
  if weighting not in ("variance", "std"):
    raise ValueError(f"weighting must be 'variance' or 'std'; got {weighting!r}.")
  objectives = tuple(objectives)
  if not objectives or any(k not in _OBJECTIVES for k in objectives):
    raise ValueError(f"objectives must be a non-empty subset of {_OBJECTIVES}; got "
                     f"{objectives!r}.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  per_objective = []
  for k in objectives:
    if k == "outcome":
      per_objective.append(rewards)
    elif k == "process":
      if rollouts.token_rewards is None:
        raise ValueError("dvao's 'process' objective needs rollouts.token_rewards.")
      tr = jnp.asarray(rollouts.token_rewards, jnp.float32)
      per_objective.append(jnp.sum(jnp.where(rollouts.mask, tr, 0.0), axis=-1))
    else:
      per_objective.append(-response_length(rollouts) / rollouts.mask.shape[-1])
  advs, scales = [], []
  for r in per_objective:
    advs.append(grpo_per_response(r, eps=eps))
    std = jnp.std(r, axis=-1, ddof=1, keepdims=True) if r.shape[-1] > 1 else jnp.ones_like(r)
    std = jnp.where(all_equal(r), 0.0, std) if r.shape[-1] > 1 else std
    scales.append(std ** 2 if weighting == "variance" else std)
  total = sum(scales)
  safe = jnp.where(total > 0, total, 1.0)
  adv = sum(jnp.where(total > 0, s / safe, 0.0) * a for s, a in zip(scales, advs))
  return to_tokens(adv, rollouts.mask)


@register("copo")
def copo(rollouts: Rollouts, coef: float = 1.0, threshold: float = 0.5, eps: float = 1e-6):
  """COPO (#112, Consistency-aware Policy Optimization), our reading: a local GRPO
  advantage and a global one from outcome consistency, soft-blended by the group's outcome
  entropy:

    A_i = (1 − λ_g)·A_i^GRPO + λ_g·A_g^glob,  λ_g = c·(1 − H(p_g)/ln 2),
    A_g^glob = (μ_g − mean_batch μ)/(std_batch μ + ε),

  μ_g the group's mean reward (the global, consistency reward of every response in it,
  standardised over the groups of the batch: all leading dims; Bessel std), p_g its
  success rate (R > `threshold`), H the binary entropy. A consistent group (all right or
  all wrong, H = 0), where GRPO vanishes, learns from its standing among the batch's
  groups; a split group (p = ½) is pure GRPO. c = `coef` (0 gives GRPO exactly). A batch
  of one group, or of groups with equal μ, has no global term.
  """
  check_range("coef", coef, 0.0, 1.0)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  local = grpo_per_response(rewards, eps=eps)
  mu = jnp.mean(rewards, axis=-1)
  n_groups = math.prod(mu.shape)
  if n_groups > 1:
    std = jnp.std(mu, ddof=1)
    glob = jnp.where(jnp.max(mu) > jnp.min(mu), (mu - jnp.mean(mu)) / (std + eps), 0.0)
  else:
    glob = jnp.zeros_like(mu)
  p = _success_rate(rewards, threshold)
  q = jnp.clip(p, 1e-12, 1.0 - 1e-12)
  h = jnp.where((p > 0) & (p < 1), -(q * jnp.log(q) + (1 - q) * jnp.log(1 - q)), 0.0)
  lam = coef * (1.0 - h / math.log(2.0))
  return to_tokens((1.0 - lam) * local + lam * glob[..., None], rollouts.mask)
