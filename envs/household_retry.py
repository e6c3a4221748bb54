"""Household with retries (issue 23, MR-Search #31): a meta-episode of up to `attempts`
attempts at the same task, each an inner episode of `max_turns // attempts` turns.

An attempt ends when it solves the task (the meta-episode ends, reward 1.0) or runs out of
its turns; after a failed attempt that is not the last, the house is reset to the task's
initial state (the agent in the hall, hands empty, every object back where it lay, dirty)
and the next observation starts with the token "retry" (the cross-episode feedback that
stands in for MR-Search's generated self-reflection: our agents write no text, but the
failed attempt stays in their context). Everything else is `envs.household`: actions,
observation words, the expert (which solves the first attempt) and the gold answer.

`milestones(state)`: bool [n, attempts], attempt j has ended (failed, or ended the
meta-episode): the loop counts, on each turn, the attempts it ends, and fills
`Turns.attempts` (Σ_{j<k} of those counts: turn k's attempt) for `credit.turn_norm.mr_search`.
`state_id` includes the attempt. Info adds "attempt_end" bool [n] (the turn ended an
attempt).
"""

import dataclasses

import flax
import jax
import jax.numpy as jnp

from envs import multiturn
from envs.household import NUM_REC, Household, HouseholdState

RETRY = "retry"


@flax.struct.dataclass
class RetryState(HouseholdState):
  """Household state plus: obj_loc0 int32 [n, NUM_OBJ] (where the objects lay at the start),
  attempt int32 [n] (0-based), attempt_turn int32 [n] (turns of the current attempt),
  retry bool [n] (the observation opens a retry)."""

  obj_loc0: jax.Array = None
  attempt: jax.Array = None
  attempt_turn: jax.Array = None
  retry: jax.Array = None


@dataclasses.dataclass(frozen=True)
class HouseholdRetry(Household):
  """`attempts` tries at one household task, `max_turns // attempts` turns each."""

  attempts: int = 2
  max_turns: int = 12

  name = "household_retry"

  def validate(self):
    if not 0.0 <= self.clean_prob <= 1.0:
      raise ValueError(f"clean_prob must be in [0, 1]; got {self.clean_prob!r}.")
    if not (isinstance(self.attempts, int) and self.attempts >= 1):
      raise ValueError(f"attempts must be an int >= 1; got {self.attempts!r}.")
    if not (isinstance(self.max_turns, int) and self.max_turns % self.attempts == 0
            and self.max_turns // self.attempts >= 6):
      raise ValueError(f"max_turns must be attempts ({self.attempts}) x an attempt's turn "
                       f"limit >= 6 (the longest solution); got {self.max_turns!r}.")

  @property
  def attempt_turns(self) -> int:
    """The turn limit of one attempt."""
    return self.max_turns // self.attempts

  @property
  def vocab(self):
    return super().vocab + (RETRY,)

  def _init(self, key, n):
    s = super()._init(key, n)
    z = jnp.zeros((n,), jnp.int32)
    return RetryState(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
                      obj_loc0=s.obj_loc, attempt=z, attempt_turn=z,
                      retry=jnp.zeros((n,), bool))

  def _transition(self, state, actions, action_mask):
    nxt, reward, solved, info = super()._transition(state, actions, action_mask)
    at = state.attempt_turn + 1
    ended = solved | (at >= self.attempt_turns)
    retry = ended & ~solved & (state.attempt + 1 < self.attempts)
    fresh = lambda x, x0: jnp.where(multiturn._expand(retry, x), x0, x)
    nxt = nxt.replace(
        loc=fresh(nxt.loc, jnp.full_like(nxt.loc, NUM_REC)),
        holding=fresh(nxt.holding, jnp.full_like(nxt.holding, -1)),
        obj_loc=fresh(nxt.obj_loc, state.obj_loc0),
        clean=fresh(nxt.clean, jnp.zeros_like(nxt.clean)),
        invalid=nxt.invalid & ~retry,
        attempt=state.attempt + retry, attempt_turn=jnp.where(retry, 0, at), retry=retry)
    return nxt, reward, ended & ~retry, dict(info, attempt_end=ended)

  def _observe1(self, s):
    obs, length = super()._observe1(s)
    shifted = jnp.concatenate([jnp.asarray([self.token_id(RETRY)], jnp.int32), obs[:-1]])
    return jnp.where(s.retry, shifted, obs), length + s.retry

  def _state_arrays(self, state):
    return super()._state_arrays(state) + [state.attempt]

  def milestones(self, state):
    """bool [n, attempts]: attempt j has ended (failed, or ended the meta-episode)."""
    j = jnp.arange(self.attempts)
    return (state.attempt[:, None] > j) | (state.done[:, None] & (state.attempt[:, None] == j))
