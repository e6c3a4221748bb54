"""Sokoban on small procedurally generated rooms, with an exact BFS solver.

Rooms (H x W, default 6 x 6) have a wall border; the floor is carved by a
random walk inside it, `num_boxes` targets are placed on the floor with a box on
each, then the player plays the level backwards for `reverse_steps` moves: with
probability `pull_prob` a pull (a step away from an adjacent box, dragging it
along; a random one of the directions that allow it, if any), otherwise a step
to a random free neighbour. Undoing those moves solves the room, so every room
is solvable in at most `reverse_steps` <= K moves. Of `num_tries` such rooms
per episode (all drawn from one uniform array) the one whose
boxes are furthest from the targets (summed Manhattan distance to the nearest
target) is kept; if every try left all boxes on targets (very rare), a fixed
room (boxes one push below the targets) is used instead, so no room starts solved.

Vocabulary (14 tokens): cells '#' wall, ' ' floor, '.' target, '$' box, '*' box
on target, '@' player, '+' player on target (ids 0-6); '\\n' (7) ends each row;
moves 'u', 'd', 'l', 'r' (8-11); EOA (12), PAD (13).
Observation (O = H(W+1)): the grid row by row, one token per cell, each row
followed by '\\n'; always the full length (mask all True).
Action (A = 2): one move token then EOA. Anything else is invalid and a no-op
(the state does not change, but the turn counts and the step penalty applies);
`info["invalid"]` is True. A move into a wall, or pushing a box into a wall or
another box, is a valid action that leaves the state unchanged.
Reward: 1.0 on the step that puts the last box on its target, minus
`step_penalty` (default 0) on every step of a live episode. The episode ends when
solved (`info["solved"]`) or after K = `max_turns` turns.
Info: "invalid", "moved", "pushed", "solved" bool [n]; "boxes_on_target" int32 [n].

Exact solver (host side, NumPy/Python; `distances`, `optimal_values`,
`optimal_actions`): a backward BFS from the solved configurations of a room gives
d*(s), the fewest moves that solve state s (the player's position is part of the
state). The optimal value under the environment's reward, with discount γ and the
turns left T = K - turn, is

  V*(s) = γ^(d*-1) - c Σ_{t<d*} γ^t     if d* <= T   (solve as fast as possible),
  V*(s) = -c Σ_{t<T} γ^t                otherwise    (no solution in time),

and 0 for done states (c = step_penalty). With c = 0 and γ = 1 it is 1 for every
state solvable in time; use γ < 1 or c > 0 for values that rank states.
"""

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from envs import multiturn

CELLS = ("#", " ", ".", "$", "*", "@", "+")
MOVES = ("u", "d", "l", "r")
DIRS = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], np.int32)  # in MOVES order
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = range(7)
NEWLINE = len(CELLS)
FIRST_MOVE = NEWLINE + 1


@flax.struct.dataclass
class SokobanState:
  """n Sokoban episodes.

  Attributes:
    walls, targets, boxes: bool [n, H, W] (the border is wall).
    player: int32 [n, 2], the player's (row, column).
    turn: int32 [n], turns taken; done: bool [n].
  """

  walls: jax.Array
  targets: jax.Array
  boxes: jax.Array
  player: jax.Array
  turn: jax.Array
  done: jax.Array


