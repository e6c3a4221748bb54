"""Confidence-, entropy- and metric-conditioned reweighting of outcome advantages.

Per-response signals (float32 [..., G]; 0 for a response with no unmasked token):
response confidence = mean (or sum) of the sampled tokens' log-probs under the sampling
policy (`rollouts.sampling_logprobs`) over `mask`; response entropy = mean of
`rollouts.entropy` over `mask`; length = number of unmasked tokens. The estimators
here are GRPO (or Dr. GRPO) plus a term or weight built from them; the difficulty-
(pass-rate-) conditioned ones are in `credit.difficulty`.
"""

import jax
import jax.numpy as jnp

from credit.groups import all_equal, to_tokens
from credit.history import pool_ids
from credit.outcome import grpo_per_response  # noqa: F401  (also used by credit.difficulty)
from credit.registry import register
from credit.rollouts import Rollouts


def check_range(name: str, value, lo=None, hi=None, lo_open=False):
  """Raises ValueError unless lo <= value <= hi (lo < value with `lo_open`)."""
  if lo is not None and (value < lo or (lo_open and value == lo)):
    raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}; got {value}.")
  if hi is not None and value > hi:
    raise ValueError(f"{name} must be <= {hi}; got {value}.")


def masked_mean(x, mask, axis=-1):
  """Mean of x over the True entries of mask along `axis` (0 where there are none)."""
  n = jnp.sum(mask, axis=axis)
  return jnp.sum(jnp.where(mask, x, 0.0), axis=axis) / jnp.maximum(n, 1)


def response_length(rollouts: Rollouts):
  """float32 [..., G]: the number of unmasked tokens of each response."""
  return jnp.sum(rollouts.mask, axis=-1).astype(jnp.float32)


def response_confidence(rollouts: Rollouts, reduce: str = "mean", name: str = "estimator"):
  """float32 [..., G]: mean (`reduce='mean'`) or sum of log π_old(y_t) over the unmasked
  tokens (`old_logprobs`, else `logprobs`); 0 for an empty response."""
  if reduce not in ("mean", "sum"):
    raise ValueError(f"reduce must be 'mean' or 'sum'; got {reduce!r}.")
  lp = rollouts.sampling_logprobs
  if lp is None:
    raise ValueError(f"{name} needs rollouts.logprobs (or old_logprobs): the sampled tokens' "
                     "log-probs give the response confidence.")
  lp = jnp.asarray(lp, jnp.float32)
  if reduce == "sum":
    return jnp.sum(jnp.where(rollouts.mask, lp, 0.0), axis=-1)
  return masked_mean(lp, rollouts.mask)


def response_entropy(rollouts: Rollouts, name: str = "estimator"):
  """float32 [..., G]: mean of `rollouts.entropy` over the unmasked tokens (0 if none)."""
  if rollouts.entropy is None:
    raise ValueError(f"{name} needs rollouts.entropy (the sampling policy's next-token "
                     "entropy at each response position).")
  return masked_mean(jnp.asarray(rollouts.entropy, jnp.float32), rollouts.mask)


