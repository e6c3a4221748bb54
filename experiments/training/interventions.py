"""InT's intervention phase (#131): before RL, fine-tune on the policy's own failures with
their first wrong step replaced by the reference's (`credit` estimator `intervention`).

Each of `steps` phase steps draws a batch of training prompts, samples the run's group of
responses to each with the current phase params, and lets the task build one intervention
per response that is not fully right (`task.interventions`: the valid prefix kept, the
demonstration's step in place of the first wrong one, the loss on that step only;
scratch_add). One SFT step (its own Adam at `lr`, no warm-up) on those rows follows. RL then
starts from the phase's params with a fresh optimizer; the KL reference stays the warm start.
The phase's sampled tokens are counted in the run's generated tokens.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.training import train_step as ts


@functools.partial(jax.jit, static_argnames=('task',))
def rows(prompts, tokens, mask, info, *, task):
  """InT's rows of B·G responses [B, G, L] to prompts [B, P]: (prompts [N, P], tokens
  [N, L], loss_mask [N, L], ok [N]) from the task's `interventions`."""
  b, g, l = tokens.shape
  rep = lambda x: jnp.repeat(x, g, 0)
  out, loss_mask, ok = task.interventions(rep(prompts), tokens.reshape(b * g, l),
                                          mask.reshape(b * g, l), jax.tree.map(rep, info))
  return rep(prompts), out, loss_mask, ok


def phase(params, problem, sample_fn, key, *, steps: int, batch: int, lr: float):
  """(params after the phase, info: intervention_rows, intervention_loss (last step),
  intervention_generated_tokens, intervention_s). `sample_fn(params, key, draw)` samples
  the run's [B, G, L] responses to a `problem.draw`."""
  if 'interventions' not in problem.capabilities:
    raise ValueError('the intervention phase (InT) needs a JAX task that builds '
                     'single-step interventions (`interventions`: scratch_add)')
  t0 = time.perf_counter()
  state = ts.init_state(jax.tree.map(jnp.copy, params), ts.make_optimizer(lr), seed=0)
  n_rows, generated, loss = 0, 0.0, float('nan')
  for j in range(steps):
    draw = problem.draw(jax.random.fold_in(key, 2 * j), -1 - j, batch)
    samples = sample_fn(state.params, jax.random.fold_in(key, 2 * j + 1), draw)
    generated += float(jnp.sum(samples.mask))
    prompts, tokens, loss_mask, ok = problem.interventions(draw, samples)
    n = int(np.sum(np.asarray(ok)))
    if n == 0:  # nothing to fix in this batch: no step (Adam would still move)
      continue
    state, m = ts.sft_step_jit(state, prompts, tokens, loss_mask, cfg=problem.pcfg)
    n_rows, loss = n_rows + n, float(m['loss'])
  return state.params, dict(intervention_rows=n_rows, intervention_loss=loss,
                            intervention_generated_tokens=generated,
                            intervention_s=time.perf_counter() - t0)
