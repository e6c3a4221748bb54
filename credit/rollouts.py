"""The batch every credit estimator takes."""

from typing import Optional

import flax
import jax
import jax.numpy as jnp

import trees
from credit.turns import Turns
from trees import PrefixTree


@flax.struct.dataclass
class Rollouts:
  """Rollout groups: G responses of padded length L per prompt, any leading dims.

  Attributes:
    tokens: int32 [..., G, L] response tokens.
    mask: bool [..., G, L], True on response tokens (one run from position 0).
    rewards: float32 [..., G] outcome rewards.
    logprobs: float32 [..., G, L] log π_θ(token) under the current policy, or None.
    old_logprobs: float32 [..., G, L] under the sampling policy, or None.
    ref_logprobs: float32 [..., G, L] under the frozen reference policy, or None.
    token_rewards: float32 [..., G, L] per-token (process) rewards, or None.
    values: float32 [..., G, L] critic values V(s_t) before each token, or None.
    tree: the group's `trees.PrefixTree` when the sampler built an explicit tree
      (`trees.from_forks`); None means "the prefix tree of the tokens".
    step_ends: bool [..., G, L], True on the tokens that close a reasoning step (where
      a process verifier puts its `token_rewards`), or None.
    turns: the turn structure of multi-turn trajectories (`credit.turns.Turns`: state
      ids, per-turn rewards, each token's turn), or None for single-turn responses.
    policy_mask: bool [..., G, L], True on the tokens the policy generated (the ones
      trained), a subset of `mask`; None means all of `mask`. Multi-turn trajectories
      put their observation tokens in `mask` (so the prefix tree, and every
      token-level estimator, sees whole trajectories) but not in `policy_mask`;
      estimators got through `credit.get` return 0 off it and `credit.loss_mask`
      keeps only its tokens.
    entropy: float32 [..., G, L] entropy of the sampling policy's next-token distribution
      at each response position (nats; the sampler's, or a teacher-forced pass's for
      text rollouts), or None. Token-reweighting estimators read it.
    prompt_logprobs: float32 [..., P] log π_θ of each prompt token given the tokens
      before it (0 on padding and on the first token), or None (ProGRPO).
    prompt_mask: bool [..., P], True on the prompt tokens `prompt_logprobs` scores (not the
      first token, not padding), or None: then a log-prob of exactly 0 counts as padding.
    credit_state: the pytree a stateful estimator carries across training steps (e.g.
      pass-rate EMAs, a closed-loop entropy target), or None; see `credit.register`'s
      `state`. The loop keeps it in its checkpointed state.
    context_logprobs: float32 [..., G, L] log-probs of the response tokens under a changed
      context (one extra teacher-forced pass with the prompt changed: GCPO, PGPO), or None.
    saliency: float32 [..., G, L] per-token gradient saliency (the norm of the gradient of
      the response log-likelihood w.r.t. the token's input embedding; GRAIL), or None.
    hindsight_logprobs: float32 [..., G, L] log-probs of the response tokens with the task's
      gold answer placed after the prompt (a privileged, answer-conditioned teacher: the
      same policy; PBSD, HCAPO), or None.
    step_probes: `StepProbes` [..., G, S+1]: teacher-forced probes of the task's gold
      continuation after each prefix of a response's reasoning steps (SPAE, P2S, MIG), or
      None.
    parent, fork: int32 [..., G], the explicit tree's edges (`trees.from_forks`): the response
      each one was forked from (−1 for roots, the sampler's initial rollouts) and how many
      leading tokens it copied from it (0 for roots); set with `tree` by the tree samplers,
      None otherwise (then every response is a root). APPO reads them.
    row_mask: bool [..., G], True on the rows that are responses: groups of varying size
      padded to G (the 'knapsack' sampler; Knapsack RL, #59). Padded rows have an all-False
      `mask`. Only estimators registered with `rows=True` accept it (`credit.register`);
      None means every row.
    hidden_states: float32 [..., G, L, D], the policy's final hidden state at each response
      position (the one predicting the token; VERL's representations), or None.
    ref_rewards: float32 [...], the reward of a response the frozen reference policy sampled
      for each group's prompt (AAPO's baseline), or None.
    prompt_ids: int32 [...], each group's index in a fixed prompt pool (a loop's
      `rl.prompt_pool`) when prompts recur, or None (drawn fresh). A stateful estimator with
      a history per prompt (`credit.per_prompt`) reads it when its state was made for a pool.
    extras: {need key: pytree} of inputs declared outside this library
      (`credit.vocabulary.declare`) and computed by a pass of the caller's, or None.
  """

  tokens: jax.Array
  mask: jax.Array
  rewards: jax.Array
  logprobs: Optional[jax.Array] = None
  old_logprobs: Optional[jax.Array] = None
  ref_logprobs: Optional[jax.Array] = None
  token_rewards: Optional[jax.Array] = None
  values: Optional[jax.Array] = None
  tree: Optional[PrefixTree] = None
  step_ends: Optional[jax.Array] = None
  turns: Optional[Turns] = None
  policy_mask: Optional[jax.Array] = None
  entropy: Optional[jax.Array] = None
  prompt_logprobs: Optional[jax.Array] = None
  prompt_mask: Optional[jax.Array] = None
  credit_state: Optional[object] = None
  context_logprobs: Optional[jax.Array] = None
  saliency: Optional[jax.Array] = None
  step_probes: Optional["StepProbes"] = None
  hindsight_logprobs: Optional[jax.Array] = None
  row_mask: Optional[jax.Array] = None
  parent: Optional[jax.Array] = None
  fork: Optional[jax.Array] = None
  prompt_ids: Optional[jax.Array] = None
  ref_rewards: Optional[jax.Array] = None
  hidden_states: Optional[jax.Array] = None
  extras: Optional[dict] = None

  @property
  def group_size(self) -> int:
    return self.tokens.shape[-2]

  @property
  def trained_mask(self) -> jax.Array:
    """bool [..., G, L]: the tokens in the policy loss (`policy_mask`, else `mask`)."""
    return self.mask if self.policy_mask is None else self.policy_mask & self.mask

  @property
  def sampling_logprobs(self) -> Optional[jax.Array]:
    """Log-probs under the sampling policy: `old_logprobs`, else `logprobs` (or None)."""
    return self.old_logprobs if self.old_logprobs is not None else self.logprobs