@dataclasses.dataclass(frozen=True)
class Sokoban(multiturn.MultiTurnEnv):
  """Push every box onto a target in a small generated room."""

  height: int = 6
  width: int = 6
  num_boxes: int = 2
  carve_steps: int = 24
  reverse_steps: int = 12
  pull_prob: float = 0.9
  num_tries: int = 16
  max_turns: int = 16
  step_penalty: float = 0.0

  name = "sokoban"
  separator = ""

  def validate(self):
    h, w, b = self.height, self.width, self.num_boxes
    if not (isinstance(h, int) and isinstance(w, int) and h >= 5 and w >= 4):
      raise ValueError(f"need int height >= 5 and width >= 4; got {h!r} x {w!r}.")
    if not (isinstance(b, int) and 1 <= b <= w - 2):
      raise ValueError(f"num_boxes must be an int in [1, width - 2 = {w - 2}]; got {b!r}.")
    for field in ("carve_steps", "reverse_steps", "num_tries"):
      v = getattr(self, field)
      if not (isinstance(v, int) and v >= 1):
        raise ValueError(f"{field} must be an int >= 1; got {v!r}.")
    if not 0.0 <= self.pull_prob <= 1.0:
      raise ValueError(f"pull_prob must be in [0, 1]; got {self.pull_prob!r}.")
    need = max(self.reverse_steps, 3 * b - 2)  # 3b - 2: the fallback room's solution
    if not (isinstance(self.max_turns, int) and self.max_turns >= need):
      raise ValueError(f"max_turns must be an int >= max(reverse_steps, 3 num_boxes - 2) = "
                       f"{need} (every room is solvable in that many moves); "
                       f"got {self.max_turns!r}.")
    if not self.step_penalty >= 0.0:
      raise ValueError(f"step_penalty must be >= 0; got {self.step_penalty!r}.")

  @property
  def vocab(self):
    return CELLS + ("\n",) + MOVES + (multiturn.EOA, multiturn.PAD)

  @property
  def obs_len(self):
    return self.height * (self.width + 1)

  @property
  def action_len(self):
    return 2

  # --- generation -----------------------------------------------------------------------------

  @property
  def _num_uniforms(self) -> int:
    """Uniforms one try of `_try` reads."""
    return 2 + self.carve_steps + 2 * self.height * self.width + 5 * self.reverse_steps

  def _try(self, u):
    """One reverse-played room from uniforms u [U]: (walls, targets, boxes [H, W], player [2],
    score int32 [], -1 if the floor was too small).

    (One random draw for everything: on CPU every `jax.random` call adds to compile time.)
    """
    h, w, nb, c, r = self.height, self.width, self.num_boxes, self.carve_steps, self.reverse_steps
    hw = h * w
    u_start, u_carve, u_place, u_player, u_rev = jnp.split(
        u, np.cumsum([2, c, hw, hw]))
    dirs = jnp.asarray(DIRS)
    lo, hi = jnp.array([1, 1]), jnp.array([h - 2, w - 2])
    start = lo + jnp.floor(u_start * (hi - lo + 1)).astype(jnp.int32)

    def carve(carry, ud):
      pos, floor = carry
      pos = jnp.clip(pos + dirs[jnp.floor(ud * 4).astype(jnp.int32)], lo, hi)
      return (pos, floor.at[pos[0], pos[1]].set(True)), None

    floor = jnp.zeros((h, w), bool).at[start[0], start[1]].set(True)
    (_, floor), _ = jax.lax.scan(carve, (start, floor), u_carve)

    top, idx = jax.lax.top_k(jnp.where(floor.ravel(), u_place, -1.0), nb)
    targets = jnp.zeros((hw,), bool).at[idx].set(True).reshape(h, w)
    prio = jnp.where((floor & ~targets).ravel(), u_player, -1.0)
    ok = (top[-1] >= 0) & (jnp.max(prio) >= 0)
    player = jnp.stack(jnp.unravel_index(jnp.argmax(prio), (h, w))).astype(jnp.int32)

    def pull(carry, x):
      # Reverse move: walk to a free neighbour q = p + δ; a pull also drags the box
      # at p - δ to p. With prob pull_prob, pull if any direction allows it.
      p, boxes = carry
      q, b = p + dirs, p - dirs  # [4, 2]
      can = floor[q[:, 0], q[:, 1]] & ~boxes[q[:, 0], q[:, 1]]
      pullable = can & boxes[b[:, 0], b[:, 1]]
      do = (x[0] < self.pull_prob) & jnp.any(pullable)
      choices = jnp.where(do, pullable, can)
      d = jnp.argmax(jnp.where(choices, x[1:5], -1.0))
      go = choices[d]
      boxes = boxes.at[b[d, 0], b[d, 1]].set(boxes[b[d, 0], b[d, 1]] & ~(do & go))
      boxes = boxes.at[p[0], p[1]].set(boxes[p[0], p[1]] | (do & go))
      return (jnp.where(go, q[d], p), boxes), None

    (player, boxes), _ = jax.lax.scan(pull, (player, targets), u_rev.reshape(r, 5))

    rc = jnp.stack(jnp.unravel_index(jnp.arange(hw), (h, w)), -1)  # [HW, 2]
    manhattan = jnp.sum(jnp.abs(rc[:, None] - rc[None]), -1)  # [HW, HW]
    nearest = jnp.min(jnp.where(targets.ravel()[None], manhattan, h + w), axis=1)
    score = jnp.sum(jnp.where(boxes.ravel(), nearest, 0))
    return ~floor, targets, boxes, player, jnp.where(ok, score, -1)

  def _fallback(self):
    """A fixed room: targets in row 1, boxes below them in row 2, player at (3, 1)."""
    h, w, nb = self.height, self.width, self.num_boxes
    walls = np.ones((h, w), bool)
    walls[1:-1, 1:-1] = False
    targets, boxes = np.zeros((h, w), bool), np.zeros((h, w), bool)
    targets[1, 1:1 + nb] = True
    boxes[2, 1:1 + nb] = True
    return walls, targets, boxes, np.array([3, 1], np.int32)

  def _init(self, key, n):
    t = self.num_tries
    u = jax.random.uniform(key, (n * t, self._num_uniforms))
    walls, targets, boxes, player, score = jax.vmap(self._try)(u)  # one flat vmap: faster compile
    best = jnp.argmax(score.reshape(n, t), axis=1) + t * jnp.arange(n)
    use = score[best] > 0  # else the fallback room
    walls, targets, boxes, player = multiturn.tree_where(
        use, [x[best] for x in (walls, targets, boxes, player)], list(self._fallback()))
    return SokobanState(walls=walls, targets=targets, boxes=boxes, player=player,
                        turn=jnp.zeros((n,), jnp.int32), done=jnp.zeros((n,), bool))

  # --- dynamics -------------------------------------------------------------------------------

  @staticmethod
  def _move(walls, boxes, player, d):
    """One move of one room: (boxes [H, W], player [2], moved, pushed)."""
    h, w = walls.shape
    delta = jnp.asarray(DIRS)[d]
    q = player + delta
    r = jnp.clip(q + delta, 0, jnp.array([h - 1, w - 1]))
    q_wall, q_box = walls[q[0], q[1]], boxes[q[0], q[1]]
    r_free = ~walls[r[0], r[1]] & ~boxes[r[0], r[1]]
    push = ~q_wall & q_box & r_free
    moved = ~q_wall & (~q_box | push)
    boxes = boxes.at[q[0], q[1]].set(q_box & ~push)
    boxes = boxes.at[r[0], r[1]].set(boxes[r[0], r[1]] | push)
    return boxes, jnp.where(moved, q, player), moved, push

  def _transition(self, state, actions, action_mask):
    d, valid = multiturn.single_token_action(actions, action_mask, self.eoa_id, FIRST_MOVE,
                                             len(MOVES))
    boxes, player, moved, pushed = jax.vmap(self._move)(state.walls, state.boxes, state.player, d)
    boxes = jnp.where(valid[:, None, None], boxes, state.boxes)
    player = jnp.where(valid[:, None], player, state.player)
    nxt = state.replace(boxes=boxes, player=player)
    on_target = jnp.sum(boxes & state.targets, axis=(1, 2), dtype=jnp.int32)
    solved = on_target == self.num_boxes
    reward = solved.astype(jnp.float32) - self.step_penalty
    info = {"invalid": ~valid, "moved": moved & valid, "pushed": pushed & valid,
            "solved": solved, "boxes_on_target": on_target}
    return nxt, reward, solved, info

  def observe(self, state):
    """The grid as tokens int32 [n, H(W+1)] (rows end in '\\n'); mask all True."""
    n, h, w = state.walls.shape
    here = (jnp.arange(h)[:, None] == state.player[:, 0, None, None]) & (
        jnp.arange(w)[None, :] == state.player[:, 1, None, None])
    t = state.targets
    cells = jnp.where(state.walls, WALL, jnp.where(
        here, jnp.where(t, PLAYER_ON_TARGET, PLAYER),
        jnp.where(state.boxes, jnp.where(t, BOX_ON_TARGET, BOX), jnp.where(t, TARGET, FLOOR))))
    rows = jnp.concatenate([cells, jnp.full((n, h, 1), NEWLINE)], axis=2)
    obs = rows.reshape(n, h * (w + 1)).astype(jnp.int32)
    return obs, jnp.ones(obs.shape, bool)

  def _state_arrays(self, state):
    return [state.walls, state.targets, state.boxes, state.player]

  def move_tokens(self, moves):
    """Actions from move indices int32 [n] (0-3 = u, d, l, r): (int32 [n, 2], bool [n, 2])."""
    moves = jnp.asarray(moves, jnp.int32)
    tokens = jnp.stack([moves + FIRST_MOVE, jnp.full_like(moves, self.eoa_id)], -1)
    return tokens, jnp.ones(tokens.shape, bool)


