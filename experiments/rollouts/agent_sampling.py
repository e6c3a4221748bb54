"""Multi-turn agent sampling (jitted): a decoder policy playing an `envs.multiturn.MultiTurnEnv`.

`sample_episodes` runs B start states (`env.reset`), each repeated G times (a
group: G trajectories from the same start state), for K turns inside one jit.
A turn: the policy samples up to A action tokens one at a time with the KV
cache, stopping after `env.eoa_id` (a `lax.scan` over the A tokens); `env.step`
answers; the new observation enters the cache as one teacher-forced chunk.
Turns are a `lax.scan` over k = 0 .. K-1; finished episodes keep
running on padding (static shapes). `fork_episodes` samples N chains per start
state and, at turn boundary k, forks each into C continuations by copying env
state and KV cache (tree sampling over turns).

KV-cache layouts (`LAYOUTS`, the samplers' static `layout`). 'rows': a
`decoder.KVCache` per row; the chunk runs at the start of the next turn, the first
observation obs0 in turn 0's (no separate prefill: the turn body holds the only two
decoder calls, but every row of a group holds and reads its own copy of obs0).
'cascade' (default, as in the token samplers): a `decoder.CascadeCache`; obs0 is
prefilled once per group into its B prefixes (the first action's logits are the
prefill's last), the rows' actions and observations go to their own slots (own slot
i = position O + i; each observation's chunk at the end of its turn, the last turn's
unused), and every decode step reads a group's obs0 once for its G rows
(`decoder.cascade_attention`); a fork copies the own slots only. Both give the same
episodes up to float rounding (tests/test_agent_cascade.py).

Layout. A trajectory is ONE token sequence of static length T = O + K (A + O):
the initial observation [0, O), then for turn k an action slot
[O + k(A+O), O + k(A+O) + A) and an observation slot of O tokens right after it
(`slot_layout`). Choice: the initial observation is part of `tokens` (with
policy_mask False), not a separate prompt, so `tokens` is exactly the context
the policy was sampled with and `teacher_forced_logprobs` (one causal forward
over `tokens`) reproduces the sampling log-probs. Slots keep their static
places, so the context contains `env.pad_id` padding: action tokens after the
first EOA, observation tokens outside the env's obs_mask, and every slot of the
turns after the episode ended. The policy attends to those pads (the decoder
has no key mask); they are never trained (policy_mask False).

Vocabulary: the policy reads and writes the environment's tokens, or, given a
`VocabMap` (a pretrained LM; `agent_rollouts.lm_vocab_map`), its own: observations are
mapped to policy tokens before they enter the cache and the trajectory, actions back
to environment tokens before `env.step`; state ids, rewards and masks are unchanged.

Randomness: `env.reset(fold_in(key, 0), B)`. Token t of turn k of node j in
group b is drawn by inverse CDF (`select_tokens`) with
u = uniform(fold_in(fold_in(fold_in(key, 1), b), j), (K A,))[k A + t]
(`sampling.response_uniforms`), so a trajectory does not depend on the batch
layout. `sample_episodes`: node j = g. `fork_episodes`: chain n is node n (so
the chains equal `sample_episodes` with G = N) and fork c >= 1 of chain n is
node N + n (C - 1) + c - 1, whose turns before the fork are copied. Stochastic
environments keep their random stream in the state, so forks copying the state
share it (for `ExactMDP` the same action at the same turn gives the same
transition). Log-probs are under the untempered policy (temperature 1), as in
`experiments.rollouts.sampling`; temperature (traced; 0 = greedy) is the only sampling
setting (no top-k / top-p).
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import credit
from credit.turns import episode_returns
from experiments.rollouts import sampling
from experiments.models import decoder


@struct.dataclass
class Episodes:
  """Sampled multi-turn trajectories [B, G, ...] (layout in the module docstring).

  Attributes:
    tokens: int32 [B, G, T], the whole trajectory (observations, actions, padding).
    policy_mask: bool [B, G, T], True on generated action tokens (EOA included).
    obs_mask: bool [B, G, T], True on observation tokens (the env's obs_mask; only
      the initial observation and the observations returned by taken turns).
    span_mask: bool [B, G, T], one run from position 0 over the trajectory: the initial
      observation slot and the action and observation slots of every taken turn
      (padding inside them included); policy_mask and obs_mask lie inside it.
    token_turn: int32 [B, G, T], the turn of every policy token, -1 elsewhere.
    logprobs: float32 [B, G, T], untempered sampling log-probs of policy tokens, 0
      elsewhere.
    turn_rewards: float32 [B, G, K], the env's reward per turn (0 on untaken turns).
    turn_mask: bool [B, G, K], True on taken turns (the episode was live at its start).
    done: bool [B, G], the episode ended (the env's done, turn limit included).
    state_ids: int32 [B, G, K+1], `env.state_id` at the start of every turn and after
      the last; after the episode ended the terminal state's id repeats.
    success: bool [B, G], the env's info["solved"] (or "goal", "success") on a taken
      turn; without such an info entry, total reward > 0.
    parent: int32 [B, G], the trajectory g was forked from, -1 for chains.
    fork_turn: int32 [B, G], turns g copied from its parent (0 for chains).
    distances: int32 [B, G, K+1], `env.optimal_distance` (turns a solver still needs)
      of the same states as state_ids, for environments that have one; else None.
    milestones: bool [B, G, K+1, M], `env.milestones` of the same states (household's
      sub-goals), for environments that have them; else None.
  """

  tokens: jax.Array
  policy_mask: jax.Array
  obs_mask: jax.Array
  span_mask: jax.Array
  token_turn: jax.Array
  logprobs: jax.Array
  turn_rewards: jax.Array
  turn_mask: jax.Array
  done: jax.Array
  state_ids: jax.Array
  success: jax.Array
  parent: jax.Array
  fork_turn: jax.Array
  distances: Optional[jax.Array] = None
  milestones: Optional[jax.Array] = None

  @property
  def returns(self) -> jax.Array:
    """float32 [B, G]: the undiscounted total reward."""
    return episode_returns(self.turn_rewards, self.turn_mask)

  @property
  def lengths(self) -> jax.Array:
    """int32 [B, G]: turns taken."""
    return jnp.sum(self.turn_mask, axis=-1, dtype=jnp.int32)

  def to_rollouts(self) -> credit.Rollouts:
    return to_rollouts(self)


def to_rollouts(episodes: Episodes, **turn_fields) -> credit.Rollouts:
  """`credit.Rollouts` of whole trajectories: tokens = the trajectory, mask = its span
  (one run from 0: observations included, so the prefix tree and every token-level
  estimator see whole trajectories), policy_mask = the action tokens (the only ones
  that get advantages through `credit.get` and enter the loss), rewards = total
  reward, logprobs = sampling log-probs, turns = `credit.Turns` (state ids, turn
  rewards, turn mask, token_turn, success, plus `turn_fields`, e.g. values_star or
  answer_logprobs). `tree` is left None (see `experiments.rollouts.agent_rollouts` for the
  sampled tree of forks).
  """
  e = episodes
  return credit.Rollouts(
      tokens=e.tokens, mask=e.span_mask, rewards=e.returns, logprobs=e.logprobs,
      policy_mask=e.policy_mask,
      turns=credit.Turns(state_ids=e.state_ids, rewards=e.turn_rewards, turn_mask=e.turn_mask,
                         token_turn=e.token_turn, success=e.success, **turn_fields))


@struct.dataclass
class VocabMap:
  """A policy with its own vocabulary (a pretrained LM) playing an environment: every
  environment token is one policy token (`lm_vocab_map`).

  to_lm: int32 [V_env], the policy token of each environment token.
  to_env: int32 [V_policy], the environment token of each policy token; tokens that are
    not an environment word map to the environment's PAD (an invalid action).
  eoa, pad: the policy tokens of the environment's EOA and PAD (static).
  """

  to_lm: jax.Array
  to_env: jax.Array
  eoa: int = struct.field(pytree_node=False)
  pad: int = struct.field(pytree_node=False)


def policy_tokens(vocab: Optional[VocabMap], x):
  """Environment tokens x as policy tokens (unchanged without a map)."""
  return x if vocab is None else vocab.to_lm[x]


# ----------------------------------------------------------------------------
# Layout.


def num_turns_of(env, num_turns: Optional[int] = None) -> int:
  """K: `num_turns` (<= env.max_turns) or env.max_turns."""
  k = env.max_turns if num_turns is None else int(num_turns)
  if not 1 <= k <= env.max_turns:
    raise ValueError(f"num_turns must be in [1, env.max_turns = {env.max_turns}]; got {k}.")
  return k


def sequence_length(env, num_turns: Optional[int] = None) -> int:
  """T = O + K (A + O)."""
  return env.obs_len + num_turns_of(env, num_turns) * (env.action_len + env.obs_len)


def slot_layout(env, num_turns: Optional[int] = None):
  """Static layout (NumPy): (action_pos int [K, A], obs_pos int [K, O], turn_of int [T]).

  action_pos[k] / obs_pos[k] are the positions of turn k's action / observation
  slot; turn_of[t] is the turn of an action-slot position t, -1 elsewhere.
  """
  o, a, k = env.obs_len, env.action_len, num_turns_of(env, num_turns)
  start = o + (a + o) * np.arange(k)[:, None]
  action_pos, obs_pos = start + np.arange(a), start + a + np.arange(o)
  turn_of = np.full((sequence_length(env, k),), -1, np.int64)
  turn_of[action_pos] = np.arange(k)[:, None]
  return action_pos, obs_pos, turn_of


def split_slots(x, env, num_turns: Optional[int] = None):
  """x [..., T] -> (initial [..., O], actions [..., K, A], observations [..., K, O])."""
  o, a, k = env.obs_len, env.action_len, num_turns_of(env, num_turns)
  turns = x[..., o:].reshape(x.shape[:-1] + (k, a + o))
  return x[..., :o], turns[..., :a], turns[..., a:]


@functools.partial(jax.jit, static_argnames="pcfg")
def teacher_forced_logprobs(params, pcfg: decoder.PolicyConfig, tokens):
  """log p(tokens[..., t] | tokens[..., :t]) for t >= 1 by one causal forward; [..., T] f32.

  Position 0 (the first observation token, never a policy token) gets 0. Mask with
  policy_mask: equals the sampling log-probs there (`decoder.token_logprobs`).
  """
  shape = tokens.shape
  flat = tokens.reshape(-1, shape[-1]).astype(jnp.int32)
  lp, _ = decoder.token_logprobs(params, pcfg, flat[:, :1], flat[:, 1:])
  lp = jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp], axis=1)
  return lp.reshape(shape)


# ----------------------------------------------------------------------------
# Building blocks.


@functools.lru_cache(maxsize=None)
def _success_key(env) -> Optional[str]:
  """The info entry that flags success ('solved', 'goal' or 'success'), or None."""
  state = jax.eval_shape(lambda: env.reset(jax.random.key(0), 1)[0])
  actions = jax.ShapeDtypeStruct((1, env.action_len), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, env.action_len), jnp.bool_)
  info = jax.eval_shape(env.step, state, actions, mask)[-1]
  return next((k for k in ("solved", "goal", "success") if k in info), None)


def _hidden(params, pcfg, tokens, positions, cache, start=None):
  """Runs tokens [R, n] at positions [R, n] into the cache: (last-position logits [R, V], cache).

  start [R]: the rows' first own positions, for the own slots of a `decoder.CascadeCache`
  (without it a cascade cache's prefixes are written: a prefill of its R = B prompts)."""
  m = decoder.model(pcfg)
  args = (cache,) if start is None else (cache, None, start)
  h, cache = m.apply({"params": params}, tokens, positions, *args, method="hidden")
  return m.apply({"params": params}, h[:, -1], method="logits"), cache


def select_tokens(u, logits, temperature):
  """Inverse-CDF sampling from softmax(logits / temperature): u [R], logits [R, V] -> int32 [R].

  The first token whose cumulative probability exceeds u (`sampling.select_tokens`
  without top-k / top-p, which keeps the compiled turn small); temperature 0 = greedy.
  """
  logits = logits.astype(jnp.float32)
  temp = jnp.where(temperature > 0, temperature, 1.0)
  scaled = logits / temp
  cdf = jnp.cumsum(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), axis=-1)
  sampled = jnp.argmax(cdf > u[:, None] * cdf[:, -1:], axis=-1)
  return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def _pick(u, logits, alive, temperature, eoa_id, pad_id):
  """One action token per row: (token, untempered log-prob, policy, alive after) [R].

  Rows not alive (past EOA, or episode done) get pad_id, log-prob 0, policy False.
  """
  tok = select_tokens(u, logits, temperature)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  tok = jnp.where(alive, tok, pad_id)
  return tok, jnp.where(alive, lp, 0.0), alive, alive & (tok != eoa_id)


def _turn(params, pcfg, env, vocab, temperature, carry, xs):
  """One turn of every row. carry = (env state, KV cache, pending); xs = (turn index k,
  uniforms [R, A]). Returns the new carry and the turn's record (tokens in the policy's
  vocabulary: the environment's unless `vocab` maps them).

  Layout 'rows' (a `decoder.KVCache`): pending = the observation before this turn's action
  slot [R, O] in policy tokens, not yet in the cache; the turn runs it first. Layout
  'cascade' (a `decoder.CascadeCache`, own slot i = position O + i): pending = the
  next-token logits [R, V] (the prefill's at turn 0); the turn runs its new observation
  into the rows' own slots last, whose logits the next turn starts from (after the last
  turn they go unused)."""
  state, cache, pending = carry
  k, u = xs
  o, a = env.obs_len, env.action_len
  pad, eoa = (env.pad_id, env.eoa_id) if vocab is None else (vocab.pad, vocab.eoa)
  r = u.shape[0]
  start = o + k * (a + o)  # the action slot's first position
  live = ~state.done
  cascade = isinstance(cache, decoder.CascadeCache)
  own = jnp.full((r,), o, jnp.int32) if cascade else None  # the rows' first own position
  if cascade:
    logits = pending
  else:
    # Teacher-forced chunk: the observation (its logits at the end give the first action token).
    pos = jnp.broadcast_to(start - o + jnp.arange(o), pending.shape)
    logits, cache = _hidden(params, pcfg, pending, pos, cache)

  def act(c, x):  # sample action token j and feed it
    cache, logits, alive = c
    j, uj = x
    tok, lp, pol, alive = _pick(uj, logits, alive, temperature, eoa, pad)
    logits, cache = decoder.decode_step(params, pcfg, cache, tok,
                                        jnp.full((r,), start + j, jnp.int32), own)
    return (cache, logits, alive), (tok, lp, pol)

  (cache, _, _), (actions, logprobs, policy) = jax.lax.scan(
      act, (cache, logits, live), (jnp.arange(a), u.T))
  actions = actions.T
  env_actions = actions if vocab is None else vocab.to_env[actions]
  state, record = _env_turn(env, state, env_actions, policy.T, logprobs.T)
  record.update(actions=actions, obs=policy_tokens(vocab, record["obs"]))
  pending = record["obs"]
  if cascade:  # the observation slot right after the action slot, into the own slots
    pos = jnp.broadcast_to(start + a + jnp.arange(o), pending.shape)
    pending, cache = _hidden(params, pcfg, pending, pos, cache, own)
  return (state, cache, pending), record


def _env_turn(env, state, actions, policy, logprobs):
  """`env.step` on the turn's actions [R, A] (policy: the tokens up to EOA of live rows):
  (next state, the turn's record of [R, ...] arrays)."""
  live = ~state.done
  record = dict(state_id=env.state_id(state), live=live)
  if hasattr(env, "optimal_distance"):
    record["distance"] = env.optimal_distance(state)
  if hasattr(env, "milestones"):
    record["milestones"] = env.milestones(state)
  state, obs, obs_mask, reward, _, info = env.step(state, actions, policy)
  obs_mask = obs_mask & live[:, None]
  key = _success_key(env)
  hit = (info[key].astype(bool) if key is not None else jnp.zeros(live.shape, bool)) & live
  record.update(actions=actions, policy=policy, logprobs=logprobs, obs_mask=obs_mask,
                obs=jnp.where(obs_mask, obs, env.pad_id).astype(jnp.int32),
                reward=jnp.where(live, reward, 0.0).astype(jnp.float32), hit=hit)
  return state, record


def _run_turns(params, pcfg, env, vocab, temperature, carry, first: int, last: int, uniforms):
  """Turns first .. last-1 (static) of every row; uniforms [R, K, A]. Records [R, n, ...]."""
  step = functools.partial(_turn, params, pcfg, env, vocab, temperature)
  carry, recs = jax.lax.scan(step, carry, (jnp.arange(first, last, dtype=jnp.int32),
                                           jnp.swapaxes(uniforms[:, first:last], 0, 1)))
  return carry, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), recs)


