"""A small random finite-horizon MDP whose V^π, Q^π and advantages are known exactly.

States 0 .. S-1: S-1 is the goal and S-2 a trap, both terminal; the others are
the live states, and episodes start uniformly on them. From a live state s,
action a moves to s' ~ P[s, a]: `branching` distinct successors (any state,
terminal ones included) with Dirichlet(1) probabilities. Reward of a step:
R[s, a, s'] = [s' = goal] + ρ[s, a], with ρ uniform in
[-step_reward_scale, step_reward_scale] (default 0: only the goal pays). The
tables come from NumPy with `seed`, so the MDP is fixed per environment.

Vocabulary (S + A + 2 tokens): 's0' .. 's{S-1}' (ids 0 .. S-1), 'a0' .. 'a{A-1}'
(ids S .. S+A-1), EOA, PAD. Observation (O = 1): the state's token.
Action (A = 2): one action token then EOA. Anything else is invalid: a no-op
(same state, reward 0; the turn counts), `info["invalid"]`.
The episode ends on entering a terminal state or after K = `max_turns` turns.
Info: "invalid", "goal" (entered the goal) bool [n].

Exact values (`values`) for a tabular policy π = softmax(logits), logits
[S, A] (or [K, S, A], one per turn), discount γ, by backward induction over
turns t = K-1 .. 0 from V[K] = 0:

  Q[t, s, a] = Σ_s' P[s, a, s'] (R[s, a, s'] + γ [s' live] V[t+1, s']),
  V[t, s] = Σ_a π_t(a | s) Q[t, s, a],    A[t, s, a] = Q[t, s, a] - V[t, s],

and V = Q = A = 0 on terminal states. Invalid actions are outside this model.
`sample_actions(key, logits, state)` samples π's action tokens and
`step_advantages(values, s, a, turn)` gathers A^π for sampled turns.
Transitions are sampled from a counter-based stream kept in the state (a
hash of the episode's seed and the turn), so `step` is a pure function.
"""

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from envs import multiturn
from trees.lcp import mix32


@flax.struct.dataclass
class MDPState:
  """n episodes of the exact MDP.

  Attributes:
    s: int32 [n], the current state; turn: int32 [n]; done: bool [n].
    rng: uint32 [n], the episode's random stream (not part of the MDP state:
      `state_id` ignores it).
  """

  s: jax.Array
  turn: jax.Array
  done: jax.Array
  rng: jax.Array


@flax.struct.dataclass
class MDPValues:
  """Exact values of a tabular policy.

  Attributes:
    v: float32 [K+1, S], V[t, s] at turn t (V[K] = 0).
    q: float32 [K, S, A], Q[t, s, a].
    adv: float32 [K, S, A], A[t, s, a] = Q - V.
    policy: float32 [K, S, A], π_t(a | s).
  """

  v: jax.Array
  q: jax.Array
  adv: jax.Array
  policy: jax.Array


def _uniform(rng, turn):
  """float32 uniforms in [0, 1) from a counter-based hash of (rng, turn) (uint32, int32 [...])."""
  x = rng ^ mix32(turn.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + 1)
  h = mix32(mix32(x) + jnp.uint32(0x632BE5AB))
  return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


