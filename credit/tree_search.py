"""Credit for search trees (issue 23's tree-search family): ELPO (#39), TreePS-RAG (#181).

Both read the group's prefix tree (the sampler's explicit tree when it has one: 'tree_bisect'
and 'tree_steps', experiments/rollouts/step_forks.py, fork at reasoning-step boundaries;
else the shared prefixes of i.i.d. responses).
"""

import jax.numpy as jnp

import trees
from credit.outcome import grpo_per_response
from credit.registry import register
from credit.rollouts import Rollouts, tree_of
from credit.values import mc_values


@register("elpo")
def elpo(rollouts: Rollouts, success: float = 1.0, scale_by_std: bool = True,
         eps: float = 1e-6):
  """ELPO (#39): error-localised credit. A prefix is recoverable when a response of the
  group through it succeeded (reward ≥ `success`): its prefix-tree value of successes is
  above 0, V_win(s_{t+1}) > 0 (with 'tree_bisect' these values are the binary search's
  outcomes at each probed step boundary). A response below its group's mean keeps its
  negative GRPO advantage A_i only from its first irrecoverable token on (the step that
  lost the task and its suffix); its recoverable prefix gets 0. Responses at or above the
  mean keep A_i everywhere. Readings: the hierarchical attribution is this split of a
  failure into an exonerated prefix and a blamed error-and-suffix; the adaptive clipping on
  that step is not built. With no failure sharing a prefix with a success it is GRPO
  exactly. Returns float32 [..., G, L], 0 on masked tokens.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  adv = grpo_per_response(rewards, scale_by_std=scale_by_std, eps=eps)
  tree = tree_of(rollouts)
  _, won_after = trees.prefix_values(tree, (rewards >= success).astype(jnp.float32))
  adv = jnp.where((adv[..., None] < 0) & (won_after > 0), 0.0, adv[..., None])
  return jnp.where(tree.mask, adv, 0.0)


@register("treeps", needs=("step_ends",))
def treeps(rollouts: Rollouts, scale_by_std: bool = True, eps: float = 1e-6):
  """TreePS-RAG (#181): a rollout tree over reasoning steps (sampler 'tree_steps': every
  response forks at its ℓ-th step boundary, level by level), each step's utility the Monte
  Carlo mean of its descendants' outcomes, and the process advantage of step j the change
  in utility across it: A = V̂(end of step j) − V̂(its start) on the step's tokens, divided
  by the group's reward σ + ε (`scale_by_std`, GRPO's scale). This is `mc_values` at step
  granularity; along a response the steps' credit telescopes to R_i − μ. Reading: no
  separate outcome term (the last step's change carries it). Returns float32 [..., G, L].
  """
  return mc_values(rollouts, granularity="step", scale_by_std=scale_by_std, eps=eps)