# --- exact solver (host side) --------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _distance_table(h: int, w: int, walls: bytes, targets: bytes) -> dict:
  """{(player, boxes): fewest moves to solve} for every solvable state of one room.

  Cells are flat indices r*w + c, boxes a sorted tuple. Backward BFS from the
  solved configurations (boxes on the targets, player on any free cell) over
  the predecessors of the forward moves: a walk into p from p - δ, and a push
  that moved a box from p to p + δ.
  """
  free = ~np.frombuffer(walls, bool)
  goal = tuple(int(i) for i in np.flatnonzero(np.frombuffer(targets, bool)))
  deltas = [int(dr * w + dc) for dr, dc in DIRS]
  dist = {(p, goal): 0 for p in map(int, np.flatnonzero(free)) if p not in goal}
  frontier = list(dist)
  while frontier:
    nxt = []
    for p, boxes in frontier:
      d = dist[(p, boxes)] + 1
      for delta in deltas:
        src = p - delta
        if not free[src] or src in boxes:
          continue
        preds = [(src, boxes)]
        if p + delta in boxes:
          preds.append((src, tuple(sorted([b for b in boxes if b != p + delta] + [p]))))
        for s in preds:
          if s not in dist:
            dist[s] = d
            nxt.append(s)
    frontier = nxt
  return dist