def _start(env, pcfg, key, num_groups: int, copies: int, start=None, vocab=None, *,
           layout: str = "rows", params=None, num_turns: Optional[int] = None):
  """B start states (`env.reset`, or `start`) repeated: (carry of B * copies rows, obs0,
  obs0_mask), the observation in policy tokens. Layout 'rows': it enters every row's
  cache in turn 0's chunk. Layout 'cascade' (needs params; num_turns sizes the own slots):
  it is prefilled once per group into a `decoder.CascadeCache` of B prefixes of O slots
  and B * copies rows of T - O own slots (`_prefill_groups`), and the carry holds the
  first action's logits instead of a pending observation."""
  if start is None:
    start = env.reset(jax.random.fold_in(key, 0), num_groups)
  state, obs, obs_mask = start
  if obs.shape[0] != num_groups:
    raise ValueError(f"start holds {obs.shape[0]} episodes; num_groups = {num_groups}.")
  obs = policy_tokens(vocab, jnp.where(obs_mask, obs, env.pad_id).astype(jnp.int32))
  rep = lambda x: jnp.repeat(x, copies, axis=0)
  if layout == "cascade":
    cache, logits = _prefill_groups(params, pcfg, env, obs, copies, num_turns)
    return (jax.tree.map(rep, state), cache, logits), rep(obs), rep(obs_mask)
  cache = None if pcfg is None else decoder.init_cache(pcfg, num_groups * copies)
  carry = (jax.tree.map(rep, state), cache, rep(obs))
  return carry, rep(obs), rep(obs_mask)


