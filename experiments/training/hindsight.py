"""The hindsight context of `credit.Rollouts.hindsight_logprobs` (PBSD #164, HCAPO #9): the
prompt followed by the task's gold answer, so one teacher-forced pass scores the responses
under a privileged, answer-conditioned teacher (the same policy, the answer in context); for
SIOP (#75) each response's own answer instead (`own_answer_prompts`). `hinted_demonstrations`:
a warm start's demonstrations with the answer after some of their prompts
(`sft.hindsight_frac`).

The answer is the task's demonstration after its `reasoning_steps` step ends, without its
EOS (scratch_add: the sum's digits; countdown_steps: the expression). Prompts are [B, P]
right-padded to `prompt_len` (None: all P); the hint goes right after each prompt's true
length, so the hindsight prompts are [B, P + R] with lengths prompt_len + answer length.
"""

import functools

import jax
import jax.numpy as jnp

import credit
from experiments.training.probes import probe_cuts


def answer_hint(task, prompts, info):
  """(hint int32 [B, R], hint_len int32 [B]): the demonstration's answer (pad after)."""
  demo, demo_mask = task.demonstrations(prompts, info)  # [B, R]
  ends = task.step_ends(prompts, demo, demo_mask, info)
  s = int(task.reasoning_steps)
  cuts, _ = probe_cuts(ends, demo_mask, s)
  start = cuts[:, s]  # after the S-th step end: the answer
  stop = jnp.sum(demo_mask, -1) - 1  # EOS excluded
  r = demo.shape[-1]
  src = start[:, None] + jnp.arange(r)
  n = jnp.maximum(stop - start, 0)
  hint = jnp.take_along_axis(demo, jnp.clip(src, 0, r - 1), -1)
  return jnp.where(jnp.arange(r) < n[:, None], hint, task.pad_id).astype(jnp.int32), n


def with_hint(prompts, prompt_len, hint, hint_len, pad_id: int):
  """(prompts [B, P + R], prompt_len [B]): each prompt's tokens, then its hint, then pad."""
  b, p = prompts.shape
  r = hint.shape[-1]
  plen = jnp.full((b,), p, jnp.int32) if prompt_len is None else jnp.asarray(prompt_len,
                                                                              jnp.int32)
  t = jnp.arange(p + r)[None, :]
  wide = jnp.concatenate([prompts, jnp.full((b, r), pad_id, prompts.dtype)], -1)
  src = jnp.clip(t - plen[:, None], 0, r - 1)
  hinted = jnp.take_along_axis(hint.astype(prompts.dtype), src, -1)
  inside = (t >= plen[:, None]) & (t < (plen + hint_len)[:, None])
  out = jnp.where(t < plen[:, None], wide, jnp.where(inside, hinted, pad_id))
  return out, plen + hint_len


@functools.partial(jax.jit, static_argnames=('task',))
def hindsight_prompts(prompts, prompt_len, info, *, task):
  """The answer-conditioned prompts of a JAX chain-of-thought task: (prompts, lengths)."""
  hint, n = answer_hint(task, prompts, info)
  return with_hint(prompts, prompt_len, hint, n, task.pad_id)


@functools.partial(jax.jit, static_argnames=('pad_id',))
def own_answer_prompts(prompts, prompt_len, tokens, mask, step_ends, *, pad_id: int):
  """(prompts [B·G, P + L], prompt_len [B·G]): row i·G + j is prompt i followed by response
  (i, j)'s own final answer (`credit.hindsight.final_answers`; none for a response without
  one) for responses tokens/mask/step_ends [B, G, L]: SIOP's pass."""
  b, g, l = tokens.shape
  answer, length, _ = credit.hindsight.final_answers(tokens, mask, step_ends)
  rows = lambda x: None if x is None else jnp.repeat(jnp.asarray(x), g, axis=0)
  plen = None if prompt_len is None else rows(prompt_len)
  return with_hint(rows(prompts), plen, jnp.where(answer < 0, pad_id, answer).reshape(b * g, l),
                   length.reshape(b * g), pad_id)


@functools.partial(jax.jit, static_argnames=('task', 'n', 'frac'))
def hinted_demonstrations(key, *, task, n: int, frac: float):
  """(prompts [n, P + R], prompt_len [n], responses [n, R], mask): `n` demonstrations, each
  prompt followed by its answer with probability `frac`."""
  k1, k2 = jax.random.split(key)
  prompts, info = task.sample(k1, n)
  responses, mask = task.demonstrations(prompts, info)
  hint, hint_len = answer_hint(task, prompts, info)
  hint_len = jnp.where(jax.random.uniform(k2, (n,)) < frac, hint_len, 0)
  wide, plen = with_hint(prompts, None, hint, hint_len, task.pad_id)
  return wide, plen, responses, mask