def _zscore(x, tol: float = 1e-4):
  """(x − mean)/std over the group axis (population std); 0 for a group of one and for a
  group whose values differ by no more than tol·max(1, |x|) (rounding, which a z-score
  would blow up to ±1)."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  std = jnp.std(x, axis=-1, keepdims=True)
  spread = jnp.max(x, -1, keepdims=True) - jnp.min(x, -1, keepdims=True)
  varies = spread > tol * jnp.maximum(1.0, jnp.max(jnp.abs(x), -1, keepdims=True))
  return jnp.where(varies, (x - mean) / jnp.where(varies, std, 1.0), 0.0)


def _metric(rollouts, metric, name):
  if metric == "entropy":
    return response_entropy(rollouts, name)
  if metric == "length":
    return response_length(rollouts)
  if metric == "confidence":
    return response_confidence(rollouts, "mean", name)
  raise ValueError(f"unknown {name} metric {metric!r}; choose 'entropy', 'length' or "
                   "'confidence'.")


@register("canon", needs=("entropy",))
@register("canon_length", metric="length")
def canon(rollouts: Rollouts, metric: str = "entropy", mu: float = 1.0):
  """CANON (#58, Conditional advANtage estimatiON): the group is sorted by a metric and
  split into a low half C⁻ (the ⌊G/2⌋ smallest; ties by index) and a high half C⁺; with
  m⁻, m⁺ their mean rewards (eq. 5 of the public code, its α = 1):

    i ∈ C⁺: A_i = μ·(R_i − m⁻) + (1 − μ)·(R_i − m⁺)
    i ∈ C⁻: A_i = μ·(R_i − m⁺) + (1 − μ)·(R_i − m⁻)

  μ = `mu` = 1 (the code's default) is the inter-group comparison alone (which metric
  trend pays), μ = 0 the intra-group one; μ = ½ with G even is Dr. GRPO (`dr_grpo`, up to
  float rounding). `metric`: 'entropy' (mean token entropy, `canon`, needs `entropy`),
  'length' (`canon_length`) or 'confidence' (mean log-prob, needs `logprobs`). No division
  by a std (the code's Dr. GRPO base; its constant 1/max_length belongs to the loss).
  All-equal rewards give exactly 0; a group of one gets R (Dr. GRPO's pass-through).
  """
  check_range("mu", mu, 0.0, 1.0)
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  g = rewards.shape[-1]
  value = _metric(rollouts, metric, "canon")
  if g == 1:
    return to_tokens(grpo_per_response(rewards, scale_by_std=False), rollouts.mask)
  rank = jnp.argsort(jnp.argsort(value, axis=-1, stable=True), axis=-1)
  high = rank >= g // 2
  m_hi = jnp.sum(jnp.where(high, rewards, 0.0), -1, keepdims=True) / (g - g // 2)
  m_lo = jnp.sum(jnp.where(high, 0.0, rewards), -1, keepdims=True) / (g // 2)
  other, own = jnp.where(high, m_lo, m_hi), jnp.where(high, m_hi, m_lo)
  adv = mu * (rewards - other) + (1.0 - mu) * (rewards - own)
  return to_tokens(jnp.where(all_equal(rewards), 0.0, adv), rollouts.mask)


def _gepo_init(**_):
  return {"count": jnp.zeros((), jnp.int32), "mean": jnp.zeros((), jnp.float32),
          "sq": jnp.zeros((), jnp.float32)}


def _group_entropy(rollouts):
  """([...] group entropy: mean response entropy over the non-empty responses,
  [...] whether the group has any token)."""
  h = response_entropy(rollouts, "gepo")
  nonempty = jnp.any(rollouts.mask, axis=-1)
  return masked_mean(h, nonempty), jnp.any(nonempty, axis=-1)


def _gepo_update(state, rollouts, momentum: float = 0.1, **_):
  """EMA (rate `momentum`) of the batch mean of the group entropies and of their squares;
  the first batch (count 0) sets them; a batch with no tokens leaves the state as it is."""
  state = jax.tree.map(jnp.asarray, state)
  h, has = _group_entropy(rollouts)
  n = jnp.sum(has)
  mean = jnp.sum(jnp.where(has, h, 0.0)) / jnp.maximum(n, 1)
  sq = jnp.sum(jnp.where(has, h * h, 0.0)) / jnp.maximum(n, 1)
  rate = jnp.where(state["count"] == 0, 1.0, momentum)
  new = {"count": state["count"] + 1, "mean": (1 - rate) * state["mean"] + rate * mean,
         "sq": (1 - rate) * state["sq"] + rate * sq}
  return jax.tree.map(lambda a, b: jnp.where(n > 0, a, b), new, state)


@register("gepo", needs=("entropy",), state=(_gepo_init, _gepo_update))
def gepo(rollouts: Rollouts, attenuation: float = 0.5, kappa: float = 0.5,
         momentum: float = 0.1, eps: float = 1e-6):
  """GEPO (#85, Group Entropy-controlled Policy Optimization): GRPO with entropy-conditioned
  asymmetric shaping. The group entropy H_g is the mean response entropy of the group;
  with m, s the history's mean and std of H_g, thresholds are h_lo = m − κ·s, h_hi = m + κ·s:

    H_g < h_lo (low-entropy group):  positive advantages × (1 − β)  (less over-exploitation)
    H_g > h_hi (high-entropy group): negative advantages × (1 − β)  (keeps exploration)

  β = `attenuation` (0 gives GRPO exactly), κ = `kappa`. Our reading of "adaptive
  thresholds from historical entropy statistics": the state carries EMAs (rate `momentum`)
  of the batch mean of H_g and of H_g² over steps — one global history, as the statistics
  are of the policy's entropy, not of a prompt — and the thresholds use the state after
  folding in this batch (so the
  first batch uses its own statistics). The hard thresholds and the defaults are ours.
  `rollouts.credit_state` None means the initial state. Needs `entropy`.
  """
  check_range("attenuation", attenuation, 0.0, 1.0)
  check_range("kappa", kappa, 0.0)
  check_range("momentum", momentum, 0.0, 1.0, lo_open=True)
  state = rollouts.credit_state if rollouts.credit_state is not None else _gepo_init()
  post = _gepo_update(state, rollouts, momentum)
  std = jnp.sqrt(jnp.maximum(post["sq"] - post["mean"] ** 2, 0.0))
  h = _group_entropy(rollouts)[0][..., None]
  adv = grpo_per_response(rollouts.rewards, eps=eps)
  low = (h < post["mean"] - kappa * std) & (adv > 0)
  high = (h > post["mean"] + kappa * std) & (adv < 0)
  return to_tokens(jnp.where(low | high, (1.0 - attenuation) * adv, adv), rollouts.mask)


def _low_prob_mean(lp, mask, frac):
  """Mean of the ⌈frac·n⌉ smallest log-probs of each row (n its unmasked tokens)."""
  n = jnp.sum(mask, axis=-1, keepdims=True)
  k = jnp.ceil(frac * n * (1.0 - 1e-6))  # float32 rounding of an exact integer stays below it
  rank = jnp.argsort(jnp.argsort(jnp.where(mask, lp, jnp.inf), axis=-1, stable=True), axis=-1)
  return masked_mean(lp, mask & (rank < k))


@register("progrpo", needs=("logprobs", "prompt_logprobs"))
def progrpo(rollouts: Rollouts, alpha: float = 0.1, threshold: float = 0.5,
            correct_only: bool = False, low_frac=None, eps: float = 1e-6):
  """ProGRPO / ARM (#113, Advantage Re-weighting Mechanism):

    Ã_i = A_i + α·(c(q) − c(o_i|q))  in groups with a correct response (R > `threshold`),
    Ã_i = A_i                         in groups without one,

  A_i GRPO, c(q) the prompt's confidence (mean of `rollouts.prompt_logprobs` over
  `rollouts.prompt_mask`, i.e. minus log prompt perplexity), c(o_i|q) the response confidence
  (mean sampled-token log-prob; `low_frac` = f averages only the ⌈f·n⌉ least likely tokens,
  the paper's low-probability length normalisation). An over-confident response
  (c(o|q) > c(q)) gets less credit. α = `alpha` (0 gives GRPO exactly; the default is
  ours); `correct_only` restricts the term to correct responses (the abstract's "across
  correct responses"; the paper's formula applies it to the whole group). Without a
  `prompt_mask` a prompt log-prob of exactly 0 counts as padding. Needs `logprobs` and
  `prompt_logprobs` [..., P].
  """
  check_range("alpha", alpha, 0.0)
  if low_frac is not None:
    check_range("low_frac", low_frac, 0.0, 1.0, lo_open=True)
  if rollouts.prompt_logprobs is None:
    raise ValueError("progrpo needs rollouts.prompt_logprobs [..., P] (the prompt tokens' "
                     "log-probs under the policy).")
  conf = response_confidence(rollouts, "mean", "progrpo")
  if low_frac is not None:
    conf = _low_prob_mean(jnp.asarray(rollouts.sampling_logprobs, jnp.float32),
                          rollouts.mask, low_frac)
  plp = jnp.asarray(rollouts.prompt_logprobs, jnp.float32)
  if plp.shape[:-1] != rollouts.rewards.shape[:-1]:
    raise ValueError(f"prompt_logprobs must be [..., P] with leading dims "
                     f"{rollouts.rewards.shape[:-1]}; got {plp.shape}.")
  pmask = plp != 0 if rollouts.prompt_mask is None else jnp.asarray(rollouts.prompt_mask, bool)
  if pmask.shape != plp.shape:
    raise ValueError(f"prompt_mask must have prompt_logprobs' shape {plp.shape}; got "
                     f"{pmask.shape}.")
  prompt_conf = masked_mean(plp, pmask)[..., None]
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  correct = rewards > threshold
  on = jnp.any(correct, axis=-1, keepdims=True)
  if correct_only:
    on = on & correct
  adv = grpo_per_response(rewards, eps=eps)
  return to_tokens(jnp.where(on, adv + alpha * (prompt_conf - conf), adv), rollouts.mask)


def prefix_effective_rank(tokens, mask, buckets: int):
  """float32 [..., G, L]: effective rank exp(H(σ/Σσ)) of each prefix's token matrix, each
  token a one-hot row over `buckets` hashed ids (token mod buckets). Its singular values are
  √(count) per bucket, so ER_t = exp(entropy of √c_t/Σ√c_t); 0 on masked positions."""
  onehot = jax.nn.one_hot(jnp.asarray(tokens) % buckets, buckets, dtype=jnp.float32)
  counts = jnp.cumsum(onehot * mask[..., None], axis=-2)
  root = jnp.sqrt(counts)
  p = root / jnp.maximum(jnp.sum(root, -1, keepdims=True), 1e-30)
  ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.where(mask, jnp.exp(ent), 0.0)


def prefix_effective_rank_hidden(hidden, mask):
  """float32 [..., G, L]: effective rank exp(H(σ/Σσ)) of each prefix's matrix of hidden
  states (rows h_1..h_t, `hidden` [..., G, L, D]; σ its singular values, zero rows add
  none); 0 on masked positions and for an all-zero prefix. L singular value decompositions
  of L × D a row: for responses of tens to hundreds of tokens, not thousands."""
  h = jnp.where(mask[..., None], jnp.asarray(hidden, jnp.float32), 0.0)
  l = mask.shape[-1]
  upto = jnp.arange(l)[:, None] >= jnp.arange(l)[None, :]  # [t, i]: row i in prefix t
  sv = jnp.linalg.svd(jnp.where(upto[:, :, None], h[..., None, :, :], 0.0),
                      compute_uv=False)  # [..., L(t), min(L, D)]
  p = sv / jnp.maximum(jnp.sum(sv, -1, keepdims=True), 1e-30)
  ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.where(mask & (jnp.sum(sv, -1) > 0), jnp.exp(ent), 0.0)


def _verl(rollouts: Rollouts, er, beta: float, eps: float):
  """VERL's advantage from the prefix effective ranks er [..., G, L] (`verl_rank`)."""
  mask = rollouts.mask
  n = jnp.sum(mask, axis=-1)
  final = jnp.take_along_axis(er, jnp.maximum(n - 1, 0)[..., None], axis=-1)[..., 0]
  vel = er[..., 1:] - er[..., :-1]
  acc = vel[..., 1:] - vel[..., :-1]
  erv = masked_mean(vel, mask[..., 1:])
  era = masked_mean(acc, mask[..., 2:])
  gate = jax.nn.sigmoid(_zscore(era))
  phi = gate * _zscore(final) + (1.0 - gate) * _zscore(erv)
  adv = grpo_per_response(rollouts.rewards, eps=eps)
  return to_tokens(adv + beta * jnp.tanh(phi), mask)


@register("verl_rank", needs=("hidden_states",))
def verl_rank(rollouts: Rollouts, beta: float = 0.1, eps: float = 1e-6):
  """VERL (#108, Velocity-Exploiting Rank-Learning), our reading of a vague abstract: the
  effective rank ER of a response's hidden states measures exploration, its velocity
  ERV and acceleration ERA (first and second differences along the response) exploitation
  dynamics, and ERA gates a dual-channel bonus:

    Φ_i = g_i·z(ER_i) + (1 − g_i)·z(ERV_i),  g_i = sigmoid(z(ERA_i)),
    A_i = A_i^GRPO + β·tanh(Φ_i)

  with z a within-group z-score, ER_i the full response's ER, ERV_i and ERA_i the means of
  the differences of the prefix ERs (`prefix_effective_rank_hidden` of
  `rollouts.hidden_states`: the policy's final hidden state at each response position, the
  one predicting the token). β = `beta` (0 gives GRPO exactly); the gate and tanh bound are
  ours. Empty responses get A^GRPO (0 tokens). `verl_rank_tokens`: the same on token
  one-hots.
  """
  check_range("beta", beta, 0.0)
  if rollouts.hidden_states is None:
    raise ValueError("verl_rank needs rollouts.hidden_states: the policy's final hidden state "
                     "at each response position (the loop's HiddenStates pass).")
  er = prefix_effective_rank_hidden(rollouts.hidden_states, rollouts.mask)
  return _verl(rollouts, er, beta, eps)


@register("verl_rank_tokens")
def verl_rank_tokens(rollouts: Rollouts, beta: float = 0.1, buckets: int = 64,
                     eps: float = 1e-6):
  """`verl_rank` (#108) with each token's one-hot over `buckets` hashed ids as its
  representation instead of a hidden state (`prefix_effective_rank`, exact for vocabularies
  up to `buckets`): a token-count statistic, the project's reading before hidden states
  reached the estimators; no extra forward pass."""
  check_range("beta", beta, 0.0)
  _check_buckets(buckets)
  return _verl(rollouts, prefix_effective_rank(rollouts.tokens, rollouts.mask, int(buckets)),
               beta, eps)


def _outcome(tokens, mask, answer_tokens):
  """(keep, tokens) [..., G, A]: a response's outcome — its last `answer_tokens` tokens
  (right-aligned, keep False before the response's start; None: the whole response)."""
  tokens = jnp.asarray(tokens)
  if answer_tokens is None:
    return mask, tokens
  n = jnp.sum(mask, axis=-1, keepdims=True)
  idx = n - answer_tokens + jnp.arange(answer_tokens)
  return idx >= 0, jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[-1] - 1), axis=-1)


def _same_outcome(tokens, mask, answer_tokens):
  """bool [..., G, G]: responses i and j have the same outcome (`_outcome`)."""
  keep, tok = _outcome(tokens, mask, answer_tokens)
  ki, kj = keep[..., :, None, :], keep[..., None, :, :]
  ti, tj = tok[..., :, None, :], tok[..., None, :, :]
  return jnp.all((ki == kj) & (~ki | (ti == tj)), axis=-1)


def _outcome_bucket(tokens, mask, answer_tokens, buckets: int):
  """int32 [..., G]: each response's outcome hashed into `buckets` counters (a multiplicative
  hash of the kept tokens and their positions; outcomes that collide share a counter)."""
  keep, tok = _outcome(tokens, mask, answer_tokens)
  mult = jnp.cumprod(jnp.full(tok.shape[-1], 2654435761, jnp.uint32))  # wraps mod 2^32
  h = jnp.sum(jnp.where(keep, (tok.astype(jnp.uint32) + 1) * mult, 0), -1, dtype=jnp.uint32)
  h = h ^ (h >> 15)
  return (h % jnp.uint32(buckets)).astype(jnp.int32)


def _explore_init(prompts: int = 0, buckets: int = 64, **_):
  """Per-prompt outcome counts [prompts, buckets], or None (fresh prompts: no history)."""
  _check_buckets(buckets)
  return ({"outcome_counts": jnp.zeros((int(prompts), int(buckets)), jnp.float32)}
          if prompts else None)


def _explore_update(state, rollouts, answer_tokens=None, **_):
  """Each response's outcome counted once for its prompt."""
  if state is None:
    return None
  counts = jnp.asarray(state["outcome_counts"])
  pool, buckets = counts.shape
  ids = pool_ids(rollouts, pool, "outcome_explore")
  b = _outcome_bucket(rollouts.tokens, rollouts.mask, answer_tokens, buckets)
  rows = jnp.broadcast_to(ids[..., None], b.shape)
  return {"outcome_counts": counts.at[rows.ravel(), b.ravel()].add(1.0)}


def _check_buckets(buckets):
  if int(buckets) != buckets or buckets < 1:
    raise ValueError(f"buckets must be a positive integer; got {buckets}.")


@register("outcome_explore", state=(_explore_init, _explore_update))
def outcome_explore(rollouts: Rollouts, coef: float = 0.1, answer_tokens=None,
                    ucb_coef: float = 0.1, buckets: int = 64, eps: float = 1e-6):
  """Outcome-based exploration (#125): batch exploration, a response whose final outcome
  is repeated within its group is penalised, and historical exploration, a UCB-style bonus
  for outcomes its prompt has rarely produced, both before GRPO:

    R̃_i = R_i − c·(n_i − 1)/(G − 1) + c_h/√(1 + N(x, o_i)),  A = GRPO(R̃),

  n_i the number of the group's responses (itself included) with the same outcome o_i,
  N(x, o) the times prompt x produced outcome o at earlier steps, c = `coef`, c_h =
  `ucb_coef` (both 0 give GRPO exactly; the defaults and the 1 + N are ours). The outcome
  is the response's last `answer_tokens` tokens (where the answer is, e.g. the sum in
  scratch_add), or the whole response (None). The historical term needs prompts that
  recur: a state made for a pool (`credit.init_state(..., prompts=N)`; the loop's
  `rl.prompt_pool`) counts outcomes per prompt, hashed into `buckets` counters; without
  one (prompts drawn fresh, `credit_state` None) only the batch term applies. A group of
  one gets no batch term.
  """
  check_range("coef", coef, 0.0)
  check_range("ucb_coef", ucb_coef, 0.0)
  _check_buckets(buckets)
  if answer_tokens is not None and (int(answer_tokens) != answer_tokens or answer_tokens < 1):
    raise ValueError(f"answer_tokens must be a positive integer or None; got {answer_tokens}.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  g = rewards.shape[-1]
  if g > 1:
    same = _same_outcome(rollouts.tokens, rollouts.mask, answer_tokens)
    repeats = jnp.sum(same, axis=-1).astype(jnp.float32) - 1.0
    rewards = rewards - coef * repeats / (g - 1)
  if rollouts.credit_state is not None:
    counts = jnp.asarray(rollouts.credit_state["outcome_counts"])
    ids = pool_ids(rollouts, counts.shape[0], "outcome_explore")
    b = _outcome_bucket(rollouts.tokens, rollouts.mask, answer_tokens, counts.shape[1])
    seen = jnp.take_along_axis(counts[ids], b, axis=-1)
    rewards = rewards + ucb_coef / jnp.sqrt(1.0 + seen)
  return to_tokens(grpo_per_response(rewards, eps=eps), rollouts.mask)
