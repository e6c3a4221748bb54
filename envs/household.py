"""A symbolic ALFWorld-style household task: fetch an object, maybe clean it, put it somewhere.

The house has 6 receptacles (fridge, counter, sink, cabinet, table, shelf) and
a hall where the agent starts; 4 objects (mug, apple, plate, book) lie in random
receptacles other than the sink, all dirty. The goal is "put [clean] X in Y"
(X, Y uniform, Y not where X lies; "clean" with probability `clean_prob`),
which needs the sub-goals go to X, take X, [go to the sink, clean X], go to Y,
put X (4 to 6 turns). The agent holds at most one object.

Vocabulary: the words below, EOA, PAD. Actions (A = 3): a verb, an argument,
EOA:
  go L      (L a receptacle or the hall)           always works;
  take X    (X here, hands empty)                  picks X up;
  put X     (holding X, at a receptacle)           puts X here;
  clean X   (holding X, at the sink)               makes X clean.
Anything else (malformed, or a precondition fails) is invalid: the state does
not change (the turn counts) and the observation starts "nothing happens .";
`info["invalid"]`.
Observation (O = 32, PAD after): [nothing happens .] task : put [clean] X in Y .
you are at L . you see X1 X2 .. (or nothing) . you hold X (or nothing) .
Reward: 1.0 on the step that achieves the goal (X in Y, and clean if asked); the
episode ends then or after K = `max_turns` turns.
Info: "invalid", "solved" bool [n]; "milestones" bool [n, 3], of the new state:
holding X or X in Y, X clean (True when not asked), solved.
"""

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np

from envs import _cot, multiturn

RECEPTACLES = ("fridge", "counter", "sink", "cabinet", "table", "shelf")
HALL = "hall"
OBJECTS = ("mug", "apple", "plate", "book")
VERBS = ("go", "take", "put", "clean")
WORDS = ("nothing", "happens", "task", ":", "in", "you", "are", "at", "see", "hold", ".")
SINK = RECEPTACLES.index("sink")
NUM_REC, NUM_OBJ = len(RECEPTACLES), len(OBJECTS)
_VOCAB = VERBS + WORDS + RECEPTACLES + (HALL,) + OBJECTS + (multiturn.EOA, multiturn.PAD)
_ID = {w: i for i, w in enumerate(_VOCAB)}
FIRST_LOC = _ID[RECEPTACLES[0]]  # locations: receptacles then the hall (NUM_REC)
FIRST_OBJ = _ID[OBJECTS[0]]


@flax.struct.dataclass
class HouseholdState:
  """n household episodes.

  Attributes:
    loc: int32 [n], the agent's location (receptacle index, NUM_REC = hall).
    holding: int32 [n], the object held, -1 for none.
    obj_loc: int32 [n, NUM_OBJ], each object's receptacle, -1 while held.
    clean: bool [n, NUM_OBJ].
    goal_obj, goal_rec: int32 [n]; goal_clean: bool [n].
    invalid: bool [n], the last action was invalid (shown in the observation; not part
      of `state_id`, which identifies the world state).
    turn: int32 [n]; done: bool [n].
  """

  loc: jax.Array
  holding: jax.Array
  obj_loc: jax.Array
  clean: jax.Array
  goal_obj: jax.Array
  goal_rec: jax.Array
  goal_clean: jax.Array
  invalid: jax.Array
  turn: jax.Array
  done: jax.Array


