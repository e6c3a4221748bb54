"""Pure-functional policy-gradient and supervised update steps, and the device mesh.

    state = init_state(params, make_optimizer(lr=3e-4, warmup_steps=10))
    state, metrics = train_step(state, batch, cfg=policy_cfg, loss_cfg=LossConfig())

`TrainState` is a pytree (params, opt_state, step, rng) with the optax
transformation as a static field, so `train_step` / `sft_step` are plain
jittable functions of (state, batch). `make_optimizer` is memoised on its
hyper-parameters: two states built with the same settings share one `tx`
object and therefore one compiled program.

Batch layout (`Batch`): N = B * G responses as rows, flattened by the caller
(`batch_from_samples`): prompts [N, P], tokens / mask / advantages /
old_logprobs / ref_logprobs [N, L]. Advantages come from `credit` outside the step.

Loss aggregation (`LossConfig.agg`). Every mode is a weighted *sum* of per-token
losses l[n, t] with weights w[n, t] that are 0 on masked tokens and whose
normalisers are counted over the whole optimizer minibatch (all micro-batches
and all data-parallel shards together), so the loss of a minibatch is

    loss = sum_{n, t} w[n, t] * l[n, t]

and splitting the minibatch into micro-batches (summing their losses and
gradients) or sharding it over devices gives the same number. With M valid
tokens, S sequences, len_n valid tokens in row n and L_max = response length:

  token-mean               w = mask / M                 (mean over all tokens)
  seq-mean-token-mean      w = mask / (S * len_n)       (mean per sequence, then over sequences)
  seq-mean-token-sum       w = mask / S                 (sum per sequence, mean over sequences)
  seq-mean-token-sum-norm  w = mask / (S * L_max)       (Dr. GRPO: constant normaliser)

Sequences with len_n = 0 get weight 0 and still count in S (they are rows of the batch).

Policy loss (per token, r = exp(logp - old_logp), A the advantage), `LossConfig.policy_loss`:
  'clip' (default):
  pg = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)        (clip-higher when eps_high > eps_low)
  pg = min(pg, -dual_clip * A) where A < 0                       (dual-clip, Ye et al. 2020; off if 0)
  'rgra' (#61, REINFORCE with group-relative advantages: no ratio, no clip):
  pg = -A logp
  'apa' (#66, squared error to the advantage-induced target pi_anchor exp(A / lam)):
  pg = (lam / 2) (logp - anchor_logp - A / lam)^2,  lam = apa_coef, anchor = ref or old
  (lam / 2 times the paper's loss: the same minimiser, and gradient -A at logp = anchor)
  'em' (#156, EM with preferred (A > 0) and dis-preferred (A < 0) samples, alpha = em_alpha):
  pg = -(alpha [A > 0] - (1 - alpha) [A < 0]) logp   (the dis-preferred term is unbounded
  below: the paper pairs it with a KL to the reference, so alpha < 1 needs kl_coef > 0;
  with k3 a dis-preferred token's loss is least at logp = ref - log(1 + (1 - alpha) / kl_coef))
  l  = pg + kl_coef * KL_k(logp, ref_logp) - entropy_coef * H
KL in the loss needs `ref_logprobs`; `kl_in_reward` (the loop's job) instead
subtracts kl_coef * sum_t k1(old, ref) from each response's reward before credit.
"""

import dataclasses
import functools
import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import credit
from experiments.models import decoder
from trees import packing as packing_lib

AGG_MODES = ('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm')
POLICY_LOSSES = ('clip', 'rgra', 'apa', 'em')
APA_ANCHORS = ('ref', 'old')


@struct.dataclass
class TrainState:
  params: object
  opt_state: object
  step: jax.Array   # int32, optimizer updates so far
  rng: jax.Array    # uint32 [2] raw PRNG key (checkpointable)
  tx: optax.GradientTransformation = struct.field(pytree_node=False)