@flax.struct.dataclass
class StepProbes:
  """Probes at reasoning-step boundaries, [..., G, S+1] (probe k: after the response's
  first k steps, k = 0 before any; a step ends at a True of `Rollouts.step_ends`).

  Attributes:
    logprobs: float32, the mean per-token log π_θ of the task's gold continuation (a
      demonstration's steps k+1.., its answer and EOS) teacher-forced after the prompt and
      the response's first k steps; 0 where `mask` is False.
    entropy: float32, the mean next-token entropy (nats) over those continuation tokens.
    mask: bool, True where probe k exists: k = 0, or the response has more than k step
      ends (its k-th step is closed and is not its last one).
  """

  logprobs: jax.Array
  entropy: jax.Array
  mask: jax.Array


def reasoning_steps(rollouts: Rollouts):
  """(tokens bool [..., G, L], ends bool [..., G, L]): the trained tokens of each response's
  reasoning steps and their step ends. A step is the tokens after one `step_ends` True
  through the next; the reasoning steps are the closed ones, except one closed on the
  response's last token, which is its answer (scratch_add and countdown_steps close the
  answer with its EOS). Needs `step_ends`."""
  mask = jnp.asarray(rollouts.mask, bool)
  ends = jnp.asarray(rollouts.step_ends, bool) & mask
  n = jnp.sum(mask, -1, keepdims=True)
  final = jnp.take_along_axis(ends, jnp.maximum(n - 1, 0), -1) & (n > 0)
  step = jnp.cumsum(ends, -1) - ends
  tokens = jnp.asarray(rollouts.trained_mask, bool) & (
      step < jnp.sum(ends, -1, keepdims=True) - final)
  return tokens, ends


def tree_of(rollouts: Rollouts) -> trees.PrefixTree:
  """The rollouts' explicit tree if they carry one, else the prefix tree of their tokens."""
  if rollouts.tree is not None:
    return rollouts.tree
  return trees.build(rollouts.tokens, rollouts.mask)
