"""A learned critic for PPO (issue 24): V(s_t) from a decoder trunk and a scalar value head.

The critic is a separate model of the policy's decoder family, initialised from the
policy's (warm-start) parameters, as verl initialises its critic from a checkpoint: its
params are {'trunk': decoder params (the LM head is unused), 'value_head': {'kernel': [D],
'bias': []}}, the head small and random (V ≈ 0 before its first update). It has its own
optimizer and `TrainState` (`init_state`), is placed on the mesh like the policy
(`train_step.param_sharding`), and is checkpointed with the run (`loop.train`).

  values(params, cfg, prompts, responses, prompt_len) -> float32 [N, L]: V(s_t), the value
      of the state before response token t (prompt + responses[:t]), read from the final
      hidden state that predicts token t (the position `decoder.token_logprobs` scores).
  value_loss(vpred, old_values, returns, mask, cliprange, agg): verl's clipped value loss,
      0.5 * agg(max((V − R)², (clip(V, V_old ± c) − R)²)); c = 0 (or None) disables clipping.
  rank_loss(vpred, returns, mask): PUM's pairwise ranking loss over each row's prefixes
      (`critic.loss = 'rank'`).
  critic_step(state, batch, cfg, ccfg): epochs x minibatches of that loss on flat rows.
  targets(rewards, values, mask, token_rewards, gamma, lam): TD(λ) returns
      G^λ_t = A^GAE_t + V_t (the regression targets; verl's `returns`).

`from_config` and `update_on_samples` are the loop's two calls. Everything runs on flat
rows [N = B·G, L] (no tree packing for the critic). Costs: one teacher-forced forward for
the values and epochs x (forward + backward) for the update, per RL step; none of it when
no estimator needs values (`credit.needs(name)`).
"""

import dataclasses
import functools
import inspect
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

import credit
import trees
from credit.returns import outcome_token_rewards, td_lambda_returns
from experiments.models import decoder
from experiments.training import train_step as ts


TARGETS = ('td_lambda', 'tree', 'advantage')
LOSSES = ('mse', 'rank')


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """Static critic-update hyper-parameters (verl's `critic.*` names where they exist)."""
  cliprange_value: float = 0.5      # verl critic.cliprange_value; 0 disables value clipping
  agg: str = 'token-mean'           # verl critic.loss_agg_mode
  num_epochs: int = 1               # verl critic.ppo_epochs
  num_minibatches: int = 1
  num_microbatches: int = 1
  # The regression targets: 'td_lambda' (verl's returns A^GAE + V), 'tree' (TEMPO's
  # prefix-tree values V(s_t) of the step's groups: a process value model on tree labels)
  # or 'advantage' (R_i − the group's mean reward on every token: the Advantage Model, #77).
  targets: str = 'td_lambda'
  # 'mse': verl's clipped squared error; 'rank': a pairwise logistic ranking loss over the
  # prefixes of each response (PUM, #90: `rank_loss`), which orders values, not scales them.
  loss: str = 'mse'
  # verl's trainer.critic_warmup: the first RL steps update the critic only (the policy
  # waits for a critic that has seen its samples).
  critic_warmup: int = 0

  def __post_init__(self):
    if self.targets not in TARGETS:
      raise ValueError(f'critic targets {self.targets!r}; valid: {", ".join(TARGETS)}')
    if self.loss not in LOSSES:
      raise ValueError(f'critic loss {self.loss!r}; valid: {", ".join(LOSSES)}')
    if self.agg not in ts.AGG_MODES:
      raise ValueError(f'critic agg {self.agg!r}; valid: {", ".join(ts.AGG_MODES)}')
    if not self.cliprange_value >= 0:
      raise ValueError(f'critic cliprange_value must be >= 0; got {self.cliprange_value}')
    if self.critic_warmup < 0:
      raise ValueError(f'critic critic_warmup must be >= 0; got {self.critic_warmup}')
    for f in ('num_epochs', 'num_minibatches', 'num_microbatches'):
      if getattr(self, f) < 1:
        raise ValueError(f'critic {f} must be >= 1')


@struct.dataclass
class CriticBatch:
  """Rows = responses: prompts [N, P], prompt_len [N] or None, the rest [N, L]."""
  prompts: jax.Array
  tokens: jax.Array
  mask: jax.Array
  old_values: jax.Array
  returns: jax.Array
  prompt_len: Optional[jax.Array] = None