def _prefill_groups(params, pcfg, env, obs0, copies: int, num_turns: Optional[int] = None):
  """Layout 'cascade': obs0 [B, O] (policy tokens) run once into the prefixes of an empty
  `decoder.CascadeCache` (B prefixes of O slots, B * copies rows of T - O own slots, own
  slot i = position O + i) -> (cache, the first action's logits [B * copies, V]: the
  prefill's at position O - 1, repeated to each group's rows)."""
  b, o = obs0.shape
  t = sequence_length(env, num_turns)
  cache = decoder.init_cascade_cache(pcfg, b, o, b * copies, t - o)
  logits, cache = _hidden(params, pcfg, obs0, jnp.broadcast_to(jnp.arange(o), (b, o)), cache)
  return cache, jnp.repeat(logits, copies, axis=0)


def _uniforms(key, num_groups: int, node_ids, env, k: int):
  """u [B * n, K, A]: node node_ids[j] of group b (module docstring)."""
  u = sampling.response_uniforms(jax.random.fold_in(key, 1), np.arange(num_groups),
                                 np.asarray(node_ids), k * env.action_len)
  return u.reshape(-1, k, env.action_len)


def _episodes(env, num_groups, obs0, obs0_mask, recs, final_state, parent, fork_turn):
  """Assembles records [R, K, ...] of R = B * G rows into Episodes [B, G, ...]."""
  r, k = recs["live"].shape
  o, a = env.obs_len, env.action_len
  seq = lambda init, act, ob: jnp.concatenate(
      [init, jnp.concatenate([act, ob], axis=-1).reshape(r, k * (a + o))], axis=-1)
  no_obs = jnp.zeros((r, k, o), bool)
  policy = seq(jnp.zeros_like(obs0_mask), recs["policy"], no_obs)
  _, _, turn_of = slot_layout(env, k)
  live = recs["live"]
  rewards = recs["reward"]
  if _success_key(env) is not None:
    success = jnp.any(recs["hit"], axis=-1)
  else:
    success = jnp.sum(jnp.where(live, rewards, 0.0), axis=-1) > 0
  flat = dict(
      tokens=seq(obs0, recs["actions"], recs["obs"]),
      policy_mask=policy,
      obs_mask=seq(obs0_mask, jnp.zeros((r, k, a), bool), recs["obs_mask"]),
      span_mask=seq(jnp.ones_like(obs0_mask), jnp.broadcast_to(live[..., None], (r, k, a)),
                    jnp.broadcast_to(live[..., None], (r, k, o))),
      token_turn=jnp.where(policy, jnp.asarray(turn_of, jnp.int32), -1),
      logprobs=seq(jnp.zeros(obs0.shape, jnp.float32), recs["logprobs"],
                   jnp.zeros((r, k, o), jnp.float32)),
      turn_rewards=rewards, turn_mask=live, done=final_state.done,
      state_ids=jnp.concatenate([recs["state_id"], env.state_id(final_state)[:, None]], -1),
      success=success)
  if "distance" in recs:
    flat["distances"] = jnp.concatenate(
        [recs["distance"], env.optimal_distance(final_state)[:, None]], -1)
  if "milestones" in recs:
    flat["milestones"] = jnp.concatenate(
        [recs["milestones"], env.milestones(final_state)[:, None]], 1)
  flat = {n: x.reshape((num_groups, r // num_groups) + x.shape[1:]) for n, x in flat.items()}
  return Episodes(**flat, parent=jnp.asarray(parent, jnp.int32),
                  fork_turn=jnp.asarray(fork_turn, jnp.int32))


LAYOUTS = ("rows", "cascade")  # KV-cache layouts of the samplers (module docstring)


def _check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}.")


def _check(pcfg, env, num_groups, group_size, k):
  t = sequence_length(env, k)
  if t > pcfg.max_len:
    raise ValueError(f"trajectory length T = O + K (A + O) = {t} > pcfg.max_len = "
                     f"{pcfg.max_len}.")
  if pcfg.vocab_size < env.vocab_size:
    raise ValueError(f"pcfg.vocab_size = {pcfg.vocab_size} < env.vocab_size = "
                     f"{env.vocab_size}.")
  if num_groups < 1 or group_size < 1:
    raise ValueError(f"need num_groups, group_size >= 1; got {num_groups}, {group_size}.")


# ----------------------------------------------------------------------------
# Samplers.


@functools.partial(jax.jit, static_argnames=("pcfg", "env", "num_groups", "group_size",
                                             "num_turns", "layout"))
def sample_episodes(params, pcfg: decoder.PolicyConfig, env, key, num_groups: int,
                    group_size: int, temperature=1.0, *, num_turns: Optional[int] = None,
                    start=None, vocab: Optional[VocabMap] = None,
                    layout: str = "cascade") -> Episodes:
  """G i.i.d. trajectories from each of B start states: Episodes [B, G, ...].

  K = num_turns (default env.max_turns) turns, static; the env's own limit still
  ends episodes at env.max_turns. Needs T = O + K (A + O) <= pcfg.max_len.
  start: optional (state, obs, obs_mask) of B fresh episodes (e.g. fixed evaluation
  levels from `env.reset`) instead of `env.reset(fold_in(key, 0), B)`.
  vocab: a `VocabMap` when the policy has its own vocabulary (a pretrained LM); the
  trajectory's tokens are then policy tokens.
  layout (static, `LAYOUTS`): the KV cache, 'cascade' (obs0 once per group; module
  docstring) or 'rows' (each row's own, obs0 included). Same episodes up to float rounding.
  parent = -1 and fork_turn = 0 everywhere.
  """
  _check_layout(layout)
  k = num_turns_of(env, num_turns)
  _check(pcfg, env, num_groups, group_size, k)
  carry, obs0, obs0_mask = _start(env, pcfg, key, num_groups, group_size, start, vocab,
                                  layout=layout, params=params, num_turns=k)
  u = _uniforms(key, num_groups, np.arange(group_size), env, k)
  temperature = jnp.asarray(temperature, jnp.float32)
  carry, recs = _run_turns(params, pcfg, env, vocab, temperature, carry, 0, k, u)
  shape = (num_groups, group_size)
  return _episodes(env, num_groups, obs0, obs0_mask, recs, carry[0],
                   jnp.full(shape, -1), jnp.zeros(shape))


def fork_layout(num_chains: int, num_forks: int, fork_turn: int):
  """Static tree over G = N C trajectories (NumPy): (parent [G], fork_turn [G], node [G]).

  g = n C + c is continuation c of chain n; c = 0 is the chain itself (parent -1),
  c >= 1 forks from g' = n C at turn fork_turn. node is the randomness id.
  """
  n, c = np.divmod(np.arange(num_chains * num_forks), num_forks)
  parent = np.where(c == 0, -1, n * num_forks)
  node = np.where(c == 0, n, num_chains + n * (num_forks - 1) + c - 1)
  return (parent.astype(np.int32), np.where(c == 0, 0, fork_turn).astype(np.int32),
          node.astype(np.int32))


@functools.partial(jax.jit, static_argnames=("pcfg", "env", "num_groups", "num_chains",
                                             "num_forks", "fork_turn", "num_turns", "layout"))
def fork_episodes(params, pcfg: decoder.PolicyConfig, env, key, num_groups: int,
                  num_chains: int, num_forks: int, fork_turn: int, temperature=1.0, *,
                  num_turns: Optional[int] = None, start=None,
                  vocab: Optional[VocabMap] = None, layout: str = "cascade") -> Episodes:
  """Tree sampling over turns: Episodes [B, G = N C, ...] with parent and fork_turn.

  Per start state, N chains run turns [0, fork_turn); each row (env state, KV
  cache, records) is then copied C times and all N C rows run turns
  [fork_turn, K) with their own randomness (`fork_layout`; module docstring), so
  the shared prefix is computed once. Continuation c = 0 equals chain n of
  `sample_episodes(group_size=N)` with the same key. A chain already done at the
  fork gives C identical copies. 0 <= fork_turn < K (static); num_turns, start,
  vocab and layout as in `sample_episodes` (with 'cascade' a fork copies the rows' own
  slots only, the groups' obs0 prefixes stay shared).
  """
  _check_layout(layout)
  k = num_turns_of(env, num_turns)
  _check(pcfg, env, num_groups, num_chains * num_forks, k)
  if not 0 <= fork_turn < k:
    raise ValueError(f"fork_turn must be in [0, K = {k}); got {fork_turn}.")
  parent, fork_at, node = fork_layout(num_chains, num_forks, fork_turn)
  temperature = jnp.asarray(temperature, jnp.float32)
  carry, obs0, obs0_mask = _start(env, pcfg, key, num_groups, num_chains, start, vocab,
                                  layout=layout, params=params, num_turns=k)
  u = _uniforms(key, num_groups, np.arange(num_chains), env, k)
  carry, head = _run_turns(params, pcfg, env, vocab, temperature, carry, 0, fork_turn, u)
  rep = lambda x, axis=0: jnp.repeat(x, num_forks, axis=axis)  # row r -> rows r C .. r C + C-1
  state, cache, pending = carry
  # A cascade cache's own slots are copied, its obs0 prefixes kept shared.
  carry = (jax.tree.map(rep, state), sampling.map_cache_rows(lambda x: rep(x, 1), cache),
           rep(pending))
  u = _uniforms(key, num_groups, node, env, k)
  carry, tail = _run_turns(params, pcfg, env, vocab, temperature, carry, fork_turn, k, u)
  recs = jax.tree.map(lambda h, t: jnp.concatenate([rep(h), t], axis=1), head, tail)
  shape = (num_groups, num_chains * num_forks)
  return _episodes(env, num_groups, rep(obs0), rep(obs0_mask), recs, carry[0],
                   jnp.broadcast_to(parent, shape), jnp.broadcast_to(fork_at, shape))


# ----------------------------------------------------------------------------
# Expert demonstrations, solver values and answer probes.


@functools.partial(jax.jit, static_argnames=("env", "num_groups", "num_turns"))
def expert_episodes(env, key, num_groups: int, *, num_turns: Optional[int] = None,
                    start=None) -> Episodes:
  """Episodes [B, 1, ...] of the environment's own expert (`env.expert_action`, e.g. a
  privileged shortest-plan policy) from `env.reset(fold_in(key, 0), B)` (or `start`), in
  the sampler's layout (log-probs 0): demonstrations for a supervised warm start."""
  k = num_turns_of(env, num_turns)
  (state, _, pending), obs0, obs0_mask = _start(env, None, key, num_groups, 1, start)

  def turn(state, _):
    actions, mask = env.expert_action(state)
    policy = mask & ~state.done[:, None]
    return _env_turn(env, state, jnp.where(policy, actions, env.pad_id), policy,
                     jnp.zeros(actions.shape, jnp.float32))

  state, recs = jax.lax.scan(turn, state, None, length=k)
  recs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), recs)
  zeros = jnp.zeros((num_groups, 1), jnp.int32)
  return _episodes(env, num_groups, obs0, obs0_mask, recs, state, zeros - 1, zeros)


