"""Step-level experience retrieval (SLEA-RL, seed #46): an environment wrapper whose observations
carry what an experience library knows about the current observation's cluster.

SLEA-RL retrieves experiences at every decision step, conditioned on the current observation,
from a library indexed by clusters of "structurally equivalent" states. Our reading, for token
agents with no language model to write the experiences: a cluster is an observation (states that
look the same to the agent: `cluster='observation'`, the hash of the inner observation's tokens;
`'state'` keeps the inner environment's exact state id), and an experience is an action, either
a strategy ("tip": an action that succeeded from this cluster) or a failure pattern ("avoid": an
action after which every episode failed). The library is a direct-mapped table of `slots`
entries per kind, entry = cluster % slots, holding the cluster (so a collision is a miss, not a
wrong hint) and the action's tokens before its end-of-action token.

`ExperienceEnv(inner)` plays `inner` and appends to every observation

  tip a_1 .. a_{A-1}      when the library holds a strategy for the observation's cluster,
  avoid b_1 .. b_{A-1}    when it holds a failure pattern for it,

(pad after the action's end), so O = inner O + 2A. The library rides in the state, a copy per
episode (the sampler copies states, never closes over arrays), attached to start states by
`with_library`; `reset` attaches an empty one (no hints: the inner environment's observations
with padding after them). The wrapper's `state_id` is the cluster (so GiGPO's anchor groups, the
step-level credit SLEA-RL trains with, are the library's clusters). How the library learns is
`experiments/training/experience.py`.
"""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp

from envs import _cot, multiturn

TIP, AVOID = "tip", "avoid"
CLUSTERS = ("observation", "state")


@flax.struct.dataclass
class Library:
  """An experience library of S slots per kind, any leading dims.

  Attributes:
    tip_key: int32 [..., S], the cluster of the strategy in each slot.
    tip: int32 [..., S, A-1], its action's tokens before end-of-action (pad after its end).
    tip_score: float32 [..., S], the strategy's success rate from its cluster (a running
      estimate); −1 where the slot is empty.
    avoid_key: int32 [..., S], the cluster of the failure pattern in each slot.
    avoid: int32 [..., S, A-1], its action's tokens.
    avoid_count: float32 [..., S], the failed episodes that took it when it was admitted; −1
      where the slot is empty.
  """

  tip_key: jax.Array
  tip: jax.Array
  tip_score: jax.Array
  avoid_key: jax.Array
  avoid: jax.Array
  avoid_count: jax.Array

  @property
  def slots(self) -> int:
    return self.tip_key.shape[-1]


def empty_library(slots: int, action_len: int, pad_id: int) -> Library:
  """A library of `slots` empty slots per kind for actions of `action_len` tokens."""
  z = jnp.zeros((slots,), jnp.int32)
  acts = jnp.full((slots, action_len - 1), pad_id, jnp.int32)
  none = jnp.full((slots,), -1.0, jnp.float32)
  return Library(tip_key=z, tip=acts, tip_score=none, avoid_key=z, avoid=acts, avoid_count=none)


def slot_of(cluster, slots: int):
  """int32: the slot of a cluster id (direct-mapped on its unsigned value)."""
  u = jax.lax.bitcast_convert_type(jnp.asarray(cluster, jnp.int32), jnp.uint32)
  return (u % jnp.uint32(slots)).astype(jnp.int32)


def lookup(library: Library, cluster):
  """(tip, has_tip, avoid, has_avoid) of clusters [...] in a library without leading dims:
  int32 [..., A-1], bool [...] each."""
  s = slot_of(cluster, library.slots)
  has_tip = (library.tip_score[s] >= 0) & (library.tip_key[s] == cluster)
  has_avoid = (library.avoid_count[s] >= 0) & (library.avoid_key[s] == cluster)
  return library.tip[s], has_tip, library.avoid[s], has_avoid


