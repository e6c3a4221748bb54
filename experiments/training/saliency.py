"""Per-token gradient saliency of sampled responses (GRAIL, #55): one extra backward pass.

    sal = saliency.token_saliency(params, prompts, tokens, mask, prompt_len, cfg=pcfg)

The target is the response's log-likelihood J = Σ_s m_s log π(y_s | x, y_<s) over the
response tokens in `target_mask` (all of `mask` by default; the policy's own tokens for
multi-turn trajectories), or over its last `answer_tokens` of them (`answer_tokens` > 0:
"how sensitive is the final answer to this token", the abstract's reading). Token t's
saliency is taken at its input embedding e_t (the embedding of y_t where it is fed back
to predict y_{t+1}, ...):

  kind='grad_norm'     s_t = ||∂J/∂e_t||₂                      (the default)
  kind='grad_x_input'  s_t = |<∂J/∂e_t, e_t>|                    (gradient × activation)

so a token's saliency measures how much the *later* tokens' likelihood depends on it; the
last token of a response (never fed back inside it) gets 0. Returns float32 [B, G, L],
0 off `mask`. The gradient w.r.t. each position's embedding is taken by adding a zero
perturbation to the embedding layer's output (`flax.linen.intercept_methods`), so it is
per position, not per vocabulary row, and the decoder is unchanged.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from experiments.models import decoder

KINDS = ('grad_norm', 'grad_x_input')


def _embedding_grads(params, cfg, prompts, responses, weights, prompt_len):
  """(∂J/∂e [N, T, D], e [N, T, D]) at the T = P + L − 1 input positions of
  `decoder.token_logprobs`, J = Σ_t weights[:, t] · log π(responses[:, t])."""
  n, p = prompts.shape
  l = responses.shape[1]
  shape = (n, p + l - 1, cfg.d_model)
  captured = {}

  def loss(delta):
    def add_delta(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if isinstance(context.module, nn.Embed) and context.method_name == '__call__':
        if out.shape != delta.shape:  # only the one input embedding of the forward
          raise ValueError(f'saliency: embedding output {out.shape} != {delta.shape}')
        captured['e'] = out
        return out + delta.astype(out.dtype)
      return out

    with nn.intercept_methods(add_delta):
      lp, _ = decoder.token_logprobs(params, cfg, prompts, responses, prompt_len)
    return jnp.sum(weights * lp), captured['e'].astype(jnp.float32)

  grad, emb = jax.grad(loss, has_aux=True)(jnp.zeros(shape, jnp.float32))
  return grad, emb


def _row_saliency(params, cfg, prompts, responses, mask, target, prompt_len, kind,
                  answer_tokens):
  """Saliency [N, L] of N flat rows (see the module docstring)."""
  n, p = prompts.shape
  l = responses.shape[1]
  target = target & mask
  if answer_tokens > 0:  # only the last `answer_tokens` target tokens of each row
    after = jnp.cumsum(target[:, ::-1], axis=1)[:, ::-1]  # target tokens at or after t
    target = target & (after <= answer_tokens)
  grad, emb = _embedding_grads(params, cfg, prompts, responses, target.astype(jnp.float32),
                               prompt_len)
  plen = (jnp.full((n,), p, jnp.int32) if prompt_len is None
          else jnp.asarray(prompt_len, jnp.int32))
  pos = plen[:, None] + jnp.arange(l)[None, :]  # where response token t is fed, [N, L]
  fed = pos < p + l - 1
  idx = jnp.minimum(pos, p + l - 2)[..., None]
  g = jnp.take_along_axis(grad, idx, axis=1)
  if kind == 'grad_norm':
    s = jnp.sqrt(jnp.sum(g * g, axis=-1))
  else:
    s = jnp.abs(jnp.sum(g * jnp.take_along_axis(emb, idx, axis=1), axis=-1))
  return jnp.where(mask & fed, s, 0.0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=('cfg', 'kind', 'answer_tokens', 'chunks'))
def token_saliency(params, prompts, tokens, mask, prompt_len=None, target_mask=None, *, cfg,
                   kind: str = 'grad_norm', answer_tokens: int = 0, chunks: int = 1):
  """Gradient saliency float32 [B, G, L] of responses tokens [B, G, L] to prompts [B, P].

  `target_mask` bool [B, G, L] (default `mask`): the tokens whose log-likelihood is the
  target J. `chunks`: the rows run in gcd(B·G, chunks) sequential parts (as
  `loop.rows_logprobs`; same values, less memory at once).
  """
  if kind not in KINDS:
    raise ValueError(f'unknown saliency kind {kind!r}; valid: {", ".join(KINDS)}')
  if answer_tokens < 0:
    raise ValueError(f'answer_tokens must be >= 0 (0: the whole response); got {answer_tokens}')
  b, g, l = tokens.shape
  n = b * g
  target = mask if target_mask is None else target_mask
  rows = lambda x: None if x is None else jnp.repeat(x, g, axis=0)
  parts = (rows(prompts), tokens.reshape(n, l), mask.reshape(n, l), target.reshape(n, l),
           rows(prompt_len))
  part = lambda a: _row_saliency(params, cfg, *a, kind, answer_tokens)
  c = math.gcd(n, max(1, int(chunks)))
  if c == 1:
    return part(parts).reshape(b, g, l)
  split = lambda x: None if x is None else x.reshape((n // c, c) + x.shape[1:]).swapaxes(0, 1)
  out = jax.lax.map(part, tuple(split(x) for x in parts)).swapaxes(0, 1)
  return out.reshape(b, g, l)