def solver_values(episodes: Episodes, env, gamma: float = 1.0) -> jax.Array:
  """float32 [B, G, K+1]: R_{<k} + V*(s_k) for CAST (`credit.turn_signals.cast`), from the
  environment's solver distances d (`episodes.distances`): for an outcome reward of 1,
  V*(s) = γ^(d−1), and 0 where d = 0 (solved, or a terminal state), plus the reward
  collected before turn k, so that a finished trajectory's last value is its return.

  V* ignores the turn limit: running out of turns is a truncation, so a trajectory cut by
  it bootstraps from its last state's value (partial-episode bootstrapping) instead of
  ending at 0. Choice: with horizon-aware values (0 once d exceeds the turns left) the
  action at which the deadline became infeasible, whatever it was, took the whole value
  (−0.77 on one turn of every failed `household` trajectory). The environment's
  `optimal_distance` must then keep the distance of a state whose episode ran out of
  turns (household does; webshop's is 0 once done, so there the last turn of a
  truncated trajectory still takes its value). CAST training on household collapses
  with either variant (README, "Multi-turn agents")."""
  if episodes.distances is None:
    raise ValueError(f"environment {env.name!r} has no solver (optimal_distance); CAST "
                     f"needs one.")
  d = episodes.distances.astype(jnp.float32)
  v = jnp.where(d >= 1, jnp.float32(gamma) ** (d - 1), 0.0)
  rewards = jnp.where(episodes.turn_mask, episodes.turn_rewards, 0.0)
  before = jnp.concatenate([jnp.zeros_like(rewards[..., :1]), jnp.cumsum(rewards, -1)], -1)
  return before + v