def _per_episode(library: Library, n: int) -> Library:
  """The library with a leading dim of n episodes (every state carries its copy)."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), library)


@flax.struct.dataclass
class ExperienceState:
  inner: Any
  library: Library  # leaves [n, ...]: a copy per episode
  turn: jax.Array
  done: jax.Array


@dataclasses.dataclass(frozen=True)
class ExperienceEnv(multiturn.MultiTurnEnv):
  """`inner` with the library's hints after every observation (module docstring)."""

  inner: multiturn.MultiTurnEnv = None
  slots: int = 2048
  cluster: str = "observation"

  name = "experience"

  def validate(self):
    if not isinstance(self.inner, multiturn.MultiTurnEnv):
      raise ValueError(f"ExperienceEnv wraps a multi-turn environment; got {self.inner!r}.")
    if not (isinstance(self.slots, int) and self.slots >= 1):
      raise ValueError(f"slots must be an int >= 1; got {self.slots!r}.")
    if self.cluster not in CLUSTERS:
      raise ValueError(f"cluster must be one of {CLUSTERS}; got {self.cluster!r}.")
    for word in (TIP, AVOID):
      if word in self.inner.vocab:
        raise ValueError(f"{self.inner.name!r} already has the word {word!r}.")

  @property
  def vocab(self):  # the inner words keep their ids; the two markers come last
    return tuple(self.inner.vocab) + (TIP, AVOID)

  @property
  def separator(self):
    return self.inner.separator

  @property
  def obs_len(self):
    return self.inner.obs_len + 2 * self.inner.action_len

  @property
  def action_len(self):
    return self.inner.action_len

  @property
  def max_turns(self):
    return self.inner.max_turns

  @property
  def pad_id(self):
    return self.inner.pad_id

  @property
  def eoa_id(self):
    return self.inner.eoa_id

  def empty(self) -> Library:
    return empty_library(self.slots, self.action_len, self.pad_id)

  # --- array functions --------------------------------------------------------------------------

  def with_library(self, start, library: Library):
    """Start states (state, obs, obs_mask) of this environment with `library` (no leading
    dims) attached to every episode, their observations re-read with its hints."""
    state = start[0].replace(library=_per_episode(library, start[0].done.shape[0]))
    return (state, *self.observe(state))

  def reset(self, key, n):
    inner, _, _ = self.inner.reset(key, n)
    state = ExperienceState(inner=inner, library=_per_episode(self.empty(), n), turn=inner.turn,
                            done=inner.done)
    return (state, *self.observe(state))

  def step(self, state, actions, action_mask):
    inner, _, _, reward, done, info = self.inner.step(state.inner, actions, action_mask)
    state = state.replace(inner=inner, turn=inner.turn, done=inner.done)
    return (state, *self.observe(state), reward, done, info)

  def clusters(self, state):
    """int32 [n]: each state's cluster (its observation's, or its exact state id)."""
    if self.cluster == "state":
      return self.inner.state_id(state.inner)
    obs, mask = self.inner.observe(state.inner)
    return multiturn.hash_arrays([jnp.where(mask, obs, self.pad_id)])

  def observe(self, state):
    obs, mask = self.inner.observe(state.inner)
    tip, has_tip, avoid, has_avoid = jax.vmap(lookup)(state.library, self.clusters(state))
    hint_len = lambda acts, has: jnp.where(  # the marker and the tokens before the first pad
        has, 1 + jnp.sum(jnp.cumprod(acts != self.pad_id, -1), -1), 0)
    marker = lambda word, n: jnp.full((n, 1), self.token_id(word), jnp.int32)
    n = obs.shape[0]
    pieces = [(obs, jnp.sum(mask, -1)),
              (jnp.concatenate([marker(TIP, n), tip], -1), hint_len(tip, has_tip)),
              (jnp.concatenate([marker(AVOID, n), avoid], -1), hint_len(avoid, has_avoid))]
    out, length = jax.vmap(lambda *p: _cot.concat(list(zip(p[::2], p[1::2])), self.obs_len,
                                                  self.pad_id))(*[x for pc in pieces for x in pc])
    return out, jnp.arange(self.obs_len) < length[:, None]

  def state_id(self, state, with_turn: bool = False):
    """The cluster (module docstring); with the turn mixed in when `with_turn`."""
    ids = self.clusters(state)
    return multiturn.hash_arrays([ids, state.turn]) if with_turn else ids

  # --- the inner environment's extras, on the inner state ----------------------------------------

  def __getattr__(self, name):
    if name in ("milestones", "optimal_distance", "expert_action", "answer", "attempts"):
      inner = object.__getattribute__(self, "inner")
      if hasattr(inner, name):
        attr = getattr(inner, name)
        return (lambda state, *a, **k: attr(state.inner, *a, **k)) if callable(attr) else attr
    raise AttributeError(name)
