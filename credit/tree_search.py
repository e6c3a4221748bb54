"""Credit for search trees (issue 23's tree-search family): ELPO (#39), TreePS-RAG (#181),
APPO (#35).

ELPO and TreePS-RAG read the group's prefix tree (the sampler's explicit tree when it has one:
'tree_bisect' and 'tree_steps', experiments/rollouts/step_forks.py, fork at reasoning-step
boundaries; else the shared prefixes of i.i.d. responses); APPO reads the sampler's fork
edges (`Rollouts.parent`, `Rollouts.fork`).
"""

import jax.numpy as jnp

import trees
from credit.groups import all_equal
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


def _subgroup_advantages(rewards, rows, scale_by_std: bool, eps: float):
  """APPO's GRPO over the True `rows` of each group: (R − μ) / (σ + ε), population σ (the
  authors' code); 0 off the rows and in a subgroup whose rewards are all equal (one row
  included). [..., G] -> [..., G]."""
  n = jnp.maximum(jnp.sum(rows, -1, keepdims=True), 1)
  mean = jnp.sum(jnp.where(rows, rewards, 0.0), -1, keepdims=True) / n
  adv = rewards - mean
  if scale_by_std:
    adv = adv / (jnp.sqrt(jnp.sum(jnp.where(rows, adv ** 2, 0.0), -1, keepdims=True) / n) + eps)
  return jnp.where(rows & ~all_equal(rewards, rows), adv, 0.0)


def _appo_mask(rollouts: Rollouts, adv, **_):
  """APPO trains the initial rollouts only: branch rows (`parent` ≥ 0) leave the loss."""
  if rollouts.parent is None:
    return rollouts.trained_mask
  return rollouts.trained_mask & (rollouts.parent < 0)[..., None]


@register("appo", loss_mask=_appo_mask)
def appo(rollouts: Rollouts, prefix_credit: bool = True, scale_by_std: bool = True,
         eps: float = 1e-6):
  """APPO (#35): dual-group advantages over initial rollouts and their branches, as the
  authors' public code computes them (AMAP-ML/APPO, `compute_appo_advantage`; the abstract's
  "procedure-level" credit across branched rollouts).

  The initial rollouts (roots, `parent` < 0) and the branches (forked from them, `parent` ≥
  0) are normalised as two separate GRPO groups: A_i = (R_i − μ_init) / (σ_init + ε), A_b =
  (R_b − μ_branch) / (σ_branch + ε) (population σ, as the authors' code, not `grpo`'s
  Bessel-corrected one; a group of one or with equal rewards gets 0). An initial rollout i
  gets A_i on every token plus, on each token t it shares with its branches (t < fork_b),
  the mean of A_b over its branches b with t < fork_b: the prefix up to a branch point is
  credited with how well continuations from there did against the other branch points'
  continuations. Branches get 0 and leave the loss (`loss_mask`): they only supply that
  contrast (`prefix_credit` False drops it: GRPO on the initial rollouts alone, the branches
  still out of the loss, an ablation). Without forks (`parent` None) every response is a
  root: GRPO with the population σ (`grpo` exactly without `scale_by_std`).

  Readings and what is not here: the code's "reward scale M" (1 + (BS / max BS)·0.9^{s−t}
  on the token-level rewards at and before branch token s, before the advantage) multiplies
  only rewards that sit at or before a branch token; the outcome reward sits on the last
  token and our samplers fork strictly before it (a fork re-samples a generated token), so
  M is exactly 1 here and is not an option. The branch points come from the sampler
  ('tree_branching', experiments/rollouts/branching.py). Returns float32 [..., G, L], 0 on
  masked tokens and on branches.
  """
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  mask = jnp.asarray(rollouts.mask, bool)
  if (rollouts.parent is None) != (rollouts.fork is None):
    raise ValueError("appo: Rollouts.parent and Rollouts.fork come together (the sampler's "
                     "fork edges); got only one of them.")
  if rollouts.parent is None:  # no forks: every response is an initial rollout
    all_rows = jnp.ones(rewards.shape, bool)
    return jnp.where(mask, _subgroup_advantages(rewards, all_rows, scale_by_std, eps)[..., None],
                     0.0)
  parent = jnp.asarray(rollouts.parent, jnp.int32)
  init = parent < 0
  a_init = _subgroup_advantages(rewards, init, scale_by_std, eps)
  if not prefix_credit:
    return jnp.where(mask & init[..., None], a_init[..., None], 0.0)
  a_branch = _subgroup_advantages(rewards, ~init, scale_by_std, eps)
  g, length = rewards.shape[-1], mask.shape[-1]
  # onto[b, i]: branch b was forked from row i (credit lands on initial rows only, below);
  # covers[b, t]: t < fork_b.
  onto = (~init[..., :, None] & (parent[..., :, None] == jnp.arange(g))).astype(jnp.float32)
  covers = (jnp.arange(length) < jnp.asarray(rollouts.fork)[..., None]).astype(jnp.float32)
  total = jnp.einsum("...bi,...bt->...it", onto * a_branch[..., :, None], covers)
  count = jnp.einsum("...bi,...bt->...it", onto, covers)
  aux = jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)
  return jnp.where(mask & init[..., None], a_init[..., None] + aux, 0.0)