@dataclasses.dataclass(frozen=True)
class Household(multiturn.MultiTurnEnv):
  """Fetch, maybe clean, and place an object in a small symbolic house."""

  clean_prob: float = 0.5
  max_turns: int = 10

  name = "household"
  separator = " "

  def validate(self):
    if not 0.0 <= self.clean_prob <= 1.0:
      raise ValueError(f"clean_prob must be in [0, 1]; got {self.clean_prob!r}.")
    if not (isinstance(self.max_turns, int) and self.max_turns >= 6):
      raise ValueError(f"max_turns must be an int >= 6 (the longest solution); "
                       f"got {self.max_turns!r}.")

  @property
  def vocab(self):
    return _VOCAB

  @property
  def obs_len(self):
    return 32

  @property
  def action_len(self):
    return 3

  def _init(self, key, n):
    u = jax.random.uniform(key, (n, NUM_OBJ + 3))
    spots = [i for i in range(NUM_REC) if i != SINK]
    obj_loc = jnp.asarray(spots)[jnp.floor(u[:, :NUM_OBJ] * len(spots)).astype(jnp.int32)]
    goal_obj = jnp.floor(u[:, NUM_OBJ] * NUM_OBJ).astype(jnp.int32)
    start = jnp.take_along_axis(obj_loc, goal_obj[:, None], 1)[:, 0]
    # Goal receptacle uniform over the other NUM_REC - 1 receptacles.
    goal_rec = jnp.floor(u[:, NUM_OBJ + 1] * (NUM_REC - 1)).astype(jnp.int32)
    goal_rec = goal_rec + (goal_rec >= start)
    z = jnp.zeros((n,), jnp.int32)
    return HouseholdState(loc=z + NUM_REC, holding=z - 1, obj_loc=obj_loc.astype(jnp.int32),
                          clean=jnp.zeros((n, NUM_OBJ), bool), goal_obj=goal_obj,
                          goal_rec=goal_rec.astype(jnp.int32),
                          goal_clean=u[:, NUM_OBJ + 2] < self.clean_prob,
                          invalid=jnp.zeros((n,), bool), turn=z, done=jnp.zeros((n,), bool))

  def _act(self, s, tokens, mask):
    """One episode's action (tokens, mask [A]): (next state, valid)."""
    tok = jnp.where(mask, tokens, -1)
    verb, arg = tok[0], tok[1]
    form = (tok[2] == self.eoa_id) & (verb >= 0) & (verb < len(VERBS))
    loc_arg, obj_arg = arg - FIRST_LOC, arg - FIRST_OBJ
    is_loc = (loc_arg >= 0) & (loc_arg <= NUM_REC)
    is_obj = (obj_arg >= 0) & (obj_arg < NUM_OBJ)
    o = jnp.clip(obj_arg, 0, NUM_OBJ - 1)
    at_rec = s.loc < NUM_REC
    go = form & (verb == 0) & is_loc
    take = form & (verb == 1) & is_obj & (s.holding < 0) & (s.obj_loc[o] == s.loc)
    put = form & (verb == 2) & is_obj & (s.holding == obj_arg) & at_rec
    clean = form & (verb == 3) & is_obj & (s.holding == obj_arg) & (s.loc == SINK)
    obj_loc = s.obj_loc.at[o].set(jnp.where(take, -1, jnp.where(put, s.loc, s.obj_loc[o])))
    nxt = s.replace(
        loc=jnp.where(go, loc_arg, s.loc).astype(jnp.int32),
        holding=jnp.where(take, o, jnp.where(put, -1, s.holding)).astype(jnp.int32),
        obj_loc=obj_loc, clean=s.clean.at[o].set(s.clean[o] | clean))
    valid = go | take | put | clean
    return nxt.replace(invalid=~valid), valid

  def _milestones(self, state):
    """bool [n, 3]: holding X or X in Y; X clean or not asked; solved."""
    where = jnp.take_along_axis(state.obj_loc, state.goal_obj[:, None], 1)[:, 0]
    is_clean = jnp.take_along_axis(state.clean, state.goal_obj[:, None], 1)[:, 0]
    placed = where == state.goal_rec
    clean_ok = is_clean | ~state.goal_clean
    return jnp.stack([(state.holding == state.goal_obj) | placed, clean_ok,
                      placed & clean_ok], -1)

  def milestones(self, state):
    """bool [n, 3] of each state (BEACON's milestones, `credit.milestones`): holding X or X
    in Y; X clean (True when not asked); solved."""
    return self._milestones(state)

  def _transition(self, state, actions, action_mask):
    nxt, valid = jax.vmap(self._act)(state, actions, action_mask)
    milestones = self._milestones(nxt)
    solved = milestones[:, -1]  # the last milestone is "solved" (household_long too)
    info = {"invalid": ~valid, "solved": solved, "milestones": milestones}
    return nxt, solved.astype(jnp.float32), solved, info

  def _observe1(self, s):
    """One episode's observation: int32 [O], length."""
    ids = lambda words: jnp.asarray([_ID[w] for w in words], jnp.int32)
    piece = lambda words, keep=True: (ids(words), jnp.where(keep, len(words), 0))
    obj = lambda i: FIRST_OBJ + jnp.clip(i, 0, NUM_OBJ - 1)
    here = (s.obj_loc == s.loc) & (s.loc < NUM_REC)  # [NUM_OBJ]
    order = jnp.argsort(~here, stable=True)  # objects here first, in index order
    seen = (FIRST_OBJ + order).astype(jnp.int32), jnp.sum(here)
    pieces = [
        piece(("nothing", "happens", "."), s.invalid),
        piece(("task", ":")),
        *self._task_pieces(s, piece, obj),
        (jnp.stack([_ID["you"], _ID["are"], _ID["at"], FIRST_LOC + s.loc, _ID["."]]), 5),
        piece(("you", "see")),
        seen,
        piece(("nothing",), ~jnp.any(here)),
        piece((".", "you", "hold")),
        (jnp.stack([jnp.where(s.holding >= 0, obj(s.holding), _ID["nothing"]), _ID["."]]), 2),
    ]
    return _cot.concat(pieces, self.obs_len, self.pad_id)

  def _task_pieces(self, s, piece, obj):
    """The task's words after "task :" (one episode): "put [clean] X in Y ."."""
    return [piece(("put",)), piece(("clean",), s.goal_clean),
            (jnp.stack([obj(s.goal_obj), _ID["in"], FIRST_LOC + s.goal_rec, _ID["."]]), 4)]

  def observe(self, state):
    """The text observation int32 [n, O] (PAD after it) and its mask."""
    obs, length = jax.vmap(self._observe1)(state)
    return obs, jnp.arange(self.obs_len) < length[:, None]

  def _state_arrays(self, state):
    # The world state: the last action's feedback (`invalid`) is left out of the id.
    return [state.loc, state.holding, state.obj_loc, state.clean, state.goal_obj, state.goal_rec,
            state.goal_clean]

  # --- solver (jittable): a privileged shortest-plan expert ----------------------------------

  def _plan1(self, s):
    """One episode: (first action's verb id, argument id; turns the plan needs, counted as
    if the goal were not yet achieved)."""
    x, y = s.goal_obj, s.goal_rec
    needs_clean = s.goal_clean & ~s.clean[x]
    holds_x, holds_other = s.holding == x, (s.holding >= 0) & (s.holding != x)
    at_rec = s.loc < NUM_REC
    # Hands full of another object: put it down here (first going to the fridge from the hall).
    drop = jnp.where(holds_other, 1 + (~at_rec), 0)
    here = jnp.where(holds_other & ~at_rec, 0, s.loc)
    # Empty hands: fetch X (go there unless here, take).
    src = s.obj_loc[x]
    fetch = jnp.where(holds_x, 0, (here != src).astype(jnp.int32) + 1)
    cur = jnp.where(holds_x, here, src)
    wash = jnp.where(needs_clean, (cur != SINK).astype(jnp.int32) + 1, 0)
    cur = jnp.where(needs_clean, SINK, cur)
    place = (cur != y).astype(jnp.int32) + 1
    go = lambda target: (jnp.int32(_ID["go"]), (FIRST_LOC + target).astype(jnp.int32))
    act = lambda verb, o: (jnp.int32(_ID[verb]), (FIRST_OBJ + o).astype(jnp.int32))
    choose = lambda c, a, b: tuple(jnp.where(c, u, v) for u, v in zip(a, b))
    holding_x = choose(needs_clean,
                       choose(s.loc != SINK, go(jnp.int32(SINK)), act("clean", x)),
                       choose(s.loc != y, go(y), act("put", x)))
    empty = choose(s.loc != src, go(src), act("take", x))
    other = choose(at_rec, act("put", jnp.maximum(s.holding, 0)), go(jnp.int32(0)))
    verb, arg = choose(holds_x, holding_x, choose(holds_other, other, empty))
    return verb, arg, (drop + fetch + wash + place).astype(jnp.int32)

  def expert_action(self, state):
    """The next action of a shortest plan (the expert sees where X lies): int32 [n, A],
    bool [n, A] (verb, argument, EOA)."""
    verb, arg, _ = jax.vmap(self._plan1)(state)
    return self._actions(verb, arg)

  def optimal_distance(self, state):
    """int32 [n]: the fewest turns that achieve the goal from each state, the turn limit
    ignored (0 once solved; a state whose episode ran out of turns keeps its distance)."""
    solved = self._milestones(state)[:, 2]
    return jnp.where(solved, 0, jax.vmap(self._plan1)(state)[2])

  def answer(self, state):
    """The gold final action "put X" (X the goal object): int32 [n, A], bool [n, A]."""
    verb = jnp.full(state.goal_obj.shape, _ID["put"], jnp.int32)
    return self._actions(verb, (FIRST_OBJ + state.goal_obj).astype(jnp.int32))

  def _actions(self, verb, arg):
    """Actions "verb arg EOA" of ids verb, arg [n]: int32 [n, A], bool [n, A] (all True)."""
    eoa = jnp.full(verb.shape, self.eoa_id, jnp.int32)
    actions = jnp.stack([verb, arg, eoa], -1)
    return actions, jnp.ones(actions.shape, bool)

  def expert_plan(self, state, i: int = 0) -> list[list[str]]:
    """A shortest plan (actions as token strings) achieving episode i's goal (host side).

    For states whose hands are empty or hold the goal object X.
    """
    s = jax.tree.map(lambda x: np.asarray(x)[i], state)
    x, y, loc = int(s.goal_obj), int(s.goal_rec), int(s.loc)
    needs_clean = bool(s.goal_clean) and not bool(s.clean[x])
    plan = []

    def go(target):
      nonlocal loc
      if loc != target:
        plan.append(["go", RECEPTACLES[target]])
        loc = target

    if int(s.holding) != x:
      if int(s.holding) >= 0:
        raise ValueError("expert_plan needs empty hands or the goal object in them.")
      if int(s.obj_loc[x]) == y and not needs_clean:
        return plan
      go(int(s.obj_loc[x]))
      plan.append(["take", OBJECTS[x]])
    if needs_clean:
      go(SINK)
      plan.append(["clean", OBJECTS[x]])
    go(y)
    return plan + [["put", OBJECTS[x]]]