def init_params(policy_params, cfg: decoder.PolicyConfig, key=None, scale: float = 0.01):
  """Critic params from the policy's: a copy of the trunk and a value head with kernel
  N(0, scale² / D) (key; None: PRNGKey(0)) and bias 0, so V starts near 0 (|V| ~ scale)."""
  if cfg.lora_rank:
    raise ValueError('the critic trains all of its weights: build it from a policy without '
                     'LoRA adapters (merge them first, decoder.merge_lora)')
  key = jax.random.PRNGKey(0) if key is None else key
  kernel = scale * jax.random.normal(key, (cfg.d_model,), jnp.float32) / jnp.sqrt(cfg.d_model)
  return dict(trunk=jax.tree.map(jnp.copy, policy_params),
              value_head=dict(kernel=kernel, bias=jnp.zeros((), jnp.float32)))


def init_state(policy_params, cfg: decoder.PolicyConfig, tx: optax.GradientTransformation,
               seed: int = 0) -> ts.TrainState:
  params = init_params(policy_params, cfg, jax.random.PRNGKey(seed))
  return ts.init_state(params, tx, seed=seed)


def values(params, cfg: decoder.PolicyConfig, prompts, responses, prompt_len=None):
  """float32 [N, L]: V(s_t) before each response token (see the module docstring)."""
  h = decoder.response_hidden(params['trunk'], cfg, prompts, responses, prompt_len)
  head = params['value_head']
  return h @ head['kernel'] + head['bias']


def _value_terms(vpred, old_values, returns, cliprange):
  """Per-token (max(l₁, l₂), l₂ > l₁) of `value_loss` (l₁ alone without clipping)."""
  l1 = (vpred - returns) ** 2
  if not cliprange:
    return l1, jnp.zeros_like(l1, bool)
  delta = vpred - old_values
  l2 = (old_values + jnp.clip(delta, -cliprange, cliprange) - returns) ** 2
  # Counted where the clip is active (|V − V_old| > c) and raises the loss: unclipped, l₂
  # equals l₁ up to rounding, which verl's plain l₂ > l₁ counts at random.
  return jnp.maximum(l1, l2), (jnp.abs(delta) > cliprange) & (l2 > l1)


def value_loss(vpred, old_values, returns, mask, cliprange: Optional[float] = 0.5,
               agg: str = 'token-mean'):
  """verl's `compute_value_loss`: (0.5 · agg(max(l₁, l₂)), clip fraction), l₁ = (V − R)²,
  l₂ = (V_old + clip(V − V_old, −c, c) − R)²; without clipping (c 0 / None) l₁ alone.
  The clip fraction (verl's `vf_clipfrac`) is the share of tokens where the clip is active
  and l₂ > l₁."""
  mask = jnp.asarray(mask, bool)
  loss, clipped = _value_terms(vpred, old_values, returns, cliprange)
  n, l = mask.shape[0], mask.shape[-1]
  num = jnp.sum(mask.astype(jnp.float32))
  w = ts.token_weights(mask, agg, n, num, l)
  wm = ts.token_weights(mask, 'token-mean', n, num, l)
  return 0.5 * jnp.sum(w * loss), jnp.sum(wm * clipped)


def rank_terms(vpred, returns, mask):
  """(per row [N]: Σ softplus(−y·(V_t − V_u)) over its pairs, per row [N]: its pair count)
  for the pairs of prefixes t < u of one row with different targets, y = sign(R_t − R_u)."""
  m = jnp.asarray(mask, bool)
  l = m.shape[-1]
  upper = jnp.arange(l)[:, None] < jnp.arange(l)[None, :]
  both = m[..., :, None] & m[..., None, :] & upper
  y = jnp.where(both, jnp.sign(returns[..., :, None] - returns[..., None, :]), 0.0)
  terms = jnp.where(y != 0, jax.nn.softplus(-y * (vpred[..., :, None] - vpred[..., None, :])),
                    0.0)
  return jnp.sum(terms, (-2, -1)), jnp.sum(jnp.abs(y), (-2, -1))


def rank_loss(vpred, returns, mask):
  """PUM's pairwise ranking objective (#90) over each row's prefixes: the mean over pairs
  t < u with different targets of softplus(−y·(V_t − V_u)), y = sign(R_t − R_u) (the
  logistic loss of ranking the likelier-to-succeed prefix first); 0 without such a pair.
  O(L²) pairs a row."""
  total, pairs = rank_terms(vpred, returns, mask)
  return jnp.sum(total) / jnp.maximum(jnp.sum(pairs), 1.0)