@dataclasses.dataclass(frozen=True)
class ExactMDP(multiturn.MultiTurnEnv):
  """A random tabular MDP with a goal and a trap, known exactly."""

  num_states: int = 6
  num_actions: int = 3
  max_turns: int = 4
  branching: int = 2
  step_reward_scale: float = 0.0
  seed: int = 0

  name = "exact_mdp"
  separator = " "

  def validate(self):
    s, a = self.num_states, self.num_actions
    if not (isinstance(s, int) and 3 <= s <= 64):
      raise ValueError(f"num_states must be an int in [3, 64]; got {s!r}.")
    if not (isinstance(a, int) and 2 <= a <= 16):
      raise ValueError(f"num_actions must be an int in [2, 16]; got {a!r}.")
    if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
      raise ValueError(f"max_turns must be an int >= 1; got {self.max_turns!r}.")
    if not (isinstance(self.branching, int) and 1 <= self.branching <= s):
      raise ValueError(f"branching must be an int in [1, num_states={s}]; got {self.branching!r}.")
    if not self.step_reward_scale >= 0:
      raise ValueError(f"step_reward_scale must be >= 0; got {self.step_reward_scale!r}.")

  @property
  def vocab(self):
    return (tuple(f"s{i}" for i in range(self.num_states))
            + tuple(f"a{i}" for i in range(self.num_actions)) + (multiturn.EOA, multiturn.PAD))

  @property
  def obs_len(self):
    return 1

  @property
  def action_len(self):
    return 2

  @property
  def goal(self) -> int:
    return self.num_states - 1

  @property
  def trap(self) -> int:
    return self.num_states - 2

  @property
  def num_live(self) -> int:
    """Live (non-terminal) states are 0 .. num_live - 1."""
    return self.num_states - 2

  # --- the tables -----------------------------------------------------------------------------

  @functools.cached_property
  def tables(self) -> tuple[np.ndarray, np.ndarray]:
    """(P float32 [S, A, S], R float32 [S, A, S]); terminal rows self-loop with reward 0."""
    s, a = self.num_states, self.num_actions
    rng = np.random.default_rng(self.seed)
    p = np.zeros((s, a, s))
    r = np.zeros((s, a, s))
    for i in range(s):
      for j in range(a):
        if i >= self.num_live:
          p[i, j, i] = 1.0
          continue
        succ = rng.choice(s, self.branching, replace=False)
        p[i, j, succ] = rng.dirichlet(np.ones(self.branching))
        r[i, j] = (np.arange(s) == self.goal) + rng.uniform(-1, 1) * self.step_reward_scale
    return p.astype(np.float32), r.astype(np.float32)

  @property
  def terminal(self) -> np.ndarray:
    """bool [S]."""
    return np.arange(self.num_states) >= self.num_live

  # --- dynamics -------------------------------------------------------------------------------

  def _init(self, key, n):
    bits = jax.random.bits(key, (n, 2), jnp.uint32)
    u = (bits[:, 0] >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
    s = jnp.minimum(jnp.floor(u * self.num_live), self.num_live - 1).astype(jnp.int32)
    return MDPState(s=s, turn=jnp.zeros((n,), jnp.int32), done=jnp.zeros((n,), bool),
                    rng=bits[:, 1])

  def _transition(self, state, actions, action_mask):
    a, valid = multiturn.single_token_action(actions, action_mask, self.eoa_id,
                                             self.num_states, self.num_actions)
    p, r = (jnp.asarray(x) for x in self.tables)
    cdf = jnp.cumsum(p[state.s, a], axis=-1)  # [n, S]
    u = _uniform(state.rng, state.turn)
    nxt_s = jnp.sum(u[:, None] >= cdf[:, :-1], axis=-1).astype(jnp.int32)
    nxt_s = jnp.where(valid, nxt_s, state.s)
    reward = jnp.where(valid, r[state.s, a, nxt_s], 0.0)
    nxt = state.replace(s=nxt_s)
    terminal = nxt_s >= self.num_live
    info = {"invalid": ~valid, "goal": nxt_s == self.goal}
    return nxt, reward, terminal, info

  def observe(self, state):
    """The state's token int32 [n, 1]; mask all True."""
    obs = state.s[:, None].astype(jnp.int32)
    return obs, jnp.ones(obs.shape, bool)

  def _state_arrays(self, state):
    return [state.s]

  def action_tokens(self, a):
    """Actions from indices int32 [n]: (int32 [n, 2], bool [n, 2])."""
    a = jnp.asarray(a, jnp.int32)
    tokens = jnp.stack([a + self.num_states, jnp.full_like(a, self.eoa_id)], -1)
    return tokens, jnp.ones(tokens.shape, bool)

  # --- the tabular policy ---------------------------------------------------------------------

  def _policy(self, logits):
    """π float32 [K, S, A] from logits [S, A] or [K, S, A]."""
    logits = jnp.asarray(logits, jnp.float32)
    shape = (self.max_turns, self.num_states, self.num_actions)
    return jax.nn.softmax(jnp.broadcast_to(logits, shape), axis=-1)

  def sample_actions(self, key, logits, state):
    """a ~ π_turn(· | s): (tokens int32 [n, 2], mask bool [n, 2], a int32 [n])."""
    pi = self._policy(logits)
    probs = pi[jnp.clip(state.turn, 0, self.max_turns - 1), state.s]  # [n, A]
    a = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
    return (*self.action_tokens(a), a)

  def values(self, logits, gamma: float = 1.0) -> MDPValues:
    """Exact V^π, Q^π and A^π (module docstring) of π = softmax(logits)."""
    pi = self._policy(logits)
    p, r = (jnp.asarray(x) for x in self.tables)
    live = jnp.asarray(~self.terminal)
    v = [jnp.zeros((self.num_states,), jnp.float32)]
    qs = []
    for t in reversed(range(self.max_turns)):  # K is static and small
      q = jnp.sum(p * (r + gamma * jnp.where(live, v[0], 0.0)), axis=-1)  # [S, A]
      q = jnp.where(live[:, None], q, 0.0)
      qs.insert(0, q)
      v.insert(0, jnp.sum(pi[t] * q, axis=-1))
    v, q = jnp.stack(v), jnp.stack(qs)
    return MDPValues(v=v, q=q, adv=q - v[:-1, :, None], policy=pi)

  def step_advantages(self, values: MDPValues, s, a, turn):
    """A^π[turn, s, a] gathered for int arrays s, a, turn of any (equal) shape: float32."""
    turn = jnp.clip(turn, 0, self.max_turns - 1)
    return values.adv[turn, s, a]
