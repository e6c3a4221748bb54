"""Value-based credit beside tree values (issue 24): Monte Carlo values at forks.

`mc_values` reads the values V̂(s) a sampled group gives every prefix it visits (the mean
reward of the responses through s: at a tree sampler's fork points, an average over the
K continuations sampled there) and credits each token, or each reasoning step, with
V̂(s_{t+1}) − V̂(s_t), VinePPO's advantage with its Monte Carlo values taken from the
existing samplers' forks instead of extra rollouts. `ppo_turns` is PPO's GAE for
multi-turn agents with the critic's values taken at turn boundaries, `bilevel_gae` adds a
token-level GAE inside each turn. The learned critic that fills `Rollouts.values` for
`gae` / `ppo` / `ppo_turns` / `bilevel_gae` is `experiments/training/critic.py`.
"""

import jax.numpy as jnp

import trees
from credit.groups import group_stats, masked_whiten
from credit.hindsight import outcome_plus_step_term
from credit.implied_values import _step_sums  # one step-sum for both families
from credit.registry import register
from credit.returns import gae_advantages, reverse_linear_scan
from credit.rollouts import Rollouts, reasoning_steps, tree_of
from credit.turns import turn_to_tokens, validate_turns

GRANULARITIES = ("token", "step")


@register("mc_values")
def mc_values(rollouts: Rollouts, granularity: str = "token", scale_by_std: bool = False,
              step_ends=None, leave_one_out: bool = False, eps: float = 1e-6):
  """Monte Carlo values at forks (VinePPO's A = V̂(s_{t+1}) − V̂(s_t), issue 24 item 3).

  V̂(s) is the mean reward of the group's responses through prefix s
  (`trees.prefix_values`, the sampled tree when the rollouts have one): at a fork, the
  mean over the continuations sampled from it. 'token': A_{i,t} = V̂(s_{t+1}) − V̂(s_t);
  'step': each reasoning step's tokens get V̂(step end) − V̂(step start) (`step_ends`,
  default `rollouts.step_ends`; the last step ends at the response's last token). Along a
  response the credit telescopes to V̂(its full prefix) − μ, which is R_i − μ (Dr. GRPO's
  advantage) unless longer responses extend it; it sits on the tokens where the tree
  branches (with no branching past the root, on the first token). This is TEMPO's temporal-difference term without its
  outcome term. `scale_by_std` divides by the group's σ + ε (GRPO's scale).
  `leave_one_out`: response i's V̂(s) is the mean over the other responses through s, as
  VinePPO's rollouts from s are not the trajectory itself (docs/conventions.md); where no
  other response passes (after its last fork) V̂(s) = R_i, so those tokens get 0 and the
  credit telescopes to R_i − the others' mean (RLOO's advantage). Returns float32
  [..., G, L], 0 on masked tokens.
  """
  if granularity not in GRANULARITIES:
    raise ValueError(f"mc_values granularity={granularity!r}; valid: {', '.join(GRANULARITIES)}.")
  rewards = jnp.asarray(rollouts.rewards, jnp.float32)
  tree = tree_of(rollouts)
  if leave_one_out:
    v_before, v_after = _others_mean(tree, rewards)
  else:
    v_before, v_after = trees.prefix_values(tree, rewards)
  adv = jnp.where(tree.mask, v_after - v_before, 0.0)
  if granularity == "step":
    ends = rollouts.step_ends if step_ends is None else step_ends
    if ends is None:
      raise ValueError("mc_values(granularity='step') needs step_ends [..., G, L] (the last "
                       "token of each reasoning step), as an argument or rollouts.step_ends.")
    ends = jnp.asarray(ends, bool)
    if ends.shape != tree.mask.shape:
      raise ValueError(f"step_ends must have the tokens' shape {tree.mask.shape}; got "
                       f"{ends.shape}.")
    adv = _step_sums(adv, tree.mask, ends)
  if scale_by_std:
    adv = adv / (group_stats(rewards)[1] + eps)[..., None]
  return jnp.where(tree.mask, adv, 0.0)


def _others_mean(tree, rewards):
  """(before, after), each [..., G, L]: the mean reward of the other responses through each
  token's state before and after it, the response's own where none passes."""
  total, count = trees.node_sum(tree, rewards), trees.node_count(tree, rewards)
  own = rewards[..., None]

  def at(before):
    t, n = (trees.to_tokens(tree, x, before=before) for x in (total, count))
    return jnp.where(tree.mask, jnp.where(n > 1.0, (t - own) / jnp.maximum(n - 1.0, 1.0), own),
                     0.0)

  return at(True), at(False)