def targets(rewards, values_, mask, token_rewards=None, gamma: float = 1.0, lam: float = 1.0):
  """float32 [..., G, L] TD(λ) returns of the outcome `rewards` [..., G] (on each response's
  last token) plus `token_rewards`, bootstrapped from `values_` (0 after the last token)."""
  r = credit.Rollouts(tokens=jnp.zeros(mask.shape, jnp.int32), mask=mask, rewards=rewards,
                      token_rewards=token_rewards)
  return td_lambda_returns(outcome_token_rewards(r), values_, mask, gamma, lam)


@jax.jit
def tree_targets(tokens, mask, rewards):
  """float32 [B, G, L]: TEMPO's V(s_t) of each group, the mean outcome of the group's
  responses that share the first t tokens (`trees.prefix_values`); 0 on masked tokens. The
  labels of a process value model trained on tree values (issue 24, item 4): lower variance
  than one response's return, from the same rollouts. Outcome rewards only."""
  return trees.prefix_values(trees.build(tokens, mask), rewards)[0]


@jax.jit
def advantage_targets(mask, rewards):
  """float32 [B, G, L]: R_i − mean_g R_g on every token of response i (the Advantage Model's
  labels, #77: the reward beyond the prompt's expected reward, centred per prompt so its
  scale is comparable across prompts); 0 on masked tokens. Outcome rewards only."""
  r = jnp.asarray(rewards, jnp.float32)
  return jnp.where(mask, (r - jnp.mean(r, -1, keepdims=True))[..., None], 0.0)


def critic_step(state: ts.TrainState, batch: CriticBatch, *, cfg: decoder.PolicyConfig,
                ccfg: CriticConfig):
  """num_epochs x num_minibatches value-loss updates on one batch of N rows (N must divide
  into num_minibatches x num_microbatches); rows shuffled each epoch with a key from
  `state.rng`. Returns (state, metrics: vf_loss, vf_clipfrac, vpred_mean, grad_norm, means
  over the updates)."""
  nmicro = ccfg.num_microbatches
  rng, order = ts.minibatch_order(state.rng, batch.tokens.shape[0], ccfg.num_epochs,
                                  ccfg.num_minibatches, nmicro, 'critic rows')

  def loss_fn(params, micro):
    mb, w, wm = micro
    v = values(params, cfg, mb.prompts, mb.tokens, mb.prompt_len)
    if ccfg.loss == 'rank':  # w: 1 / the minibatch's pair count, on each row
      return jnp.sum(w * rank_terms(v, mb.returns, mb.mask)[0]), dict(
          vf_clipfrac=jnp.zeros(()), vpred_mean=jnp.sum(wm * v))
    loss, clipped = _value_terms(v, mb.old_values, mb.returns, ccfg.cliprange_value)
    return 0.5 * jnp.sum(w * loss), dict(vf_clipfrac=jnp.sum(wm * clipped),
                                         vpred_mean=jnp.sum(wm * v))

  def update(state, idx):
    mb = jax.tree.map(lambda x: x[idx], batch)
    num = jnp.sum(mb.mask.astype(jnp.float32))  # weights over the whole minibatch
    if ccfg.loss == 'rank':  # the mean over the minibatch's pairs (`rank_loss`)
      pairs = jnp.sum(rank_terms(mb.old_values, mb.returns, mb.mask)[1])
      w = jnp.full((idx.shape[0],), 1.0 / jnp.maximum(pairs, 1.0))
    else:
      w = ts.token_weights(mb.mask, ccfg.agg, idx.shape[0], num, mb.mask.shape[1])
    wm = ts.token_weights(mb.mask, 'token-mean', idx.shape[0], num, mb.mask.shape[1])
    loss, aux, grads = ts._accumulate_grads(loss_fn, state.params, (mb, w, wm), nmicro)
    return ts._apply(state, grads), dict(vf_loss=loss, grad_norm=optax.tree.norm(grads), **aux)

  state, metrics = jax.lax.scan(update, state.replace(rng=rng), order)
  return state, jax.tree.map(jnp.mean, metrics)


critic_step_jit = jax.jit(critic_step, static_argnames=('cfg', 'ccfg'), donate_argnums=0)
values_jit = jax.jit(values, static_argnames=('cfg',))


@functools.partial(jax.jit, static_argnames=('cfg',))
def group_values(params, prompts, tokens, prompt_len=None, *, cfg):
  """`values` of [B, G, L] responses to [B, P] prompts -> float32 [B, G, L]."""
  b, g, l = tokens.shape
  rep = lambda x: None if x is None else jnp.repeat(x, g, axis=0)
  v = values(params, cfg, rep(prompts), tokens.reshape(b * g, l), rep(prompt_len))
  return v.reshape(b, g, l)


