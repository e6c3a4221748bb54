"""Value-guided decoding (controlled decoding, #205; V-STAR's value-guided decoding, #179):
a learned prefix scorer steers sampling block by block.

Each of the G responses to a prompt keeps K candidate rows. Per block of `block_len` tokens,
every candidate samples the block from the policy; the scorer rates each candidate's prefix
(`value_fn`: a learned value of the state after the block, `experiments.training.critic`),
and the K candidates of the next block all fork from the best one (its KV cache copied). At
the end the best candidate of each response is kept. Candidate k of response g draws its
tokens from its own uniform stream (id g·K + k, `sampling.response_uniforms`) at every
block, so with K = 1 the output is `sampling.sample_iid`'s, token for token. The sampled
tokens' log-probs are the policy's; the selection makes the output off-policy (an inference
procedure, not a training sampler). Cost: K times the tokens of i.i.d. sampling and one
scorer forward over the K·G rows per block.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments.rollouts import sampling


@jax.jit
def best_rows(scores):
  """scores [B, G, K] -> the flat row (prompt-major, then response, then candidate) of each
  response's best candidate, repeated K times: [B·G·K] (the next block's sources)."""
  b, g, k = scores.shape
  best = jnp.argmax(scores, -1)  # [B, G]
  rows = (jnp.arange(b)[:, None] * g + jnp.arange(g)[None, :]) * k + best
  return jnp.repeat(rows.reshape(-1), k)


@jax.jit
def _score_positions(state):
  """Where a candidate's value is read: the state after its last sampled token (index), or,
  for a finished candidate, the state before its EOS (the scorer never saw later states)."""
  length = state.tokens.shape[1]
  return jnp.clip(jnp.where(state.done, state.index - 1, state.index), 0, length - 1)


def sample_value_guided(params, cfg, key, prompts, num_samples: int, num_candidates: int,
                        block_len: int, max_new_tokens: int, *, value_fn, temperature=1.0,
                        top_p=1.0, top_k=0, eos_id=None, pad_id: int = 0, prompt_len=None,
                        prompt_ids=None) -> sampling.Samples:
  """Samples [B, G, L] (G = num_samples) chosen block by block among K = num_candidates
  candidates by `value_fn(tokens [N, L], mask [N, L]) -> values [N, L]` (V before each
  token), N = B·G·K rows in prompt-major order."""
  if block_len < 1 or num_candidates < 1:
    raise ValueError(f'need block_len >= 1 and num_candidates >= 1; got {block_len}, '
                     f'{num_candidates}')
  prompts, prompt_len, prompt_ids, knobs = sampling._inputs(
      cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p)
  b, g, k, l = prompts.shape[0], num_samples, num_candidates, max_new_tokens
  u = sampling._uniforms_jit(key, prompt_ids, np.arange(g * k, dtype=np.int32), length=l)
  state = sampling._start(params, prompts, u, prompt_len, cfg=cfg, pad_id=pad_id)
  for block in range(math.ceil(l / block_len)):
    state = sampling._decode(params, state, min((block + 1) * block_len, l), knobs, cfg=cfg,
                             eos_id=eos_id)
    values = value_fn(state.tokens, state.mask)
    scores = jnp.take_along_axis(values, _score_positions(state)[:, None], 1)[:, 0]
    rows = best_rows(scores.reshape(b, g, k))
    state = sampling._fork(state, rows, state.index[rows], u.reshape(b * g * k, l),
                           pad_id=pad_id)
  chosen = sampling._to_samples(state, b)  # every candidate is now a copy of the best
  return jax.tree.map(lambda x: x[:, ::k], chosen)
