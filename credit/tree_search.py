"""Credit for search trees (issue 23's tree-search family): ELPO (#39).

`elpo` reads the group's prefix tree (the sampler's explicit tree when it has one, e.g.
'tree_bisect', experiments/rollouts/bisect.py, which forks every chain at binary-searched
step boundaries; else the shared prefixes of i.i.d. responses).
"""

import jax.numpy as jnp

import trees
from credit.outcome import grpo_per_response
from credit.registry import register
from credit.rollouts import Rollouts, tree_of


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