def milestone_turns(episodes: Episodes, env) -> jax.Array:
  """int32 [B, G, K]: the milestones turn k achieves for the first time in its trajectory
  (held by the state after it, by no earlier state, the start included), 0 on untaken
  turns (BEACON's segment boundaries, `credit.milestones.beacon`)."""
  if episodes.milestones is None:
    raise ValueError(f"environment {env.name!r} reports no milestones (env.milestones); "
                     f"milestone credit needs them (household has them).")
  m = episodes.milestones.astype(bool)  # [B, G, K+1, M]
  before = jax.lax.cummax(m.astype(jnp.int32), axis=2).astype(bool)  # held by s_0 .. s_k
  new = m[:, :, 1:] & ~before[:, :, :-1]
  return jnp.where(episodes.turn_mask, jnp.sum(new, -1), 0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("pcfg", "env", "num_turns"))
def info_gains(params, pcfg: decoder.PolicyConfig, env, tokens, policy_mask, pad, *,
               num_turns: Optional[int] = None):
  """InfoPO's counterfactual probes: float32 [..., K], for turn k the mean over the next
  action's policy tokens of log p_θ(token | history) − log p_θ(token | history with turn k's
  observation replaced by `pad`), one teacher-forced forward for the history as sampled and
  one per k with the feedback masked (causal attention makes each exact whatever follows).
  0 where turn k has no next action (its last turn, or the next action is not taken)."""
  k = num_turns_of(env, num_turns)
  action_pos, obs_pos, _ = slot_layout(env, k)
  shape = tokens.shape
  flat = tokens.reshape(-1, shape[-1]).astype(jnp.int32)
  on = policy_mask.reshape(flat.shape)
  lp = lambda x: decoder.token_logprobs(params, pcfg, x[:, :1], x[:, 1:])[0]
  factual = lp(flat)  # [R, T-1]: log p of token t+1

  def probe(_, i):  # turn i's observation masked; read action i+1
    x = flat.at[:, jnp.asarray(obs_pos)[i]].set(pad)
    nxt = jnp.asarray(action_pos)[jnp.minimum(i + 1, k - 1)]
    diff = jnp.take(factual - lp(x), nxt - 1, axis=1)  # [R, A]
    m = jnp.take(on, nxt, axis=1) & (i + 1 < k)
    return None, jnp.sum(jnp.where(m, diff, 0.0), -1) / jnp.maximum(jnp.sum(m, -1), 1)

  _, out = jax.lax.scan(probe, None, jnp.arange(k))
  return out.T.reshape(shape[:-1] + (k,))