@register("ppo_turns", needs=("turns", "values"))
def ppo_turns(rollouts: Rollouts, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
              eps: float = 1e-8):
  """PPO's GAE at turn level for multi-turn agents (issue 24: values at turn boundaries).

  V(s_k) is the critic's value before turn k's first action token (`rollouts.values` read
  where `turns.token_turn` first equals k: the state after observation k), 0 after the last
  turn; δ_k = r_k + γ·V(s_{k+1}) − V(s_k) with the environment's turn rewards
  (`turns.rewards`), A_k = GAE(γ, λ) over the taken turns, whitened over every taken turn
  of the batch (`whiten`, as verl's `ppo`), and spread over the turn's action tokens. With
  one turn per trajectory it is `ppo` on a response whose reward is its return. Returns
  float32 [..., G, L], 0 off the action tokens.
  """
  adv, _, token_turn, mask = _turn_gae(rollouts, "ppo_turns", gamma, lam)
  if whiten:
    adv = masked_whiten(adv, mask, eps)
  return jnp.where(token_turn >= 0, turn_to_tokens(adv, token_turn), 0.0)


def _turn_gae(rollouts: Rollouts, who: str, gamma: float, lam: float):
  """(turn advantages [..., G, K], turn values V(s_k) [..., G, K], token_turn, turn mask):
  GAE over turns from the critic's value before each turn's first action token."""
  v, rewards, token_turn, mask = turn_values(rollouts, who)
  return gae_advantages(rewards, v, mask, gamma, lam), v, token_turn, mask


def turn_values(rollouts: Rollouts, who: str):
  """(V(s_k) [..., G, K]: the critic's value before turn k's first action token, 0 off taken
  turns; turn rewards [..., G, K], 0 off taken turns; token_turn; turn mask), validated."""
  turns = rollouts.turns
  if turns is None or turns.token_turn is None:
    raise ValueError(f"{who} needs rollouts.turns with token_turn (multi-turn trajectories).")
  if rollouts.values is None:
    raise ValueError(f"{who} needs rollouts.values (the critic's per-token values).")
  validate_turns(turns, rollouts)
  k = turns.num_turns
  token_turn = jnp.asarray(turns.token_turn, jnp.int32)
  l = token_turn.shape[-1]
  first = jnp.min(jnp.where(token_turn[..., None, :] == jnp.arange(k)[:, None],
                            jnp.arange(l), l), axis=-1)  # [..., G, K]: first token of turn k
  mask = jnp.asarray(turns.turn_mask, bool)
  values = jnp.asarray(rollouts.values, jnp.float32)
  v = jnp.where(mask & (first < l),
                jnp.take_along_axis(values, jnp.minimum(first, l - 1), -1), 0.0)
  rewards = jnp.where(mask, jnp.asarray(turns.rewards, jnp.float32), 0.0)
  return v, rewards, token_turn, mask


@register("bilevel_gae", needs=("turns", "values"))
def bilevel_gae(rollouts: Rollouts, gamma: float = 1.0, lam: float = 1.0,
                token_gamma: float = 1.0, token_lam: float = 1.0, whiten: bool = True,
                eps: float = 1e-8):
  """Bi-Level GAE (#44, VAGEN), our reading: GAE first over turns (as `ppo_turns`, γ, λ),
  then over each turn's action tokens with the critic's per-token values, the turn's
  return target G_k = A_k + V(s_k) as the reward on its last action token and nothing
  after it (token_γ, token_λ). With token_γ = token_λ = 1 a token's advantage is
  G_k − V(its state): the turn's credit, less what the critic already expected at that
  token. Whitened over the batch's action tokens (`whiten`). Returns float32 [..., G, L],
  0 off the action tokens.
  """
  adv_turn, v_turn, token_turn, mask = _turn_gae(rollouts, "bilevel_gae", gamma, lam)
  on = token_turn >= 0
  ret = turn_to_tokens(adv_turn + v_turn, token_turn)  # G_k on every token of turn k
  nxt = jnp.concatenate([token_turn[..., 1:], jnp.full_like(token_turn[..., :1], -1)], -1)
  last = on & (nxt != token_turn)  # the turn's last action token
  # Token-level GAE within turns: the chain is cut where a turn ends (done at its last
  # token, so V after it is 0) and observation tokens are skipped (mask off).
  values = jnp.where(on, jnp.asarray(rollouts.values, jnp.float32), 0.0)
  rewards = jnp.where(last, ret, 0.0)
  next_v = jnp.where(last, 0.0, jnp.concatenate([values[..., 1:], jnp.zeros_like(
      values[..., :1])], -1))
  delta = jnp.where(on, rewards + token_gamma * next_v - values, 0.0)
  carry = jnp.where(on & ~last, token_gamma * token_lam, 0.0)
  adv = reverse_linear_scan(delta, carry)
  if whiten:
    adv = masked_whiten(adv, on, eps)
  return jnp.where(on, adv, 0.0)