# ----------------------------------------------------------------------------
# In the loop (experiments/training/loop.py).

# The optional `critic` config section (configs/ppo.py); a config without it uses defaults.
CONFIG_FIELDS = ('lr', 'warmup_steps', 'cliprange_value', 'agg', 'epochs', 'minibatches',
                 'microbatches', 'targets', 'loss', 'critic_warmup')


def from_config(cfg, init_params, pcfg, run_seed: int, mesh):
  """(critic TrainState on the mesh, `CriticConfig`, (γ, λ) of its targets) for an
  estimator that reads values. `cfg.critic` (optional; configs/ppo.py sets it): lr
  (default the policy's), warmup_steps, cliprange_value (verl's 0.5), agg, epochs,
  minibatches, micro-batches (default the policy's). The targets' γ and λ are the
  estimator's (`gae`: its `gamma`, `lam`), as verl's returns = A^GAE + V."""
  c = cfg.get('critic') or {}
  get = lambda k, d: c.get(k, d) if hasattr(c, 'get') else d
  o = cfg.optimizer
  ccfg = CriticConfig(
      cliprange_value=float(get('cliprange_value', 0.5)), agg=get('agg', 'token-mean'),
      num_epochs=int(get('epochs', cfg.loss.num_epochs)),
      num_minibatches=int(get('minibatches', cfg.loss.num_minibatches)),
      num_microbatches=int(get('microbatches', cfg.loss.num_microbatches)),
      targets=get('targets', 'td_lambda'), loss=get('loss', 'mse'),
      critic_warmup=int(get('critic_warmup', 0)))
  tx = ts.make_optimizer(float(get('lr', o.lr)), int(get('warmup_steps', o.warmup_steps)),
                         o.weight_decay, o.grad_clip, o.b1, o.b2)
  if (ccfg.targets == 'advantage') != (cfg.credit.name == 'advantage_model'):
    raise ValueError(f"critic.targets = 'advantage' (the Advantage Model's labels) goes with "
                     f"credit 'advantage_model' and only with it; got targets "
                     f"{ccfg.targets!r} for credit {cfg.credit.name!r}")
  state = ts.shard_state(init_state(init_params, pcfg, tx, seed=run_seed + 1), mesh)
  sig = inspect.signature(credit.get(cfg.credit.name)).parameters
  hp = cfg.credit.hparams
  pick = lambda k, d: float(hp[k]) if k in hp else (
      float(sig[k].default) if k in sig and sig[k].default is not inspect.Parameter.empty else d)
  return state, ccfg, (pick('gamma', 1.0), pick('lam', 1.0))


def update_on_samples(critic_state, prompts, plen, samples, values, rewards, token_rewards,
                      policy_mask, mesh, *, pcfg, ccfg, gamma_lam):
  """One critic update on this step's rollouts: TD(λ) targets from `values` (the critic's
  before the update, also the clipping anchor), or with `ccfg.targets == 'tree'` the prefix
  tree's values of each group (`tree_targets`), or with 'advantage' each response's reward
  less its group's mean (`advantage_targets`), on the trained tokens. Returns (state,
  {'critic/vf_loss', 'critic/vf_clipfrac', 'critic/vpred_mean', 'critic/grad_norm'})."""
  b, g, l = samples.tokens.shape
  if ccfg.targets == 'tree':
    returns = tree_targets(samples.tokens, samples.mask, rewards)
  elif ccfg.targets == 'advantage':
    returns = advantage_targets(samples.mask, rewards)
  else:
    returns = targets(rewards, values, samples.mask, token_rewards, *gamma_lam)
  mask = samples.mask if policy_mask is None else samples.mask & policy_mask
  flat = lambda x: x.reshape(b * g, l)
  batch = CriticBatch(prompts=jnp.repeat(prompts, g, axis=0), tokens=flat(samples.tokens),
                      mask=flat(mask), old_values=flat(values), returns=flat(returns),
                      prompt_len=None if plen is None else jnp.repeat(plen, g, 0))
  if (b * g) % ts.row_shards(mesh) == 0:
    batch = ts.shard_batch(batch, mesh)
  critic_state, m = critic_step_jit(critic_state, batch, cfg=pcfg, ccfg=ccfg)
  return critic_state, {f'critic/{k}': float(v) for k, v in m.items()}