@functools.partial(jax.jit, static_argnames=("pcfg", "env", "num_turns"))
def feedback_logprobs(params, pcfg: decoder.PolicyConfig, env, tokens, turn_mask, pad, *,
                      num_turns: Optional[int] = None):
  """float32 [..., K]: for turn k, the policy's mean per-token log p_θ of the observation that
  followed action k (its tokens before the padding), given the history through the action:
  how well the policy predicted its feedback (ReBel's belief consistency, `credit.milestones.
  rebel`). One teacher-forced forward; 0 on untaken turns and observations of no tokens."""
  k = num_turns_of(env, num_turns)
  _, obs_pos, _ = slot_layout(env, k)
  lp = teacher_forced_logprobs(params, pcfg, tokens)  # [..., T]
  obs = jnp.take(lp, jnp.asarray(obs_pos), axis=-1)  # [..., K, O]
  real = jnp.take(tokens, jnp.asarray(obs_pos), axis=-1) != pad
  total = jnp.sum(jnp.where(real, obs, 0.0), -1)
  return jnp.where(turn_mask, total / jnp.maximum(jnp.sum(real, -1), 1), 0.0)


def expert_matches(episodes: Episodes, expert: Episodes, env, num_turns=None) -> jax.Array:
  """bool [B, G, K]: turn k's action equals an action of the expert's trajectory from the
  same start (`expert`: [B, 1, ...], `expert_episodes` from the groups' start states) that
  no earlier turn of the trajectory matched (MatchTIR's bipartite matching of predicted and
  reference tool calls, `credit.expert_traces.matchtir`; `match_actions`)."""
  _, acts, _ = split_slots(episodes.tokens, env, num_turns)  # [B, G, K, A]
  _, ref, _ = split_slots(expert.tokens, env, num_turns)  # [B, 1, K, A]
  return match_actions(acts, episodes.turn_mask, ref, expert.turn_mask)


