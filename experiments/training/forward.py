"""Jitted forward pieces of the RL step: rewards, teacher-forced log-probs, packing and
the credit estimator (cached on their static arguments; `aot.py` compiles the same ones)."""

import functools
import json
import math

import jax
import jax.numpy as jnp

import credit
import trees
from experiments.models import decoder
from experiments.training import train_step as ts
from trees import packing as packing_lib


def _broadcast_info(info, g):
  return jax.tree.map(lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], g) + x.shape[1:]), info)


@functools.partial(jax.jit, static_argnames=('task',))
def group_rewards(prompts, tokens, mask, info, *, task):
  """[B, P], [B, G, L] -> rewards [B, G]."""
  g = tokens.shape[1]
  p = jnp.broadcast_to(prompts[:, None], (prompts.shape[0], g, prompts.shape[1]))
  return task.reward(p, tokens, mask, _broadcast_info(info, g))


@functools.partial(jax.jit, static_argnames=('task',))
def group_process_rewards(prompts, tokens, mask, info, *, task):
  """[B, P], [B, G, L] -> (token_rewards float32 [B, G, L], step_ends bool [B, G, L]) from
  the task's per-step verifier (`token_rewards`, `step_ends`; the chain-of-thought tasks)."""
  g = tokens.shape[1]
  p = jnp.broadcast_to(prompts[:, None], (prompts.shape[0], g, prompts.shape[1]))
  info = _broadcast_info(info, g)
  return (task.token_rewards(p, tokens, mask, info) * mask,
          task.step_ends(p, tokens, mask, info) & mask)