@struct.dataclass
class Batch:
  """Rows = responses. prompts [N, P]; the rest [N, L]. ref_logprobs may be None.

  `prompt_len` [N] int32 gives true lengths of right-padded prompts (None = all P).

  `mask` marks the tokens in the loss: the sampled tokens, or fewer when the
  credit estimator has a loss mask (`credit.loss_mask`, e.g. SPO-chain's).

  `packing` (a `trees.packing.Packing` of the B = N / G groups, rows group-major):
  log-probs come from one forward over each group's packed tree instead of one
  per row; the loss is still defined on the N rows, so it is the flat batch's.
  Minibatches and micro-batches then take whole groups.
  """
  prompts: jax.Array
  tokens: jax.Array
  mask: jax.Array
  advantages: jax.Array
  old_logprobs: jax.Array
  ref_logprobs: Optional[jax.Array] = None
  prompt_len: Optional[jax.Array] = None
  packing: Optional[packing_lib.Packing] = None


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static (hashable) loss / update hyper-parameters."""
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float = 3.0           # 0 disables; must be > 1 otherwise.
  agg: str = 'token-mean'
  kl_coef: float = 0.0             # KL-as-loss coefficient (ignored if kl_in_reward).
  kl_estimator: str = 'k3'
  kl_in_reward: bool = False
  entropy_coef: float = 0.0
  num_epochs: int = 1
  num_minibatches: int = 1
  num_microbatches: int = 1        # gradient accumulation inside a minibatch
  policy_loss: str = 'clip'        # one of POLICY_LOSSES (module docstring)
  apa_coef: float = 1.0            # 'apa': lam > 0, the KL strength of the target pi exp(A/lam)
  apa_anchor: str = 'ref'          # 'apa': pi_anchor = the reference ('ref') or sampling ('old')
  em_alpha: float = 0.5            # 'em': weight of preferred samples, 1 - it of dis-preferred

  def __post_init__(self):
    if self.agg not in AGG_MODES:
      raise ValueError(f'unknown loss aggregation {self.agg!r}; valid: {", ".join(AGG_MODES)}')
    if self.policy_loss not in POLICY_LOSSES:
      raise ValueError(f'unknown policy_loss {self.policy_loss!r}; valid: '
                       f'{", ".join(POLICY_LOSSES)}')
    if not self.apa_coef > 0:
      raise ValueError(f'apa_coef (APA\'s lambda) must be > 0, got {self.apa_coef}')
    if self.apa_anchor not in APA_ANCHORS:
      raise ValueError(f'unknown apa_anchor {self.apa_anchor!r}; valid: {", ".join(APA_ANCHORS)}')
    if not 0.0 <= self.em_alpha <= 1.0:
      raise ValueError(f'em_alpha must be in [0, 1], got {self.em_alpha}')
    if self.policy_loss == 'em' and self.em_alpha < 1.0 and not self.kl_loss:
      raise ValueError(
          f"policy_loss='em' with em_alpha={self.em_alpha} < 1 needs the KL to the reference "
          f"in the loss (kl_coef > 0, kl_in_reward=False): the dis-preferred term "
          f"-(1 - em_alpha) log pi is unbounded below without it (#156 regularises it so)")
    if self.kl_estimator not in ('k1', 'k2', 'k3'):
      raise ValueError(f'unknown KL estimator {self.kl_estimator!r}; valid: k1, k2, k3')
    if self.dual_clip and self.dual_clip <= 1.0:
      raise ValueError(f'dual_clip must be 0 (off) or > 1, got {self.dual_clip}')
    for f in ('num_epochs', 'num_minibatches', 'num_microbatches'):
      if getattr(self, f) < 1:
        raise ValueError(f'{f} must be >= 1')

  @property
  def kl_loss(self) -> bool:
    return self.kl_coef > 0 and not self.kl_in_reward

  @property
  def needs_ref(self) -> bool:
    """Whether the update (or the reward's KL) reads reference log-probs."""
    return self.kl_coef > 0 or (self.policy_loss == 'apa' and self.apa_anchor == 'ref')


# ----------------------------------------------------------------------------
# Optimizer and state.


@functools.lru_cache(maxsize=None)
def make_optimizer(lr: float, warmup_steps: int = 0, weight_decay: float = 0.0,
                   grad_clip: float = 1.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, lora_only: bool = False) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, lr linearly warmed up from 0 over `warmup_steps`, then constant.

  lora_only: an `AdapterOptimizer`: only the LoRA adapter leaves (`decoder.is_lora`)
  are differentiated, clipped (global norm over the adapters) and updated; the others
  stay frozen, get no gradient computation and carry no optimizer state.
  """
  if warmup_steps > 0:
    schedule = optax.linear_schedule(0.0, lr, warmup_steps)
  else:
    schedule = lr
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  tx = optax.chain(*parts)
  if lora_only:
    tx = _adapters_only(tx)
  return tx


class AdapterOptimizer(optax.GradientTransformation):
  """An optax transformation over the LoRA adapter leaves of a params tree only.

  `init(params)` and `update(grads, state, params)` accept the full params or the
  adapter subtree (`split_adapters`, idempotent) and return updates of the adapter
  subtree, so the optimizer state holds moments of the adapters only. A `TrainState`
  with one makes `train_step` / `sft_step` differentiate w.r.t. the adapters alone:
  the frozen base weights enter the loss as constants, so the backward pass computes
  activation gradients through them but no weight gradients (no dW matmuls, no
  embedding scatter-add, no Adam update over the base), unlike masking the updates
  of a full gradient.
  """
  __slots__ = ()


def _adapters_only(inner: optax.GradientTransformation) -> AdapterOptimizer:
  def init(params):
    adapters = split_adapters(params)
    if not adapters:
      raise ValueError('make_optimizer(lora_only=True): the params have no LoRA adapter '
                       'leaves (is cfg.lora_rank 0? see decoder.add_lora)')
    return inner.init(adapters)

  def update(grads, state, params=None):
    return inner.update(split_adapters(grads), state,
                        None if params is None else split_adapters(params))
  return AdapterOptimizer(init, update)


def split_adapters(params) -> dict:
  """The LoRA adapter leaves (`decoder.is_lora`) of a nested-dict params tree, as nested
  dicts of the same keys ({} if none). `with_adapters` puts them back."""
  def go(tree, path):
    if isinstance(tree, Mapping):
      out = {}
      for k, v in tree.items():
        sub = go(v, path + (jax.tree_util.DictKey(k),))
        if sub is not None:
          out[k] = sub
      return out or None
    return tree if decoder.is_lora(path) else None
  return go(params, ()) or {}


def with_adapters(params, adapters):
  """`params` (same structure and type) with its adapter leaves taken from `adapters`
  (a `split_adapters` subtree); the other leaves are those of `params`."""
  new = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(adapters)}
  out = jax.tree_util.tree_map_with_path(
      lambda p, x: new.pop(jax.tree_util.keystr(p), x) if decoder.is_lora(p) else x, params)
  if new:
    raise ValueError(f'adapters not in params: {sorted(new)[:5]}')
  return out


def _adapters_only_state(state) -> bool:
  return isinstance(state.tx, AdapterOptimizer)


def init_state(params, tx: optax.GradientTransformation, seed: int = 0) -> TrainState:
  return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                    rng=jax.random.PRNGKey(seed), tx=tx)


# ----------------------------------------------------------------------------
# Losses.


def token_weights(mask, agg: str, num_seqs=None, num_tokens=None, max_len=None):
  """Aggregation weights w [N, L] (see module docstring) for rows `mask` [N, L].

  `num_seqs` / `num_tokens` default to this array's counts; pass the counts of
  the whole minibatch when `mask` is one micro-batch of it.
  """
  mask = mask.astype(jnp.float32)
  num_seqs = mask.shape[0] if num_seqs is None else num_seqs
  num_tokens = jnp.sum(mask) if num_tokens is None else num_tokens
  max_len = mask.shape[-1] if max_len is None else max_len
  if agg == 'token-mean':
    return mask / jnp.maximum(num_tokens, 1.0)
  if agg == 'seq-mean-token-mean':
    return mask / (jnp.maximum(mask.sum(-1, keepdims=True), 1.0) * num_seqs)
  if agg == 'seq-mean-token-sum':
    return mask / num_seqs
  if agg == 'seq-mean-token-sum-norm':
    return mask / (num_seqs * max_len)
  raise ValueError(f'unknown loss aggregation {agg!r}; valid: {", ".join(AGG_MODES)}')


def batch_logprobs(params, cfg: decoder.PolicyConfig, mb: Batch):
  """Per-token log-probs and entropies [N, L] of the batch's rows (packed or flat)."""
  if mb.packing is None:
    return decoder.token_logprobs(params, cfg, mb.prompts, mb.tokens, mb.prompt_len)
  n, l = mb.tokens.shape
  b = mb.packing.tokens.shape[0]
  lp, ent = decoder.packed_token_logprobs(params, cfg, mb.packing,
                                          mb.tokens.reshape(b, n // b, l))
  return lp.reshape(n, l), ent.reshape(n, l)


def surrogate(loss_cfg: LossConfig, logp, old_logprobs, adv, mask, ref_logprobs=None):
  """Per-token policy loss pg [N, L] of `loss_cfg.policy_loss` (module docstring), before
  the entropy and KL terms, with the ratio r and log r (0 off `mask`).

  `adv` must be 0 off `mask`. 'clip' and 'rgra' have the same gradient at r = 1, and so
  has 'apa' at logp = anchor; 'em' with em_alpha 1/2 is 'rgra' on sign(A) / 2.
  clip_frac (`policy_loss`'s metric) counts what the clip would clip, whatever the loss.
  """
  log_ratio = jnp.where(mask, logp - old_logprobs, 0.0)
  ratio = jnp.exp(log_ratio)
  if loss_cfg.policy_loss == 'clip':
    clipped = jnp.clip(ratio, 1.0 - loss_cfg.eps_low, 1.0 + loss_cfg.eps_high)
    pg = jnp.maximum(-ratio * adv, -clipped * adv)
    if loss_cfg.dual_clip:
      pg = jnp.where(adv < 0, jnp.minimum(pg, -loss_cfg.dual_clip * adv), pg)
  elif loss_cfg.policy_loss == 'rgra':
    pg = -adv * jnp.where(mask, logp, 0.0)
  elif loss_cfg.policy_loss == 'apa':
    if loss_cfg.apa_anchor == 'ref' and ref_logprobs is None:
      raise ValueError("policy_loss='apa' with apa_anchor='ref' needs batch.ref_logprobs "
                       "(LossConfig.needs_ref); apa_anchor='old' uses the sampling policy")
    anchor = ref_logprobs if loss_cfg.apa_anchor == 'ref' else old_logprobs
    lam = loss_cfg.apa_coef
    pg = 0.5 * lam * jnp.square(jnp.where(mask, logp - anchor, 0.0) - adv / lam)
  elif loss_cfg.policy_loss == 'em':
    alpha = loss_cfg.em_alpha
    weight = jnp.where(adv > 0, alpha, 0.0) - jnp.where(adv < 0, 1.0 - alpha, 0.0)
    pg = -weight * jnp.where(mask, logp, 0.0)
  else:
    raise ValueError(f'unknown policy_loss {loss_cfg.policy_loss!r}; valid: '
                     f'{", ".join(POLICY_LOSSES)}')
  return pg, ratio, log_ratio


def policy_loss(params, cfg: decoder.PolicyConfig, loss_cfg: LossConfig, mb: Batch, weights):
  """Weighted-sum surrogate loss of a (micro)batch -> (loss, aux sums weighted by `weights`).

  aux holds *weighted sums* (clip fraction, approx KL, entropy, KL to ref) with
  the token-mean weights of the minibatch, so they also add up across micro-batches.
  """
  w, wm = weights  # aggregation weights, token-mean weights (for metrics)
  logp, ent = batch_logprobs(params, cfg, mb)
  mask = mb.mask
  adv = jnp.where(mask, mb.advantages, 0.0)
  pg, ratio, log_ratio = surrogate(loss_cfg, logp, mb.old_logprobs, adv, mask, mb.ref_logprobs)
  per_token = pg - loss_cfg.entropy_coef * ent
  kl_ref = jnp.zeros_like(pg)
  if loss_cfg.kl_loss:
    if mb.ref_logprobs is None:
      raise ValueError('kl_coef > 0 with the KL as a loss needs batch.ref_logprobs')
    kl_ref = credit.kl_penalty(logp, mb.ref_logprobs, mask, loss_cfg.kl_estimator)
    per_token = per_token + loss_cfg.kl_coef * kl_ref
  loss = jnp.sum(w * jnp.where(mask, per_token, 0.0))
  is_clipped = ((ratio > 1.0 + loss_cfg.eps_high) & (adv > 0)) | (
      (ratio < 1.0 - loss_cfg.eps_low) & (adv < 0))
  aux = dict(
      pg_loss=jnp.sum(w * jnp.where(mask, pg, 0.0)),
      clip_frac=jnp.sum(wm * is_clipped),
      approx_kl=jnp.sum(wm * (jnp.expm1(-log_ratio) + log_ratio)),  # k3(old || new)
      entropy=jnp.sum(wm * ent),
      kl_ref=jnp.sum(wm * kl_ref))
  return loss, aux


def _accumulate_grads(loss_fn, params, mb, num_micro: int):
  """Sum of (loss, aux, grads) over `num_micro` equal row-slices of mb (a pytree [N, ...])."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if num_micro == 1:
    (loss, aux), grads = grad_fn(params, mb)
    return loss, aux, grads
  split = jax.tree.map(lambda x: x.reshape((num_micro, x.shape[0] // num_micro) + x.shape[1:]),
                       mb)

  def body(carry, micro):
    (loss, aux), grads = grad_fn(params, micro)
    return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

  zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: grad_fn(params, jax.tree.map(
      lambda x: x[0], split))))
  zero = (zero[0][0], zero[0][1], zero[1])
  (loss, aux, grads), _ = jax.lax.scan(body, zero, split)
  return loss, aux, grads


def _value_and_grads(loss_fn, state: TrainState, mb, num_micro: int):
  """`_accumulate_grads` w.r.t. all params, or w.r.t. the adapter subtree only when
  `state.tx` is an `AdapterOptimizer` (the frozen leaves are constants of the loss)."""
  if not _adapters_only_state(state):
    return _accumulate_grads(loss_fn, state.params, mb, num_micro)
  frozen = jax.lax.stop_gradient(state.params)
  return _accumulate_grads(lambda a, m: loss_fn(with_adapters(frozen, a), m),
                           split_adapters(state.params), mb, num_micro)


def _apply(state: TrainState, grads):
  """One optimizer update; `grads` of all params, or of the adapter subtree only
  (`AdapterOptimizer`)."""
  if _adapters_only_state(state):
    adapters = split_adapters(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, adapters)
    params = with_adapters(state.params, optax.apply_updates(adapters, updates))
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1)


def minibatch_order(rng, units: int, num_epochs: int, num_minibatches: int,
                    num_microbatches: int, what: str = 'rows'):
  """(next rng, int32 [num_epochs * num_minibatches, units / num_minibatches]): each
  epoch's shuffle of the `units` (rows or groups), cut into minibatches; a ValueError
  naming `what` when the units do not divide into minibatches x micro-batches."""
  if units % (num_minibatches * num_microbatches):
    raise ValueError(f'{units} {what} not divisible by num_minibatches * num_microbatches = '
                     f'{num_minibatches * num_microbatches}')
  rng, perm_key = jax.random.split(rng)
  perms = jnp.stack([jax.random.permutation(k, units)
                     for k in jax.random.split(perm_key, num_epochs)])
  return rng, perms.reshape(num_epochs * num_minibatches, units // num_minibatches)


def train_step(state: TrainState, batch: Batch, *, cfg: decoder.PolicyConfig,
               loss_cfg: LossConfig):
  """num_epochs x num_minibatches clipped-surrogate updates on one rollout batch.

  Each epoch shuffles the N rows with a key split from `state.rng`, cuts them
  into num_minibatches equal minibatches (N must divide), and takes one
  optimizer step per minibatch (its gradient accumulated over
  num_microbatches). With `batch.packing` the units shuffled and split are the
  B groups (B must divide). Returns (new state, metrics averaged over the updates):
  loss, pg_loss, clip_frac, approx_kl, entropy, kl_ref, grad_norm (before clipping;
  of the adapters only with an `AdapterOptimizer`).
  """
  n = batch.tokens.shape[0]
  nmb, nmicro = loss_cfg.num_minibatches, loss_cfg.num_microbatches
  packed = batch.packing is not None
  units = batch.packing.tokens.shape[0] if packed else n  # groups or rows
  rows_per_unit = n // units
  rng, order = minibatch_order(state.rng, units, loss_cfg.num_epochs, nmb, nmicro,
                               'groups' if packed else 'rows')
  max_len = batch.tokens.shape[1]

  def update(state, unit_idx):
    idx = (unit_idx[:, None] * rows_per_unit + jnp.arange(rows_per_unit)).reshape(-1)
    mb = jax.tree.map(lambda x: x[idx], batch.replace(packing=None))
    if packed:
      mb = mb.replace(packing=jax.tree.map(lambda x: x[unit_idx], batch.packing))
    num_tokens = jnp.sum(mb.mask.astype(jnp.float32))
    w = token_weights(mb.mask, loss_cfg.agg, idx.shape[0], num_tokens, max_len)
    wm = token_weights(mb.mask, 'token-mean', idx.shape[0], num_tokens, max_len)

    def loss_fn(params, micro):
      m, w_, wm_ = micro
      return policy_loss(params, cfg, loss_cfg, m, (w_, wm_))

    loss, aux, grads = _value_and_grads(loss_fn, state, (mb, w, wm), nmicro)
    metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads), **aux)
    return _apply(state, grads), metrics

  state, metrics = jax.lax.scan(update, state.replace(rng=rng), order)
  return state, jax.tree.map(jnp.mean, metrics)


def sft_loss(params, cfg, prompts, responses, mask, prompt_len=None):
  logp, _ = decoder.token_logprobs(params, cfg, prompts, responses, prompt_len)
  m = mask.astype(jnp.float32)
  return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1.0)


def sft_step(state: TrainState, prompts, responses, mask, prompt_len=None, *,
             cfg: decoder.PolicyConfig):
  """One cross-entropy step on demonstrations (mean NLL over masked response tokens);
  `prompt_len` [N]: right-padded prompts (None: all P).

  With an `AdapterOptimizer` only the LoRA adapters are differentiated and updated.
  """
  if _adapters_only_state(state):
    frozen = jax.lax.stop_gradient(state.params)
    loss, grads = jax.value_and_grad(
        lambda a: sft_loss(with_adapters(frozen, a), cfg, prompts, responses, mask,
                           prompt_len))(split_adapters(state.params))
  else:
    loss, grads = jax.value_and_grad(sft_loss)(state.params, cfg, prompts, responses, mask,
                                               prompt_len)
  return _apply(state, grads), dict(loss=loss, grad_norm=optax.tree.norm(grads))


train_step_jit = jax.jit(train_step, static_argnames=('cfg', 'loss_cfg'), donate_argnums=0)
sft_step_jit = jax.jit(sft_step, static_argnames=('cfg',), donate_argnums=0)


# ----------------------------------------------------------------------------
# Batches from samples.


def batch_from_samples(prompts, samples_tokens, mask, advantages, old_logprobs,
                       ref_logprobs=None, prompt_len=None, packing=None) -> Batch:
  """[B, P] prompts (+ [B] prompt_len) and [B, G, L] arrays -> a `Batch` of N = B * G rows.

  `packing`: optional `trees.packing.Packing` of the B groups (see `Batch`).
  """
  b, g, l = samples_tokens.shape
  flat = lambda x: None if x is None else x.reshape(b * g, l)
  return Batch(prompts=jnp.repeat(prompts, g, axis=0), tokens=flat(samples_tokens),
               mask=flat(mask), advantages=flat(advantages).astype(jnp.float32),
               old_logprobs=flat(old_logprobs), ref_logprobs=flat(ref_logprobs),
               prompt_len=None if prompt_len is None else jnp.repeat(prompt_len, g, axis=0),
               packing=packing)


# ----------------------------------------------------------------------------
# Mesh and sharding.


def maybe_initialize_distributed() -> bool:
  """jax.distributed.initialize() iff the environment describes a multi-host job.

  Triggers on JAX_COORDINATOR_ADDRESS ('host:port' of process 0; with
  JAX_NUM_PROCESSES and JAX_PROCESS_ID, which JAX does not read itself, so they
  are passed here) or TREECREDIT_DISTRIBUTED=1 (TPU pods, SLURM, ...: JAX
  auto-detects everything). CPU processes talk through gloo collectives. Call it
  before anything touches a device; calling it again is a no-op.

  Then starts `watchdog.install()`: when a peer process dies (or hangs, or fails), the
  others exit within TREECREDIT_PEER_TIMEOUT seconds (default 20; 0 = off) with one
  line naming it and the checkpoint to resume from, not JAX's 100 s heartbeat abort.
  """
  import os
  from experiments.training import watchdog
  env = os.environ
  if not (env.get('JAX_COORDINATOR_ADDRESS') or env.get('TREECREDIT_DISTRIBUTED') == '1'):
    return False
  timeout = watchdog.timeout_from_env(env)  # a bad value fails before connecting
  if not jax.distributed.is_initialized():
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    as_int = lambda name: int(env[name]) if env.get(name) else None
    jax.distributed.initialize(num_processes=as_int('JAX_NUM_PROCESSES'),
                               process_id=as_int('JAX_PROCESS_ID'))
  watchdog.install(timeout)
  return True


MESH_AXES = ('data', 'fsdp', 'model')
ROW_AXES = ('data', 'fsdp')  # split the rows of a batch or KV cache; 'model' replicates them


def make_mesh(fsdp: int = 1, devices=None, model: int = 1) -> Mesh:
  """Mesh ('data', 'fsdp', 'model') over `devices` (default all): data = n / (fsdp * model).

  'model' is the tensor-parallel axis (Megatron column / row splits of heads, MLP width
  and vocabulary; `PARAM_AXES`), its devices adjacent in `devices` order. model = 1 is
  the fsdp-only layout: the axis is there with size 1 and splits nothing.
  """
  devices = jax.devices() if devices is None else list(devices)
  if fsdp < 1 or model < 1:
    raise ValueError(f'fsdp={fsdp} and model={model} must be >= 1')
  if len(devices) % (fsdp * model):
    raise ValueError(f'fsdp={fsdp} x model={model} does not divide {len(devices)} devices')
  return Mesh(np.asarray(devices).reshape(len(devices) // (fsdp * model), fsdp, model),
              MESH_AXES)


def mesh_axis(mesh: Mesh, name: str) -> int:
  """Size of a mesh axis, 1 if the mesh has no such axis."""
  return dict(mesh.shape).get(name, 1)


def row_shards(mesh: Mesh) -> int:
  """Number of parts the rows of a batch split into (`batch_sharding`): data x fsdp."""
  return math.prod(mesh_axis(mesh, a) for a in ROW_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (row / prompt) axis split over ('data', 'fsdp'), replicated over 'model'."""
  return NamedSharding(mesh, P(ROW_AXES))


# Logical axes of every parameter leaf (MaxText style), by the last two keys of its path,
# (module, leaf): the same for its optimizer moments, whose paths end alike. Stacked
# block leaves lead with 'layers'. LoRA adapters (qwix: A [layers, prod(in), r], B
# [layers, r, prod(out)]) name a flattened heads x head_dim axis 'heads' / 'kv_heads':
# split into `model` equal parts it is split by whole heads.
_QKV = {'q': 'heads', 'k': 'kv_heads', 'v': 'kv_heads'}
PARAM_AXES = {
    ('embed', 'embedding'): ('vocab', 'embed'),
    ('head', 'kernel'): ('embed', 'vocab'),
    ('final_norm', 'scale'): ('embed',),
    ('attn_norm', 'scale'): ('layers', 'embed'),
    ('mlp_norm', 'scale'): ('layers', 'embed'),
    ('q_norm', 'scale'): ('layers', 'head_dim'),
    ('k_norm', 'scale'): ('layers', 'head_dim'),
    **{(m, 'kernel'): ('layers', 'embed', h, 'head_dim') for m, h in _QKV.items()},
    **{(m, 'bias'): ('layers', h, 'head_dim') for m, h in _QKV.items()},
    **{(m, 'kernel_lora_a'): ('layers', 'embed', 'lora') for m in _QKV},
    **{(m, 'kernel_lora_b'): ('layers', 'lora', h) for m, h in _QKV.items()},
    ('o', 'kernel'): ('layers', 'heads', 'head_dim', 'embed'),
    ('o', 'bias'): ('layers', 'embed'),
    ('o', 'kernel_lora_a'): ('layers', 'heads', 'lora'),
    ('o', 'kernel_lora_b'): ('layers', 'lora', 'embed'),
    **{(m, 'kernel'): ('layers', 'embed', 'mlp') for m in ('gate', 'up')},
    **{(m, 'bias'): ('layers', 'mlp') for m in ('gate', 'up')},
    **{(m, 'kernel_lora_a'): ('layers', 'embed', 'lora') for m in ('gate', 'up')},
    **{(m, 'kernel_lora_b'): ('layers', 'lora', 'mlp') for m in ('gate', 'up')},
    ('down', 'kernel'): ('layers', 'mlp', 'embed'),
    ('down', 'bias'): ('layers', 'embed'),
    ('down', 'kernel_lora_a'): ('layers', 'mlp', 'lora'),
    ('down', 'kernel_lora_b'): ('layers', 'lora', 'embed'),
}
# Logical axis -> mesh axis of tensor parallelism (Megatron): q / k / v and gate / up
# split their outputs (columns), o and down their inputs (rows), so a block needs one
# all-reduce after attention and one after the MLP; the embedding and the output head
# split the vocabulary (the log-softmax reduces over it: `decoder.pick_logprob`).
# 'fsdp' is not in the table: it takes the largest remaining axis it divides (`leaf_spec`).
LOGICAL_RULES = {'heads': 'model', 'kv_heads': 'model', 'mlp': 'model', 'vocab': 'model'}


def logical_axes(path) -> Optional[tuple]:
  """A leaf's logical axes (`PARAM_AXES`) from its key path (params, a TrainState, an
  optimizer state); None for leaves that are not parameters (step, rng, counts)."""
  keys = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
  return PARAM_AXES.get(keys[-2:]) if len(keys) >= 2 else None


def leaf_spec(shape, fsdp: int, model: int = 1, axes: Optional[tuple] = None) -> P:
  """PartitionSpec of one parameter (or optimizer moment) over the mesh.

  model > 1: the axis whose logical name (`axes`, from `PARAM_AXES`) `LOGICAL_RULES`
  maps to 'model' is split over 'model' (a ValueError if model does not divide it);
  leaves without logical axes are not split over 'model'. Then, if fsdp > 1, the
  largest remaining axis divisible by fsdp is split over 'fsdp' (ties: the later
  axis), e.g. the vocab axis of an embedding, d_ff of an MLP kernel, the model axis of
  stacked [layers, d_model, heads, head_dim] kernels; replicated over 'fsdp' if none
  is. With model == 1 a function of the shape only.
  """
  shape = tuple(shape)
  parts = [None] * len(shape)
  if model > 1 and axes is not None:
    if len(axes) != len(shape):
      raise ValueError(f'logical axes {axes} do not match a parameter of shape {shape}')
    for ax, name in enumerate(axes):
      if LOGICAL_RULES.get(name) == 'model':
        if shape[ax] % model:
          raise ValueError(f"mesh model={model} does not divide the {name!r} axis "
                           f"({shape[ax]}) of a parameter of shape {shape}")
        parts[ax] = 'model'
        break
  if fsdp > 1:
    for ax in np.argsort(shape, kind='stable')[::-1]:
      if parts[ax] is None and shape[ax] % fsdp == 0:
        parts[ax] = 'fsdp'
        break
  return P(*parts) if any(p is not None for p in parts) else P()


def param_specs(tree, fsdp: int, model: int = 1):
  """PartitionSpecs (`leaf_spec`) for a params pytree, or any pytree holding params (a
  TrainState: each optimizer moment gets its parameter's spec), arrays or
  ShapeDtypeStructs."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: leaf_spec(tuple(getattr(x, 'shape', ())), fsdp, model, logical_axes(p)),
      tree)


def check_model_axis(cfg: decoder.PolicyConfig, model: int):
  """Refuses a tensor-parallel degree the decoder cannot split: `model` must divide the
  query heads, the kv heads, the MLP width and the vocabulary."""
  if model < 1:
    raise ValueError(f'mesh model={model} must be >= 1')
  sizes = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, d_ff=cfg.d_ff,
               vocab_size=cfg.vocab_size)
  bad = [f'{k}={v}' for k, v in sizes.items() if v % model]
  if bad:
    raise ValueError(f'mesh model={model} (tensor parallelism) must divide the query heads, '
                     f'kv heads, MLP width and vocabulary of the model '
                     f'({", ".join(f"{k}={v}" for k, v in sizes.items())}); it does not '
                     f'divide {", ".join(bad)}')


def param_sharding(tree, mesh: Mesh):
  """Shardings (`param_specs` over the mesh's fsdp and model sizes) for a params pytree
  or a TrainState; replicated when both are 1."""
  specs = param_specs(tree, mesh_axis(mesh, 'fsdp'), mesh_axis(mesh, 'model'))
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, P))


def shard_state(state: TrainState, mesh: Mesh) -> TrainState:
  """Places params and optimizer state (`param_sharding`) on the mesh."""
  return jax.tree.map(jax.device_put, state, param_sharding(state, mesh))


def shard_batch(batch, mesh: Mesh):
  """Row axis of every array in `batch` over ('data', 'fsdp') (rows must divide
  `row_shards(mesh)`)."""
  sh = batch_sharding(mesh)
  return jax.tree.map(lambda x: jax.device_put(x, sh), batch)


# ----------------------------------------------------------------------------
# Multi-process jobs: each process addresses only its own devices.


def process_rows(n: int, mesh: Mesh) -> slice:
  """The rows of an [n, ...] array under `batch_sharding(mesh)` held by this process's devices."""
  spans = sorted({s[0].indices(n)[:2] for s in
                  batch_sharding(mesh).addressable_devices_indices_map((n,)).values()})
  if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
    raise ValueError(f'this process holds non-contiguous rows {spans} of the mesh')
  return slice(spans[0][0], spans[-1][1])


def global_batch(local, mesh: Mesh, num_rows: int):
  """Global arrays (rows over `batch_sharding(mesh)`) from this process's rows
  (`process_rows(num_rows, mesh)` of every array in the pytree `local`)."""
  sh = batch_sharding(mesh)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
      sh, np.asarray(x), (num_rows,) + np.shape(x)[1:]), local)


def host_batch_to_global(batch, mesh: Mesh):
  """A host batch that every process holds in full (drawn from the same key) -> global
  arrays with rows over the mesh; each process transfers only its own rows."""
  def put(x):
    x = np.asarray(x)
    return global_batch(x[process_rows(x.shape[0], mesh)], mesh, x.shape[0])
  return jax.tree.map(put, batch)


def to_global(tree, mesh: Optional[Mesh] = None):
  """Host-local arrays of a multi-process job -> replicated over `mesh` (default: all devices).

  For values every process holds identically (e.g. a redundantly computed SFT state),
  so that orbax can save them. Global arrays, and single-process jobs, pass unchanged.
  """
  if jax.process_count() == 1:
    return tree
  rep = NamedSharding(make_mesh() if mesh is None else mesh, P())
  return jax.tree.map(lambda x: x if isinstance(x, jax.Array) and not x.is_fully_addressable
                      else jax.device_put(np.asarray(x), rep), tree)


def host_value(x) -> np.ndarray:
  """A (possibly multi-process, sharded) array as a numpy array on every process."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
