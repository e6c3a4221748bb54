"""The `MultiTurnEnv` interface: multi-turn agent environments as pure array functions.

Beside the single-turn `envs.base.Task`: an environment is a frozen (hashable)
dataclass of static hyperparameters, and its state a `flax.struct.dataclass`
pytree whose leaves all have leading dim n (one row per episode):

  state, obs, obs_mask = env.reset(key, n)      # int32 [n, O], bool [n, O]
  state, obs, obs_mask, reward, done, info = env.step(state, actions, action_mask)
                                                # actions int32 [n, A], bool [n, A]
                                                # reward float32 [n], done bool [n]
  ids = env.state_id(state)                     # int32 [n]

Both are deterministic functions of their arguments (stochastic environments
carry their random stream in the state), jittable, and vmap over extra leading
dims (e.g. `jax.vmap(env.step)` over [G, n, ...]).

Conventions (all environments):
  - Observations: `obs_mask` is True on a prefix (the observation's tokens) and
    `obs` is `pad_id` after it. O = `obs_len` is static. The observation is a
    function of the state (`observe`), so feedback such as an error message is
    kept in the state.
  - Actions: like `Task` responses, an action is the masked prefix of
    `actions` up to and including its first end-of-action token `eoa_id`;
    A = `action_len` is the longest. Tokens after it are ignored. What counts as
    a valid action, and what an invalid one does, is up to the environment
    (`info["invalid"]` is True for it).
  - Turns: every step on a live episode counts one turn (`state.turn`); an
    episode is done when the environment says so (e.g. solved) or after
    K = `max_turns` turns.
  - Done episodes are absorbing: stepping a done state returns the same state,
    its observation, reward 0, done True, and every `info` entry zeroed.
  - `state_id` is a canonical 32-bit hash of the state's arrays (the turn
    counter excluded unless `with_turn=True`; the random stream of stochastic
    environments always excluded): equal states get equal ids, and different
    states different ids up to 32-bit hash collisions.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from envs import base
from trees.lcp import mix32  # MurmurHash3's 32-bit finaliser

EOA = "<eoa>"
PAD = base.PAD

Info = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class MultiTurnEnv(base.Vocabulary):
  """Base class: static hyperparameters (dataclass fields) plus array functions.

  Subclasses define `vocab`, `obs_len`, `action_len`, `max_turns`, `_init`,
  `_transition`, `observe` and `_state_arrays`; the base class adds the turn
  counter, the turn limit and absorbing done states in `step`. Their state
  type must have fields `turn` (int32 [n]) and `done` (bool [n]).
  """

  # --- static properties ----------------------------------------------------------------------

  @property
  def eoa_id(self) -> int:
    """The end-of-action token."""
    return self.vocab.index(EOA)

  @property
  def obs_len(self) -> int:
    """O, the (padded) observation length."""
    raise NotImplementedError

  @property
  def action_len(self) -> int:
    """A, the longest action, including its end-of-action token."""
    raise NotImplementedError

  @property
  def max_turns(self) -> int:
    """K, the turn limit of an episode."""
    raise NotImplementedError


  # --- subclass hooks -------------------------------------------------------------------------

  def _init(self, key: jax.Array, n: int):
    """The initial state of n episodes (turn 0, not done)."""
    raise NotImplementedError

  def _transition(self, state, actions, action_mask):
    """One step ignoring turns and done: (next_state, reward, terminal, info).

    next_state keeps state's `turn` and `done` (the base class sets them);
    terminal bool [n] ends the episode (before the turn limit); info is a dict
    of arrays with leading dim n, with at least "invalid" bool [n].
    """
    raise NotImplementedError

  def observe(self, state) -> tuple[jax.Array, jax.Array]:
    """The observation of a state: int32 [n, O], bool [n, O] (feedback such as an error
    message is part of the state)."""
    raise NotImplementedError

  def _state_arrays(self, state) -> list[jax.Array]:
    """The arrays (leading dim n) that make up the state, besides `turn` and `done`."""
    raise NotImplementedError

  # --- array functions ------------------------------------------------------------------------

  def reset(self, key: jax.Array, n: int):
    """n new episodes: (state, obs int32 [n, O], obs_mask bool [n, O])."""
    state = self._init(key, n)
    return (state, *self.observe(state))

  def step(self, state, actions, action_mask):
    """One turn: (state, obs [n, O], obs_mask [n, O], reward f32 [n], done bool [n], info).

    actions int32 [n, A] with action_mask bool [n, A]. Done rows are absorbing.
    """
    actions = jnp.asarray(actions, jnp.int32)
    action_mask = jnp.asarray(action_mask, bool)
    nxt, reward, terminal, info = self._transition(state, actions, action_mask)
    turn = state.turn + 1
    nxt = nxt.replace(turn=turn, done=terminal | (turn >= self.max_turns))
    live = ~state.done
    nxt = tree_where(live, nxt, state)
    obs, obs_mask = self.observe(nxt)
    reward = jnp.where(live, reward, 0.0).astype(jnp.float32)
    info = {k: jnp.where(_expand(live, v), v, jnp.zeros_like(v)) for k, v in info.items()}
    return nxt, obs, obs_mask, reward, nxt.done, info

  def state_id(self, state, with_turn: bool = False) -> jax.Array:
    """int32 [n]: a canonical hash of each state (its turn too iff with_turn)."""
    arrays = list(self._state_arrays(state)) + [state.done]
    if with_turn:
      arrays.append(state.turn)
    return hash_arrays(arrays)

  # --- helpers --------------------------------------------------------------------------------

  def encode(self, tokens) -> np.ndarray:
    """int32 [T] ids of a sequence of token strings (host side)."""
    return np.asarray([self.token_id(t) for t in tokens], np.int32)

  def pad_action(self, tokens) -> tuple[np.ndarray, np.ndarray]:
    """One action from token strings, padded: (int32 [A], bool [A]) (host side)."""
    ids = self.encode(tokens)[:self.action_len]
    out = np.full((self.action_len,), self.pad_id, np.int32)
    out[:len(ids)] = ids
    return out, np.arange(self.action_len) < len(ids)


  def render(self, state, i: int = 0) -> str:
    """The text of episode i's current observation (host side)."""
    obs, mask = self.observe(state)
    return self.detokenize(np.where(np.asarray(mask[i]), np.asarray(obs[i]), self.pad_id))