@functools.partial(jax.jit, static_argnames=('cfg', 'chunks', 'with_entropy'))
def rows_logprobs(params, prompts, tokens, mask, prompt_len=None, packed=None, *, cfg,
                  chunks: int = 1, with_entropy: bool = False):
  """Teacher-forced log-probs of [B, G, L] responses, 0 where masked
  (`with_entropy`: (log-probs, next-token entropies), both 0 where masked).

  `packed`: the groups' `trees.packing.Packing` (one forward per tree) or None (rows).
  `chunks`: the forward runs in sequential parts (`lax.map`): gcd(B * G, chunks) parts
  of rows, or packed, gcd(B, chunks) parts of groups, so the activations and logits
  held at once shrink by that factor; the values are the same. Part i takes rows (or
  groups) i, i + c, i + 2c, ...: with rows split over devices in contiguous blocks
  whose size c divides, every part keeps every device busy on its own rows. The loop
  passes the update step's split (minibatches x micro-batches): without it the old and
  reference passes over a whole rollout batch are what does not fit on a v5e-4
  (experiments/compile_tpu.py, SmolLM2-135M, 256 x 1.5k tokens).
  """
  b, g, l = tokens.shape
  if packed is None:
    n = b * g
    c = math.gcd(n, max(1, int(chunks)))
    rows = lambda x, axis=0: jnp.repeat(x, g, axis=axis)
    prompts_r = rows(prompts)
    plen = None if prompt_len is None else rows(prompt_len)
    parts = (prompts_r, tokens.reshape(n, l), plen)
    pick = (lambda out: out) if with_entropy else (lambda out: out[0])
    part = lambda a: pick(decoder.token_logprobs(params, cfg, *a))
    if c == 1:
      lp = part(parts)
    else:  # [N, ...] -> [c, N / c, ...], part i = rows i, i + c, ...
      split = lambda x: None if x is None else x.reshape((n // c, c) + x.shape[1:]).swapaxes(0, 1)
      lp = jax.tree.map(lambda x: x.swapaxes(0, 1),
                        jax.lax.map(part, tuple(split(x) for x in parts)))
    return jax.tree.map(lambda x: jnp.where(mask, x.reshape(b, g, l), 0.0), lp)
  c = math.gcd(b, max(1, int(chunks)))
  pick = (lambda out: out) if with_entropy else (lambda out: out[0])
  part = lambda a: pick(decoder.packed_token_logprobs(params, cfg, a[0], a[1]))
  if c == 1:
    lp = part((packed, tokens))
  else:  # groups i, i + c, ... per part
    split = lambda x: jax.tree.map(
        lambda a: a.reshape((b // c, c) + a.shape[1:]).swapaxes(0, 1), x)
    lp = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(b, g, l),
                      jax.lax.map(part, (split(packed), split(tokens))))
  return jax.tree.map(lambda x: jnp.where(mask, x, 0.0), lp)


@functools.partial(jax.jit, static_argnames=('cfg',))
def rows_hidden(params, prompts, tokens, mask, prompt_len=None, *, cfg):
  """float32 [B, G, L, D]: the policy's final hidden state at each response position, the
  one predicting the token (`decoder.response_hidden`), 0 where masked; flat rows."""
  b, g, l = tokens.shape
  rows = lambda x: None if x is None else jnp.repeat(x, g, axis=0)
  h = decoder.response_hidden(params, cfg, rows(prompts), tokens.reshape(b * g, l),
                              rows(prompt_len))
  return jnp.where(mask[..., None], h.reshape(b, g, l, -1), 0.0)


@functools.partial(jax.jit, static_argnames=('cfg',))
def prompt_logprobs(params, prompts, prompt_len=None, *, cfg):
  """float32 [B, P]: teacher-forced log π(prompt token t | prompt tokens < t), 0 on the
  first token and on padding (t >= prompt_len); one forward over the B prompts."""
  b, p = prompts.shape
  if p < 2:
    return jnp.zeros((b, p), jnp.float32)
  lp, _ = decoder.token_logprobs(params, cfg, prompts[:, :1], prompts[:, 1:])
  lp = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp], axis=1)
  if prompt_len is None:
    return lp
  return jnp.where(jnp.arange(p)[None, :] < prompt_len[:, None], lp, 0.0)


def prompt_scored(prompt_len, p: int, num_prompts: int = 1):
  """bool [B, P]: the prompt positions `prompt_logprobs` scores (1 <= t < prompt_len; every
  t >= 1 of `num_prompts` rows when prompt_len is None: unpadded prompts)."""
  t = jnp.arange(p)[None, :]
  if prompt_len is None:
    return jnp.broadcast_to(t >= 1, (num_prompts, p))
  return (t >= 1) & (t < jnp.asarray(prompt_len)[:, None])


def context_prompts(problem, draw, prompts, prompt_len):
  """(prompts, prompt_len) of the changed context for `Rollouts.context_logprobs` (GCPO,
  PGPO): the task's `context_prompts(prompts, info)` if it defines one (a JAX task; same
  shape, prompt_len unchanged), else the prompt of the next group in the batch (a roll by
  one, lengths too): "the same kind of problem, another instance", defined for every task.
  With one prompt per step the roll is the identity, so the context does not change."""
  hook = getattr(getattr(problem, 'task', None), 'context_prompts', None)
  if hook is not None and not isinstance(draw.handle, list):
    return hook(prompts, draw.handle), prompt_len
  return _roll_prompts(prompts, prompt_len)


@jax.jit
def _roll_prompts(prompts, prompt_len):
  return (jnp.roll(prompts, -1, axis=0),
          None if prompt_len is None else jnp.roll(prompt_len, -1, axis=0))


def packing_applies(cfg, num_groups: int, num_devices: int = 1) -> bool:
  """Whether the update step packs each group's tree (`cfg.train.packing` != 'none').

  Packed minibatches and micro-batches take whole groups, so the groups must divide
  into num_minibatches * num_microbatches parts, each split evenly over the devices
  that hold rows (`packs_evenly`); otherwise the step runs flat rows (same loss).
  """
  split = cfg.loss.num_minibatches * cfg.loss.num_microbatches
  return cfg.train.packing != 'none' and packs_evenly(num_groups, split, num_devices)


def packs_evenly(num_groups: int, split: int, num_devices: int) -> bool:
  """Whether `split` parts of the groups each spread evenly over `num_devices`.

  Otherwise a device would hold a share of a packed group, which the packed layout
  does not split: measured with experiments/compile_tpu.py, Llama-3.1-8B with 32 groups
  of 8 x (512 + 1024) tokens packed over 64 chips computed replicated packed log-probs
  (40 GiB of temporaries per chip) where the flat rows fit."""
  return num_groups % (split * num_devices) == 0


def pack_groups(tcfg, prompts, samples, prompt_len=None, min_len: int = 0):
  """The packed trees (`trees.packing.Packing`) of a batch's groups (prompts [B, P],
  samples [B, G, L]).

  pack_len: `tcfg.pack_len`, or for 0 the smallest of 8 evenly spaced buckets in
  (P, P + G * L] that holds the largest group and is >= `min_len` (the loop passes
  the last length, so a run compiles a new shape only when its trees grow).
  """
  tokens, mask = samples.tokens, samples.mask
  node = node_ids(tokens, mask, mode=tcfg.packing)
  need = prompts.shape[1] + int(ts.host_value(_num_unique(node)).max())
  g, l = tokens.shape[1:]
  pack_len = tcfg.pack_len or max(min_len, packing_lib.bucket_len(need, prompts.shape[1], g, l))
  return packing_lib.pack(prompts, tokens, mask, prompt_len, pack_len=pack_len,
                          mode=tcfg.packing, node=node, attention=tcfg.pack_attention)


node_ids = jax.jit(packing_lib.node_ids, static_argnames=('mode',))


_num_unique = jax.jit(lambda node: packing_lib.num_unique(node, 1 + node.shape[1] * node.shape[2]))


@functools.lru_cache(maxsize=None)
def credit_fn(name: str, hparams_json: str, tree: bool, with_state: bool = False):
  """Jitted estimator (tree building included) for rollouts [B, G, L].

  Returns fn(tokens, mask, rewards, parent, fork, logprobs, ref_logprobs, token_rewards=None,
  step_ends=None, policy_mask=None, turns=None, *, entropy=None, prompt_logprobs=None,
  prompt_mask=None, context_logprobs=None, saliency=None, credit_state=None, values=None,
  step_probes=None, hindsight_logprobs=None, row_mask=None, prompt_ids=None, ref_rewards=None,
  hidden_states=None, extras=None) ->
  (advantages, loss mask);
  ref_logprobs and the optional ones may be None (policy_mask and turns: multi-turn
  trajectories; the keyword ones: the `credit.Rollouts` fields of the same names).
  `with_state` (a stateful estimator): -> (advantages, loss mask, the state after this
  batch, `credit.update_state`), in the same call.
  """
  est, hp = credit.get(name), json.loads(hparams_json)

  @jax.jit
  def fn(tokens, mask, rewards, parent, fork, logprobs, ref_logprobs, token_rewards=None,
         step_ends=None, policy_mask=None, turns=None, *, entropy=None, prompt_logprobs=None,
         prompt_mask=None, context_logprobs=None, saliency=None, credit_state=None,
         values=None, step_probes=None, hindsight_logprobs=None, row_mask=None, prompt_ids=None,
         ref_rewards=None, hidden_states=None, extras=None):
    t = trees.from_forks(tokens, mask, parent, fork) if tree else None
    rollouts = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, logprobs=logprobs,
                               ref_logprobs=ref_logprobs, tree=t, token_rewards=token_rewards,
                               step_ends=step_ends, policy_mask=policy_mask, turns=turns,
                               entropy=entropy, prompt_logprobs=prompt_logprobs,
                               prompt_mask=prompt_mask, context_logprobs=context_logprobs,
                               saliency=saliency, credit_state=credit_state, values=values,
                               step_probes=step_probes,
                               hindsight_logprobs=hindsight_logprobs, row_mask=row_mask,
                               parent=parent if tree else None, fork=fork if tree else None,
                               prompt_ids=prompt_ids, ref_rewards=ref_rewards,
                               hidden_states=hidden_states, extras=extras)
    adv = est(rollouts, **hp)
    keep = credit.loss_mask(name, rollouts, adv, **hp)
    if not with_state:
      return adv, keep
    return adv, keep, credit.update_state(name, credit_state, rollouts, **hp)

  return fn