def _host(state):
  return jax.tree.map(np.asarray, state)


def _table_and_key(state, i):
  """Episode i's distance table and its state key (player, boxes)."""
  h, w = state.walls.shape[1:]
  table = _distance_table(h, w, state.walls[i].tobytes(), state.targets[i].tobytes())
  player = int(state.player[i, 0]) * w + int(state.player[i, 1])
  return table, (player, tuple(int(b) for b in np.flatnonzero(state.boxes[i])))


def distances(state) -> np.ndarray:
  """int64 [n]: d*(s), the fewest moves that solve each room from its state; -1 if none.

  0 for solved rooms; ignores turns and done (see `optimal_values`).
  """
  state = _host(state)
  out = np.empty(state.walls.shape[0], np.int64)
  for i in range(len(out)):
    table, key = _table_and_key(state, i)
    solved = np.array_equal(state.boxes[i], state.targets[i])
    out[i] = 0 if solved else table.get(key, -1)
  return out


def optimal_values(env: Sokoban, state, gamma: float = 1.0) -> np.ndarray:
  """float64 [n]: V*(s) under env's reward, discount gamma and the turns left (module doc)."""
  state = _host(state)
  d = distances(state)
  left = env.max_turns - state.turn
  c = env.step_penalty
  solve = np.power(float(gamma), np.maximum(d - 1, 0)) - c * _geometric(gamma, d)
  values = np.where((d >= 1) & (d <= left), solve, -c * _geometric(gamma, np.maximum(left, 0)))
  return np.where(state.done, 0.0, values)


def _geometric(gamma, k):
  """Σ_{t<k} γ^t for int arrays k >= 0."""
  k = np.asarray(k, np.float64)
  return k if gamma == 1.0 else (1.0 - np.power(float(gamma), k)) / (1.0 - gamma)


def _py_move(free, boxes, p, delta):
  """Forward move on flat cells: (player, boxes) after moving by delta."""
  q = p + delta
  if not free[q]:
    return p, boxes
  if q in boxes:
    r = q + delta
    if not free[r] or r in boxes:
      return p, boxes
    return q, tuple(sorted([b for b in boxes if b != q] + [r]))
  return q, boxes


def optimal_actions(state, i: int = 0) -> list[int]:
  """An optimal plan (move indices, 0-3 = u, d, l, r) solving episode i; [] if none."""
  state = _host(state)
  h, w = state.walls.shape[1:]
  table, key = _table_and_key(state, i)
  if key not in table or np.array_equal(state.boxes[i], state.targets[i]):
    return []
  free = ~state.walls[i].ravel()
  plan = []
  while table[key] > 0:
    for m, (dr, dc) in enumerate(DIRS):
      nxt = _py_move(free, key[1], key[0], int(dr * w + dc))
      if table.get(nxt, -1) == table[key] - 1:
        plan.append(m)
        key = nxt
        break
  return plan
