"""A long-horizon household variant (issue 23): several "put [clean] X in Y" sub-tasks in one
episode, for milestone credit's claim (BEACON reports its gains on long ALFWorld tasks).

Same house, objects, actions and observation words as `envs.household`; the task is
`num_goals` = K sub-tasks on K distinct objects (each Y uniform over the receptacles other
than where its X lies, "clean" with probability `clean_prob`), listed in the observation as
"task : put [clean] X1 in Y1 . put [clean] X2 in Y2 . ...". Reward 1.0 on the step at which
every sub-task holds at once (X_k in Y_k, clean if asked); the episode ends then or after
K' = `max_turns` turns (default 30; the expert needs 4 to 6 turns a sub-task, up to ~18 for
K = 3). `milestones(state)`: bool [n, 3K + 1]: per sub-task (holding X_k or X_k in Y_k,
X_k clean or not asked, X_k in Y_k and clean if asked), then all solved.

The expert (`expert_action`, `optimal_distance`, `expert_plan`) does the sub-tasks in index
order with `household`'s shortest plan for each; its plan length is an upper bound on the
fewest turns (another order can be shorter), which is what `optimal_distance` returns here
(CAST's step counts read it as such).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from envs.household import (FIRST_OBJ, NUM_OBJ, NUM_REC, RECEPTACLES, SINK,
                            Household, HouseholdState, _ID)


@dataclasses.dataclass(frozen=True)
class HouseholdLong(Household):
  """K household sub-tasks in one episode (goal arrays [n, K])."""

  num_goals: int = 3
  max_turns: int = 30

  name = "household_long"

  def validate(self):
    if not (isinstance(self.num_goals, int) and 1 <= self.num_goals <= NUM_OBJ):
      raise ValueError(f"num_goals must be an int in [1, {NUM_OBJ}] (distinct objects); got "
                       f"{self.num_goals!r}.")
    if not 0.0 <= self.clean_prob <= 1.0:
      raise ValueError(f"clean_prob must be in [0, 1]; got {self.clean_prob!r}.")
    if not (isinstance(self.max_turns, int) and self.max_turns >= 6 * self.num_goals):
      raise ValueError(f"max_turns must be an int >= 6 x num_goals = {6 * self.num_goals} "
                       f"(the longest expert plan); got {self.max_turns!r}.")

  @property
  def obs_len(self):
    return 26 + 6 * self.num_goals

  def _init(self, key, n):
    k = self.num_goals
    k1, k2 = jax.random.split(key)
    base = Household._init(self, k1, n)  # object locations; its one goal is replaced
    u = jax.random.uniform(k2, (n, k, 3))
    goal_obj = jax.vmap(lambda key: jax.random.permutation(key, NUM_OBJ)[:k])(
        jax.random.split(jax.random.fold_in(k2, 1), n)).astype(jnp.int32)  # [n, K] distinct
    start = jnp.take_along_axis(base.obj_loc, goal_obj, 1)
    goal_rec = jnp.floor(u[..., 0] * (NUM_REC - 1)).astype(jnp.int32)
    goal_rec = goal_rec + (goal_rec >= start)
    return base.replace(goal_obj=goal_obj, goal_rec=goal_rec.astype(jnp.int32),
                        goal_clean=u[..., 1] < self.clean_prob)

  def _goal_status(self, state):
    """bool [n, K] x 3: holding X_k or X_k in Y_k; X_k clean or not asked; sub-task k holds."""
    where = jnp.take_along_axis(state.obj_loc, state.goal_obj, 1)
    is_clean = jnp.take_along_axis(state.clean, state.goal_obj, 1)
    placed = where == state.goal_rec
    clean_ok = is_clean | ~state.goal_clean
    return (state.holding[:, None] == state.goal_obj) | placed, clean_ok, placed & clean_ok

  def _milestones(self, state):
    got, clean_ok, done = self._goal_status(state)
    per_goal = jnp.stack([got, clean_ok, done], -1).reshape(got.shape[0], -1)
    return jnp.concatenate([per_goal, jnp.all(done, -1, keepdims=True)], -1)

  def milestones(self, state):
    """bool [n, 3K + 1] of each state: per sub-task k (holding X_k or X_k in Y_k; X_k clean,
    True when not asked; sub-task k holds), then every sub-task holds (solved)."""
    return self._milestones(state)

  def _task_pieces(self, s, piece, obj):
    """ "put [clean] X_k in Y_k ." for each sub-task in turn (one episode)."""
    out = []
    for k in range(self.num_goals):
      one = s.replace(goal_obj=s.goal_obj[k], goal_rec=s.goal_rec[k],
                      goal_clean=s.goal_clean[k])
      out += Household._task_pieces(self, one, piece, obj)
    return out

  # --- the expert: sub-tasks in index order ---------------------------------------------------

  def _done(self, s):
    """One episode: bool [K], sub-task k holds."""
    return (s.obj_loc[s.goal_obj] == s.goal_rec) & (s.clean[s.goal_obj] | ~s.goal_clean)

  def _current(self, s):
    """One episode: the first sub-task that does not hold (K if all do)."""
    return jnp.argmin(jnp.append(self._done(s), False))

  def _plan1(self, s):
    """One episode: (first action's verb, argument; the expert's remaining turns)."""
    k = self.num_goals
    cur = self._current(s)
    one = lambda i: s.replace(goal_obj=s.goal_obj[jnp.minimum(i, k - 1)],
                              goal_rec=s.goal_rec[jnp.minimum(i, k - 1)],
                              goal_clean=s.goal_clean[jnp.minimum(i, k - 1)])
    verb, arg, first = Household._plan1(self, one(cur))
    # Later sub-tasks, after sub-task j's put: at Y_j, hands empty.
    total, loc = first, s.goal_rec[jnp.minimum(cur, k - 1)]
    done = self._done(s)
    for j in range(k):
      x, y, c = s.goal_obj[j], s.goal_rec[j], s.goal_clean[j]
      later = (j > cur) & ~done[j]
      fetch = (loc != s.obj_loc[x]).astype(jnp.int32) + 1
      wash = jnp.where(c & ~s.clean[x], (s.obj_loc[x] != SINK).astype(jnp.int32) + 1, 0)
      at = jnp.where(c & ~s.clean[x], SINK, s.obj_loc[x])
      place = (at != y).astype(jnp.int32) + 1
      total = total + jnp.where(later, fetch + wash + place, 0)
      loc = jnp.where(later, y, loc)
    return verb, arg, jnp.where(cur >= k, 0, total).astype(jnp.int32)

  def optimal_distance(self, state):
    """int32 [n]: the expert's remaining turns (sub-tasks in index order; an upper bound on
    the fewest), 0 once solved."""
    solved = self._milestones(state)[:, -1]
    return jnp.where(solved, 0, jax.vmap(self._plan1)(state)[2])

  def answer(self, state):
    """The gold final action "put X_K" (the last sub-task's object): int32 [n, A], bool."""
    verb = jnp.full(state.goal_obj.shape[:1], _ID["put"], jnp.int32)
    return self._actions(verb, (FIRST_OBJ + state.goal_obj[:, -1]).astype(jnp.int32))

  def expert_plan(self, state, i: int = 0) -> list[list[str]]:
    """The expert's plan (token strings) for episode i: each unfinished sub-task in index
    order, from a state with empty hands or holding the current sub-task's object."""
    s = jax.tree.map(lambda x: np.asarray(x)[i], state)
    plan, loc = [], int(s.loc)
    for k in range(self.num_goals):
      one = jax.tree.map(lambda x: x[None], s.replace(
          goal_obj=s.goal_obj[k], goal_rec=s.goal_rec[k], goal_clean=s.goal_clean[k],
          loc=np.int32(loc), holding=s.holding if k == 0 else np.int32(-1)))
      steps = Household.expert_plan(self, one, 0)
      plan += steps
      for verb, arg in steps:
        if verb == "go":
          loc = RECEPTACLES.index(arg)
    return plan


__all__ = ["HouseholdLong", "HouseholdState"]