@jax.jit
def match_actions(actions, turn_mask, reference, reference_mask):
  """bool [B, G, K]: a one-to-one matching of each trajectory's taken actions (actions
  [B, G, K, A], turn_mask [B, G, K]) to equal actions of its group's reference trace
  (reference [B, 1, K', A], reference_mask [B, 1, K']), each turn taking the first reference
  action no earlier turn took. For equality of whole actions this greedy matching is a
  maximum one (equal actions are interchangeable). False on untaken turns."""
  eq = jnp.all(actions[:, :, :, None] == reference[:, :, None], -1)  # [B, G, K, K']
  eq &= reference_mask[:, :, None, :] & turn_mask[..., None]

  def one(eq):  # [K, K']: in turn order
    def turn(used, row):
      free = row & ~used
      hit = jnp.any(free)
      return used | ((jnp.arange(row.shape[0]) == jnp.argmax(free)) & hit), hit

    return jax.lax.scan(turn, jnp.zeros(eq.shape[1], bool), eq)[1]

  return jax.vmap(jax.vmap(one))(eq)


def solver_steps(episodes: Episodes, env) -> jax.Array:
  """float32 [B, G, K+1]: N(s_k), the solver's turns still needed to succeed from each state
  (`episodes.distances`; CAST's step-count advantage, `credit.turn_signals.cast`). Reading: a
  trajectory that ended without success at a state of distance 0 (webshop: any purchase
  ends the episode with distance 0) keeps its previous state's count there, so the
  failing last turn gets no step-count credit (the outcome term scores it); household's
  turn-limit truncations keep their distance already (see `solver_values`)."""
  if episodes.distances is None:
    raise ValueError(f"environment {env.name!r} has no solver (optimal_distance); CAST "
                     f"needs one.")
  n = episodes.distances.astype(jnp.float32)
  last = jnp.sum(episodes.turn_mask, -1)  # index of the state after the last turn
  at = lambda i: jnp.take_along_axis(n, jnp.maximum(i, 0)[..., None], -1)[..., 0]
  failed = (~episodes.success) & (at(last) == 0) & (last >= 1)
  fixed = jnp.where(failed, at(last - 1), at(last))
  k = jnp.arange(n.shape[-1])
  return jnp.where(k == last[..., None], fixed[..., None], n)


