"""Hinted sampling (sampler 'hinted'): some responses of a group start with a prefix of the
task's demonstration (its first k reasoning steps, a "hint"), and the policy writes the
rest. ADHint (#94, `adhint`) and MCTS-staged GRPO (#62, `grpo:hinted`).

A hinted row's response is hint ⊕ continuation: the whole of it is scored by the task, its
`policy_mask` holds the continuation only (the hint is context: not trained, not counted as
generated). Rows [0, hint_rows) of each group get hints, the others none. k per prompt:

  'staged' (MCTS-staged GRPO): k = ⌊S · (1 − step / steps)⌋, the revealed part of the
      reference shrinking from all S reasoning steps (the policy writes the answer) to none
      over training (a reverse curriculum over the prefixes of one solution path, in place
      of MCTS's);
  'difficulty' (ADHint's sample-difficulty prior): k = min(S, ⌊S · d⌋), d = 1 −
      exp(mean log π(demonstration | prompt)), one teacher-forced pass before sampling: a
      prompt whose reference the policy finds unlikely gets a longer hint.

Sampling runs one row per hinted prompt (prompt ⊕ hint, right-padded), so the prefix KV
reuse of i.i.d. groups is lost; the decoder's cache is widened by R for these rows.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from experiments.models import decoder
from experiments.rollouts import sampling
from experiments.training.hindsight import with_hint
from experiments.training.probes import probe_cuts

SCHEDULES = ('staged', 'difficulty')


@struct.dataclass
class HintedSamples:
  """`sampling.Samples` [B, G, L] with the hint's tokens in front and a `policy_mask` on the
  continuation; `hint_len` [B, G]."""
  tokens: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  mask: jax.Array
  parent: jax.Array
  fork: jax.Array
  policy_mask: jax.Array
  hint_len: jax.Array

  @property
  def lengths(self) -> jax.Array:
    return self.mask.sum(-1).astype(jnp.int32)


def difficulty(params, pcfg, task, prompts, info):
  """float32 [B]: 1 − exp(mean log π(demonstration | prompt)) (ADHint's difficulty prior)."""
  demo, demo_mask = task.demonstrations(prompts, info)
  lp, _ = decoder.token_logprobs(params, pcfg, prompts, demo)
  n = jnp.maximum(jnp.sum(demo_mask, -1), 1)
  return 1.0 - jnp.exp(jnp.sum(jnp.where(demo_mask, lp, 0.0), -1) / n)


def hint_steps(schedule: str, num_steps: int, progress=None, hardness=None):
  """int32 [B] (or scalar): k, the reasoning steps revealed (see the module docstring)."""
  if schedule == 'staged':
    k = jnp.floor(num_steps * (1.0 - jnp.asarray(progress, jnp.float32)))
  else:
    k = jnp.floor(num_steps * jnp.asarray(hardness, jnp.float32))
  return jnp.clip(k, 0, num_steps).astype(jnp.int32)


def assemble(hint, hint_len, cont, length: int, pad_id: int):
  """Rows hint ⊕ continuation cut to `length`: (tokens, mask, policy_mask, logprobs,
  entropy) [N, length] from hint [N, R], hint_len [N] and continuation `Samples` [N, 1, L]."""
  t = jnp.arange(length)[None, :]
  h = hint_len[:, None]
  src = jnp.clip(t - h, 0, cont.tokens.shape[-1] - 1)
  pick = lambda x: jnp.take_along_axis(x[:, 0], src, -1)
  on_cont = (t >= h) & pick(cont.mask)
  in_hint = t < h
  tokens = jnp.where(in_hint, jnp.take_along_axis(hint, jnp.clip(t, 0, hint.shape[-1] - 1), -1),
                     jnp.where(on_cont, pick(cont.tokens), pad_id))
  zero = lambda x: jnp.where(on_cont, pick(x), 0.0)
  return tokens, in_hint | on_cont, on_cont, zero(cont.logprobs), zero(cont.entropy)


@functools.partial(jax.jit, static_argnames=('pcfg', 'task', 'group_size', 'hint_rows',
                                             'schedule', 'temperature', 'top_p', 'top_k'))
def sample_hinted(params, key, prompts, info, progress, *, pcfg, task, group_size: int,
                  hint_rows: int, schedule: str, temperature: float, top_p: float,
                  top_k: int) -> HintedSamples:
  """Samples [B, G, L]: rows [0, hint_rows) of each group after the hint of their prompt
  (k by `schedule`), the others unhinted. `progress` = step / steps ('staged')."""
  if schedule not in SCHEDULES:
    raise ValueError(f"hint_schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
  b, g, l = prompts.shape[0], group_size, task.response_len
  s = int(task.reasoning_steps)
  demo, demo_mask = task.demonstrations(prompts, info)
  cuts, _ = probe_cuts(task.step_ends(prompts, demo, demo_mask, info), demo_mask, s)
  k = (hint_steps(schedule, s, progress=progress) * jnp.ones(b, jnp.int32)
       if schedule == 'staged'
       else hint_steps(schedule, s, hardness=difficulty(params, pcfg, task, prompts, info)))
  per_prompt = jnp.take_along_axis(cuts, k[:, None], -1)[:, 0]  # hint tokens of each prompt
  hint_len = jnp.where(jnp.arange(g)[None, :] < hint_rows, per_prompt[:, None], 0)  # [B, G]
  rows = lambda x: jnp.repeat(x, g, 0)
  hint = rows(demo)
  wide, plen = with_hint(rows(prompts), None, hint, hint_len.reshape(-1), task.pad_id)
  wide_cfg = dataclasses.replace(pcfg, max_len=wide.shape[1] + l)
  cont = sampling.sample_iid(params, wide_cfg, key, wide, 1, l, temperature=temperature,
                             top_p=top_p, top_k=top_k, eos_id=task.eos_id, pad_id=task.pad_id,
                             prompt_len=plen)
  tokens, mask, policy, lp, ent = assemble(hint, hint_len.reshape(-1), cont, l, task.pad_id)
  shape = lambda x: x.reshape((b, g) + x.shape[1:])
  zeros = jnp.zeros((b, g), jnp.int32)
  return HintedSamples(tokens=shape(tokens), logprobs=shape(lp), entropy=shape(ent),
                       mask=shape(mask), parent=zeros - 1, fork=zeros,
                       policy_mask=shape(policy), hint_len=hint_len)