@register("advantage_model", needs=("values",))
def advantage_model(rollouts: Rollouts, center: bool = True):
  """Advantage Model (#77): a learned model that outputs the advantage of a response
  directly, its extra reward over the prompt's expected reward, instead of a reward to be
  baselined. The critic (experiments/training/critic.py) trained with `critic.targets =
  'advantage'` regresses R_i − mean_g R_g on every token, so its value before token t is a
  learned E[R − E R | prompt, y_<t]. Reading: response i's score s_i is the model's output
  before its last token (which, for a response that ends in EOS, has read the whole
  answer); A_i = s_i − mean_g s_g on every token (`center`: the abstract's regulated score
  distribution, zero mean per prompt, also while the model is still untrained: uncentred,
  an untrained model's common offset pushes every sampled response up or down, which
  collapsed training in our first run); selective rehearsal is not built. With the
  model's output equal to its labels this is Dr. GRPO's R_i − μ. Returns float32
  [..., G, L], 0 on masked tokens.
  """
  if rollouts.values is None:
    raise ValueError("advantage_model needs rollouts.values: the Advantage Model's outputs (a "
                     "critic trained with critic.targets = 'advantage', configs/ppo.py).")
  mask = jnp.asarray(rollouts.mask, bool)
  n = jnp.sum(mask, -1, keepdims=True)
  v = jnp.asarray(rollouts.values, jnp.float32)
  score = jnp.where(n > 0, jnp.take_along_axis(v, jnp.maximum(n - 1, 0), -1), 0.0)[..., 0]
  if center:
    score = score - jnp.mean(score, -1, keepdims=True)
  return jnp.where(mask, score[..., None], 0.0)


@register("pum", needs=("values", "step_ends"))
def pum(rollouts: Rollouts, coef: float = 0.5, scale_by_std: bool = True, eps: float = 1e-6):
  """PUM (#90): a prefix utility model U trained with a pairwise ranking objective on prefix
  gains (the solve-rate lift of continuing from a prefix) scores reasoning prefixes; in RL
  it supplies prefix-level supervision. The critic trained with `critic.targets = 'tree'`
  (each prefix's solve rate in its sampled group, whose differences are the prefix gains)
  and `critic.loss = 'rank'` is U: `rollouts.values` [..., G, L] is U before each token.
  Reading: reasoning step j's utility gain ΔU_j = U(after step j) − U(before it), normalised
  over the group's reasoning steps, is added to GRPO's A_i on the step's tokens:
  A = A_i + coef · ΔŨ_j (the answer's tokens keep A_i; P2S's form, with U in place of a
  probe). U is scale-free (ranked, not regressed), hence the normalisation. coef = 0 is
  GRPO. Returns float32 [..., G, L].
  """
  return _outcome_plus_value_gains(rollouts, "pum", coef, scale_by_std, eps)


@register("prorag", needs=("values", "step_ends"))
def prorag(rollouts: Rollouts, coef: float = 0.5, scale_by_std: bool = True,
           eps: float = 1e-6):
  """ProRAG (#176): a process reward model built from tree search, then dual-granularity
  (step and outcome) advantages. Reading: the PRM is the critic regressing the prefix-tree
  values of each step's sampled groups (`critic.targets = 'tree'`, squared error: the
  success rate through each prefix, our trees in place of MCTS), a step's process reward
  its value gain V(after step j) − V(before it), and the advantage GRPO's outcome term plus
  coef × the gains normalised over the group's reasoning steps (the same combination as
  `pum`, whose model is ranked instead of regressed). PRM-guided refinement of the rollouts
  is not built. coef = 0 is GRPO. Returns float32 [..., G, L].
  """
  return _outcome_plus_value_gains(rollouts, "prorag", coef, scale_by_std, eps)


def _outcome_plus_value_gains(rollouts: Rollouts, who: str, coef, scale_by_std, eps):
  """GRPO + coef · group-normalised value gain over each reasoning step (PUM, ProRAG)."""
  if rollouts.values is None or rollouts.step_ends is None:
    raise ValueError(f"{who} needs rollouts.values (a value model of prefixes: the critic with "
                     f"critic.targets = 'tree') and rollouts.step_ends.")
  closed, ends = reasoning_steps(rollouts)
  is_end = ends & closed
  v = jnp.asarray(rollouts.values, jnp.float32)
  nxt = jnp.concatenate([v[..., 1:], jnp.zeros_like(v[..., :1])], -1)  # U after each token
  gain = _step_sums(jnp.where(closed, nxt - v, 0.0), closed, is_end)  # telescopes per step
  return outcome_plus_step_term(rollouts, gain, closed, is_end, coef, scale_by_std, eps)