def _flat_answers(tokens, answer, answer_mask):
  """(tokens [R, T], answer int32 [R, A], answer_mask [R, A]): the leading dims flattened."""
  ans = answer.reshape(-1, answer.shape[-1]).astype(jnp.int32)
  return (tokens.reshape(-1, tokens.shape[-1]).astype(jnp.int32), ans,
          answer_mask.reshape(ans.shape))


def _answer_score(params, pcfg, x, pos, amask):
  """float32 [R]: the mean log p of the answer tokens at positions pos [R, A] of x [R, T]
  (one teacher-forced forward), over amask."""
  lp, _ = decoder.token_logprobs(params, pcfg, x[:, :1], x[:, 1:])
  lp = jnp.take_along_axis(lp, pos - 1, axis=1)  # [R, A]: log p of each answer token
  return jnp.sum(jnp.where(amask, lp, 0.0), -1) / jnp.maximum(jnp.sum(amask, -1), 1)


@functools.partial(jax.jit, static_argnames=("pcfg", "env", "num_turns"))
def answer_logprobs(params, pcfg: decoder.PolicyConfig, env, tokens, answer, answer_mask, *,
                    num_turns: Optional[int] = None):
  """IGPO's probes: float32 [..., K+1], the mean per-token log p_θ(gold answer | history
  before turn k) of trajectories tokens [..., T] (the sampler's layout), answer int32
  [..., A] with answer_mask bool [..., A] (e.g. `env.answer` of the start state).

  Probe k puts the answer in turn k's action slot (the context is the trajectory up to
  that slot, which causal attention makes exact whatever follows), one teacher-forced
  forward per k = 0 .. K−1. Index K (after a K-th turn) has no slot and is not probed:
  it repeats index K−1 (IGPO reads p only before a trajectory's last turn).
  """
  k = num_turns_of(env, num_turns)
  action_pos, _, _ = slot_layout(env, k)
  shape = tokens.shape
  flat, ans, amask = _flat_answers(tokens, answer, answer_mask)

  def probe(_, pos):  # pos [A]: the action slot the answer goes into
    x = flat.at[:, pos].set(ans)
    return None, _answer_score(params, pcfg, x, jnp.broadcast_to(pos, ans.shape), amask)

  _, out = jax.lax.scan(probe, None, jnp.asarray(action_pos, jnp.int32))
  out = jnp.concatenate([out, out[-1:]], 0).T  # [R, K+1]
  return out.reshape(shape[:-1] + (k + 1,))


@functools.partial(jax.jit, static_argnames=("pcfg", "env", "at", "num_turns"))
def masked_answer_logprobs(params, pcfg: decoder.PolicyConfig, env, tokens, answer, answer_mask,
                           turn_mask, pad, *, at: str, num_turns: Optional[int] = None):
  """Answer probes without one turn's observation: float32 [..., K]. For turn k, the mean
  per-token log p_θ(gold answer | context) of `answer_logprobs`, the context being the
  trajectory with turn k's observation slot replaced by `pad` and cut at the action slot the
  answer goes into: turn k+1's (at='next', TACO's probe "without the tool" right after the
  call; its "with" is answer_logprobs[..., k+1]) or the trajectory's last taken turn's
  (at='last', ICA's final posterior without the view turn k returned; its "with" is
  answer_logprobs[..., n−1]). One teacher-forced forward per k; 0 where no taken turn
  follows turn k (k >= n − 1), whose observation no later decision reads.
  tokens [..., T] (the sampler's layout), answer int32 / answer_mask bool [..., A], turn_mask
  bool [..., K]."""
  if at not in ("next", "last"):
    raise ValueError(f"at must be 'next' or 'last'; got {at!r}.")
  k = num_turns_of(env, num_turns)
  action_pos, obs_pos, _ = slot_layout(env, k)
  shape = tokens.shape
  flat, ans, amask = _flat_answers(tokens, answer, answer_mask)
  n = jnp.sum(turn_mask.reshape(-1, k), -1, dtype=jnp.int32)  # [R]
  apos, opos = jnp.asarray(action_pos, jnp.int32), jnp.asarray(obs_pos, jnp.int32)
  rows = jnp.arange(flat.shape[0])[:, None]

  def probe(_, i):  # turn i's observation masked; the answer into the chosen slot
    slot = jnp.full_like(n, i + 1) if at == "next" else n - 1
    pos = apos[jnp.clip(slot, 0, k - 1)]  # [R, A]
    x = flat.at[:, opos[i]].set(pad).at[rows, pos].set(ans)
    return None, jnp.where(i < n - 1, _answer_score(params, pcfg, x, pos, amask), 0.0)

  _, out = jax.lax.scan(probe, None, jnp.arange(k))
  return out.T.reshape(shape[:-1] + (k,))
