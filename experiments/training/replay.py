"""Off-policy pieces of the loop (issue 23's replay family): a finite training prompt pool,
a replay store of each pool prompt's latest success (R³, #73), and the lagged behaviour
policy of off-policy GRPO (#63).

Pool: `rl.prompt_pool` = N > 0 fixes N training prompts per run (drawn once from the run's
seed); each step takes B of them uniformly without replacement (`pool_indices`), so a
prompt comes back and a stored response of it can be replayed. The indices are the
draw's `prompt_ids`.

Replay (estimators with `needs=('replay',)`: R³, AVATAR): the store keeps, per pool prompt,
its newest success (slot 0: reward >= `success`) and, for two-sided replay, its newest
failure (slot 1). After sampling, a group none of whose responses succeeded gets the
prompt's stored success in place of its last response, and with `two_sided` a group whose
responses all succeeded gets the stored failure (`inject`), with the log-probs and
entropies it was sampled with, so the clipped surrogate's ratio is π_θ / π_behaviour (or,
`replay_logprobs='current'`, the current policy's: on-policy treatment). Then each group's
first fresh success (and failure) replaces its prompt's stored one (`update`). The store is
part of the checkpointed loop state.

Lag (sampler 'lagged', `sampler.lag` = v): responses are sampled, and their old
log-probs computed, with the policy of the last step that is a multiple of v (refreshed
then, and checkpointed with the run), so every update but the first of each v is
off-policy, corrected by the clipped importance ratio.
"""

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class ReplayStore:
  """Each pool prompt's newest success (slot 0) and failure (slot 1), [N, 2, L] (N =
  rl.prompt_pool).

  Attributes: tokens int32, mask bool, logprobs and entropy float32 (the sampling policy's,
  untempered, at the time it was sampled), reward float32 [N, 2], has bool [N, 2] (a
  response is stored), step int32 [N, 2] (the RL step it was sampled at; -1 if none).
  """

  tokens: jax.Array
  mask: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  reward: jax.Array
  has: jax.Array
  step: jax.Array


def init_store(pool_size: int, response_len: int, pad_id: int) -> ReplayStore:
  n, l = int(pool_size), int(response_len)
  return ReplayStore(tokens=jnp.full((n, 2, l), pad_id, jnp.int32),
                     mask=jnp.zeros((n, 2, l), bool), logprobs=jnp.zeros((n, 2, l), jnp.float32),
                     entropy=jnp.zeros((n, 2, l), jnp.float32),
                     reward=jnp.zeros((n, 2), jnp.float32), has=jnp.zeros((n, 2), bool),
                     step=jnp.full((n, 2), -1, jnp.int32))


def pool_indices(key, pool_size: int, n: int):
  """int32 [n]: n distinct pool indices, uniform (n <= pool_size)."""
  if n > pool_size:
    raise ValueError(f'rl.prompt_pool ({pool_size}) must hold a step\'s prompts '
                     f'(rl.prompts_per_step = {n}).')
  return jax.random.permutation(key, pool_size)[:n].astype(jnp.int32)


@jax.jit
def inject(store: ReplayStore, prompt_ids, samples, rewards, success, two_sided=False):
  """(samples, rewards, replayed bool [B, G]): each group [B] with no reward >= `success`
  whose prompt has a stored success gets it as its last response (tokens, mask, sampling
  log-probs and entropies, reward); with `two_sided`, each group whose rewards are all >=
  `success` gets the prompt's stored failure likewise. Other groups are unchanged."""
  ok = rewards >= success
  slot = jnp.where(jnp.all(~ok, -1), 0, 1)  # [B]: what the group lacks
  lacks = jnp.all(~ok, -1) | (jnp.all(ok, -1) & two_sided)
  use = lacks & store.has[prompt_ids, slot]
  g = rewards.shape[-1]
  last = (jnp.arange(g) == g - 1)[None, :] & use[:, None]  # [B, G]

  def put(x, stored):
    return jnp.where(last[..., None], stored[prompt_ids, slot][:, None].astype(x.dtype), x)

  samples = samples.replace(tokens=put(samples.tokens, store.tokens),
                            mask=put(samples.mask, store.mask),
                            logprobs=put(samples.logprobs, store.logprobs),
                            entropy=put(samples.entropy, store.entropy))
  rewards = jnp.where(last, store.reward[prompt_ids, slot][:, None], rewards)
  return samples, rewards, last


@jax.jit
def update(store: ReplayStore, prompt_ids, samples, rewards, replayed, success, step,
           two_sided=False):
  """The store after a batch: each group's first fresh (not replayed) response with reward
  >= `success` replaces its prompt's stored success; with `two_sided`, its first fresh one
  below `success` replaces the stored failure."""
  fresh = ~replayed
  for slot, want in ((0, (rewards >= success) & fresh), (1, (rewards < success) & fresh)):
    got = jnp.any(want, -1) & (two_sided if slot else True)
    first = jnp.argmax(want, -1)
    pick = lambda x: jnp.take_along_axis(x, first.reshape((-1,) + (1,) * (x.ndim - 1)), 1)[:, 0]

    def put(old, new):
      keep = got.reshape((-1,) + (1,) * (new.ndim - 1))
      return old.at[prompt_ids, slot].set(jnp.where(keep, new.astype(old.dtype),
                                                    old[prompt_ids, slot]))

    store = ReplayStore(tokens=put(store.tokens, pick(samples.tokens)),
                        mask=put(store.mask, pick(samples.mask)),
                        logprobs=put(store.logprobs, pick(samples.logprobs)),
                        entropy=put(store.entropy, pick(samples.entropy)),
                        reward=put(store.reward, pick(rewards)), has=put(store.has, got),
                        step=put(store.step, jnp.full(got.shape, step, jnp.int32)))
  return store


@jax.jit
def copy_params(params):
  """A copy of the policy's params (the lagged behaviour policy; the train step donates its
  own buffers)."""
  return jax.tree.map(jnp.copy, params)
