"""Gold-continuation probes at reasoning-step boundaries: `credit.StepProbes` for SPAE,
P2S and MIG (credit/probes.py).

Probe k of a response scores the task's demonstration from its (k+1)-th step on (its
remaining steps, answer and EOS) teacher-forced after the prompt and the response's first k
steps: one forward per k = 0 .. S over rows of prompt + response prefix + continuation
(padded to L + R), S = `task.reasoning_steps`. It is the answer-forcing probe of these
papers for a task whose format puts the answer only after every step (scratch_add): the
gold path from here on, rather than the bare answer. Cost: S + 1 teacher-forced passes over
B·G rows of P + L + R tokens (no backward).
"""

import functools

import jax
import jax.numpy as jnp

from credit.rollouts import StepProbes
from experiments.models import decoder


def probe_cuts(step_ends, mask, num_steps: int):
  """(cuts int32 [..., S+1], ok bool [..., S+1]) of responses [..., L]: cut k is the
  position after the k-th step end (0 for k = 0), ok where k = 0 or the response has more
  than k step ends (its k-th step is closed and is not its last)."""
  ends = jnp.asarray(step_ends, bool) & jnp.asarray(mask, bool)
  count = jnp.cumsum(ends, -1)
  k = jnp.arange(1, num_steps + 1)
  # Position of the k-th end: the number of positions before it with fewer than k ends.
  pos = jnp.sum(count[..., None, :] < k[:, None], -1)  # [..., S]
  cuts = jnp.concatenate([jnp.zeros_like(pos[..., :1]), pos + 1], -1).astype(jnp.int32)
  total = count[..., -1:]
  ok = jnp.concatenate([jnp.ones_like(total, bool), k < total], -1)
  return jnp.where(ok, cuts, 0), ok


@functools.partial(jax.jit, static_argnames=('cfg', 'task'))
def step_probes(params, prompts, tokens, mask, step_ends, info, *, cfg, task) -> StepProbes:
  """`StepProbes` [B, G, S+1] of responses tokens/mask/step_ends [B, G, L] to prompts
  [B, P] (info: the task's per-prompt info, [B, ...]) under policy `params`."""
  b, g, l = tokens.shape
  s = int(task.reasoning_steps)
  demo, demo_mask = task.demonstrations(prompts, info)  # [B, R]
  demo_ends = task.step_ends(prompts, demo, demo_mask, info)
  starts, _ = probe_cuts(demo_ends, demo_mask, s)  # [B, S+1]: the demo has S steps + answer
  demo_len = jnp.sum(demo_mask, -1)
  r = demo.shape[-1]
  cuts, ok = probe_cuts(step_ends, mask, s)  # [B, G, S+1]
  t = jnp.arange(l + r)
  rows = jnp.concatenate([tokens, jnp.full((b, g, r), task.pad_id, tokens.dtype)], -1)
  row_prompts = jnp.repeat(prompts, g, axis=0)

  def one(k):  # probe k of every row
    cut = cuts[..., k][..., None]  # [B, G, 1]
    src = starts[:, None, k, None] + t - cut  # the demonstration position at t
    scored = (t >= cut) & (src < demo_len[:, None, None])
    cont = jnp.take_along_axis(jnp.broadcast_to(demo[:, None], (b, g, r)),
                               jnp.clip(src, 0, r - 1), -1)
    x = jnp.where(t < cut, rows, jnp.where(scored, cont, task.pad_id))
    lp, ent = decoder.token_logprobs(params, cfg, row_prompts, x.reshape(b * g, l + r))
    n = jnp.maximum(jnp.sum(scored, -1), 1)
    mean = lambda v: jnp.sum(jnp.where(scored, v.reshape(b, g, l + r), 0.0), -1) / n
    return mean(lp), mean(ent)

  lp, ent = jax.lax.map(one, jnp.arange(s + 1))  # [S+1, B, G]
  lp, ent = jnp.moveaxis(lp, 0, -1), jnp.moveaxis(ent, 0, -1)
  return StepProbes(logprobs=jnp.where(ok, lp, 0.0), entropy=jnp.where(ok, ent, 0.0), mask=ok)