# --- shared array helpers -----------------------------------------------------------------------


def _expand(cond, x):
  """cond [n] reshaped to broadcast against x [n, ...]."""
  return jnp.reshape(cond, cond.shape + (1,) * (jnp.ndim(x) - cond.ndim))


def tree_where(cond, a, b):
  """Per-row select between pytrees a and b of leaves [n, ...] (cond bool [n])."""
  return jax.tree.map(lambda x, y: jnp.where(_expand(cond, x), x, y), a, b)


def single_token_action(actions, action_mask, eoa_id: int, first_id: int, num: int):
  """Reads actions that are one token then EOA: (index int32 [n], valid bool [n]).

  actions int32 [n, A], action_mask bool [n, A] (A >= 2). Valid iff the first
  two tokens are masked in, the first is one of ids first_id .. first_id+num-1
  and the second is `eoa_id` (tokens after it are ignored); index is
  token - first_id, clipped to [0, num) (meaningless where not valid).
  """
  tok = jnp.where(action_mask, actions, -1)
  index = tok[:, 0] - first_id
  valid = (index >= 0) & (index < num) & (tok[:, 1] == eoa_id)
  return jnp.clip(index, 0, num - 1).astype(jnp.int32), valid


def _words(x, n):
  """x [n, ...] (bool or int) as uint32 words [n, M]."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint32)
  elif x.dtype != jnp.uint32:
    x = jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
  return x.reshape((n, -1))


def hash_arrays(arrays) -> jax.Array:
  """int32 [n]: a 32-bit hash of each row of arrays [n, ...] (bool or ≤32-bit int).

  Every word is mixed with its position (so the hash depends on order and
  layout), the mixed words are summed mod 2^32 and finalized; distinct rows
  collide with probability about 2^-32.
  """
  n = jnp.shape(arrays[0])[0]
  words = jnp.concatenate([_words(a, n) for a in arrays], axis=1)  # [n, M]
  pos = jnp.arange(words.shape[1], dtype=jnp.uint32)
  salt = mix32(pos * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15))
  mixed = mix32(mix32(words ^ salt) + salt)
  h = mix32(jnp.sum(mixed, axis=1, dtype=jnp.uint32) ^ jnp.uint32(words.shape[1]))
  return jax.lax.bitcast_convert_type(h, jnp.int32)
