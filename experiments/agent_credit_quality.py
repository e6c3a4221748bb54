"""Step-level credit accuracy of the agent (turn-level) estimators against true advantages.

    python -m experiments.agent_credit_quality [--seeds 3] [--group_sizes 4,8,16]
        [--envs mdp,sokoban] [--mdp_groups 256] [--sokoban_rooms 64] [--sign_threshold 0.05]
        [--workdir /tmp/treecredit/agent_credit_quality]

For every group size G the script samples B groups of G trajectories, every group
from one start state (a start drawn from `reset`, repeated G times), from a fixed
sampling policy π, and compares each estimator's turn advantages [B, G, K] with the
true step advantage A^π_k(s_k, a_k) = Q^π_k(s_k, a_k) − V^π_k(s_k) of the taken
(turn, state, action), over all taken turns (`credit_quality.credit_metrics`):

  corr: Pearson correlation over all taken turns of the batch;
  mse:  mean (α·a − A^π)² with the least-squares scale α;
  sign: on turns with |A^π| > --sign_threshold (default 0.05), the fraction with
        sign(a) == sign(A^π); a zero advantage counts as a disagreement.

Environments:
  mdp      `envs.exact_mdp` (8 states: 6 live, a goal paying 1 and a trap; 3 actions,
           2 successors each, step rewards in [−0.1, 0.1], K = 6 turns), a new MDP per
           seed. π = softmax(N(0, 1) logits / --temperature) per state, the same at
           every turn. γ = 1 (the undiscounted finite-horizon return, what GRPO's
           episode return measures). A^π is closed form (`ExactMDP.values`, by
           backward induction over the turn index: the horizon is respected).
  sokoban  `envs.sokoban` rooms (6x6, 1 box, reverse_steps 6, K = 12, no step
           penalty), γ = 0.95, π uniform over the 4 moves. Sokoban is deterministic
           and a room has at most a few hundred states reachable in K moves, so A^π
           is computed EXACTLY (no Monte-Carlo noise): a forward BFS from the start
           state gives the room's state graph, and backward induction over the turns
           gives Q^π_k and V^π_k (`room_graph`, `policy_values`). This is the
           quantity Monte-Carlo rollouts from each (state, action) would estimate;
           the sampled trajectories are replayed on the graph and their rewards and
           solved flags checked against `env.step`.

Estimators: every `credit.agents.AGENT_ESTIMATORS` entry but igpo (no gold answer
here, which also rules out `credit.tool_credit`'s taco_tools and ica) and `credit.turn_norm`'s (MT-GRPO, MAPO for dialogue, MemoPilot) on `Turns` built from the
rollouts (state ids = `env.state_id`, the turn not included, so states reached at
different turns are merged although V^π depends on the turn; per-turn rewards; turn
mask; success = reached the goal / solved), with γ = the benchmark's γ for those that
take one (gigpo, gagpo, gtpo, mapo_turns, memopilot) and their defaults otherwise; plus two token-level
references on trajectories written as tokens [s_0, a_0, s_1, a_1, ...] (state token
= its state id, action token = its index; mask True on both tokens of every taken
turn, the mask being one run from 0; the turn's advantage is read at its action
token) with reward = the undiscounted episode return:
  grpo   the episode return normalised over the group, the same on every turn;
  tempo  `credit.get('tempo')`: GRPO plus the prefix-tree TD at the action token,
         V̂(history, a_k) − V̂(history) (histories, not states, are merged).
The token-level turn estimators (taura, copo_turns, ppo_turns, bilevel_gae) get the same
trajectories with `turns.token_turn`, the sampling policy's exact log π(a_k | s_k) and
entropy H(π(· | s_k)) on each action token (Sokoban's uniform π: the same on every turn, so
taura and copo_turns are GRPO there), and for the critic-based two V^π_k(s_k) as the
critic's value: an oracle critic, the upper bound of a learned one, with the benchmark's γ.
cast is scored in two forms, both fed values_star_k = R_{<k} + V(s_k), V plus the reward
collected before turn k, so that a finished episode's last slot holds its return (for
goal-only rewards CAST's own convention: 1 solved, 0 failed): `cast`, the training default
(the paper's recipe: GRPO plus α = 0.1 of the asinh-compressed, batch-RMS-normalised
difference) on those values (signal='values': the MDP has no solver step counts; on Sokoban
without a step penalty V* = γ^(d*−1), a monotone function of the step count d*), and
`cast_value_difference` (`credit.turn_signals.CAST_VALUE_DIFFERENCE`, this project's first
form: the difference alone):
  on mdp   V = V^π_k, the sampling policy's exact values. Then the difference is
           the one-step TD error r_k + V^π_{k+1}(s_{k+1}) − V^π_k(s_k), whose mean
           given (k, s_k, a_k) is exactly A^π (γ = 1): an oracle sanity check, noisy
           only through the random transition.
  on sokoban  V = V* from the BFS solver (`sokoban.optimal_values`, γ = 0.95, turns
           left respected), as CAST intends: the optimal policy's values, not π's.
Writes agent_credit_quality.json and agent_credit_quality.png into --workdir.
"""

import argparse
import functools
import json
import os
import time

import flax
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

import credit
from credit import agents, turn_norm
from credit.turns import Turns, episode_returns
from envs import exact_mdp, sokoban
from experiments import credit_quality as cq

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# igpo, taco_tools and ica need a gold answer to probe for, which neither environment here has
# (nor views that tool calls return: the observation is the state); beacon needs
# sub-goal milestones, which neither has either (one box: solving is the only milestone).
# Token-level turn estimators read the policy's exact action log-probs and entropies and,
# for the critic-based ones, an oracle critic: V^π itself (an upper bound on a learned one).
TURN_TOKEN_ESTIMATORS = ("taura", "copo_turns", "ppo_turns", "bilevel_gae")
TURN_LEVEL = {**{n: f for n, f in agents.AGENT_ESTIMATORS.items() if n != "igpo"},
              "cast_value_difference": agents.AGENT_ESTIMATORS["cast"],
              **turn_norm.TURN_NORM_ESTIMATORS}
CAST_FORMS = {"cast": dict(signal="values"),  # the recipe's defaults otherwise
              "cast_value_difference": agents.CAST_VALUE_DIFFERENCE}
ESTIMATORS = tuple(TURN_LEVEL) + TURN_TOKEN_ESTIMATORS + ("grpo", "tempo")
DISCOUNTED = ("gigpo", "gagpo", "gtpo", "mapo_turns", "memopilot", "ppo_turns",
              "bilevel_gae")  # with a gamma
MDP_DEFAULTS = dict(num_states=8, num_actions=3, max_turns=6, branching=2,
                    step_reward_scale=0.1)
SOKOBAN_DEFAULTS = dict(num_boxes=1, reverse_steps=6, max_turns=12, step_penalty=0.0)
GAMMA = {"mdp": 1.0, "sokoban": 0.95}


@flax.struct.dataclass
class Batch:
  """B groups of G trajectories with their true advantages.

  Attributes:
    turns: `Turns` [B, G, K(+1)] (token_turn None).
    actions: int32 [B, G, K], the action index of each turn.
    states: int32 [B, G, K+1], a state index (mdp: the state; sokoban: its node in
      the room's graph) at the start of each turn, the final state after the end.
    true_adv: float32 [B, G, K], A^π_k(s_k, a_k) on taken turns, 0 elsewhere.
    value_pi: float32 [B, G, K+1], V^π_k(s_k) (0 once done).
    cast_values: float32 [B, G, K+1], values_star fed to cast (module docstring).
    action_logprob: float32 [B, G, K], log π(a_k | s_k) of the sampling policy.
    action_entropy: float32 [B, G, K], the entropy of π(· | s_k) (nats).
  """

  turns: Turns
  actions: jax.Array
  states: jax.Array
  true_adv: jax.Array
  value_pi: jax.Array
  cast_values: jax.Array
  action_logprob: jax.Array
  action_entropy: jax.Array


def first_members(batch: Batch, group_size: int) -> Batch:
  """The first G trajectories of every group (i.i.d. given the start: a group of G)."""
  return jax.tree.map(lambda x: x[:, :group_size], batch)


def _slots(per_turn, final, b, g):
  """[K, n] per-turn values and [n] final values -> [B, G, K+1]."""
  x = np.concatenate([np.asarray(per_turn), np.asarray(final)[None]], axis=0)
  return x.T.reshape(b, g, -1)


def _turns(x, b, g):
  """[K, n] -> [B, G, K]."""
  return np.asarray(x).T.reshape(b, g, -1)


def _collected(rewards):
  """R_{<k}: the reward collected before each slot, [..., K] -> [..., K+1]."""
  r = np.asarray(rewards, np.float64)
  return np.concatenate([np.zeros(r.shape[:-1] + (1,)), np.cumsum(r, -1)], -1)


# --------------------------------------------------------------------------- exact MDP


def mdp_env(seed: int, **overrides) -> exact_mdp.ExactMDP:
  return exact_mdp.ExactMDP(**{**MDP_DEFAULTS, **overrides, "seed": seed})


def mdp_logits(env, seed: int, temperature: float = 1.0):
  """The sampling policy's logits [S, A]: N(0, 1) / temperature (stationary)."""
  key = jax.random.fold_in(jax.random.key(seed), 1)
  return jax.random.normal(key, (env.num_states, env.num_actions)) / temperature


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _sample_mdp(env, key, logits, num_groups, group_size, gamma):
  n = num_groups * group_size
  k_start, k_stream, k_act = jax.random.split(key, 3)
  start, _, _ = env.reset(k_start, num_groups)
  state = jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0), start)
  state = state.replace(rng=jax.random.bits(k_stream, (n,), jnp.uint32))  # own transitions
  values = env.values(logits, gamma)

  def body(state, key):
    tokens, mask, a = env.sample_actions(key, logits, state)
    nxt, _, _, reward, _, _ = env.step(state, tokens, mask)
    return nxt, dict(sid=env.state_id(state), s=state.s, a=a, live=~state.done, reward=reward,
                     adv=env.step_advantages(values, state.s, a, state.turn),
                     v=values.v[state.turn, state.s])

  final, out = jax.lax.scan(body, state, jax.random.split(k_act, env.max_turns))
  last = dict(sid=env.state_id(final), s=final.s, v=values.v[final.turn, final.s],
              goal=final.s == env.goal)
  return out, last


def sample_mdp(env, key, logits, num_groups: int, group_size: int, gamma: float = 1.0) -> Batch:
  """B groups (B start states from `reset`, each G times) of G trajectories from π."""
  out, last = jax.device_get(_sample_mdp(env, key, logits, num_groups, group_size, gamma))
  b, g = num_groups, group_size
  mask = _turns(out["live"], b, g)
  rewards = np.where(mask, _turns(out["reward"], b, g), 0.0).astype(np.float32)
  turns = Turns(state_ids=_slots(out["sid"], last["sid"], b, g).astype(np.int32),
                rewards=rewards, turn_mask=mask, success=np.asarray(last["goal"]).reshape(b, g))
  value_pi = _slots(out["v"], last["v"], b, g)
  logp = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)  # [S, A], stationary
  s, a = _turns(out["s"], b, g), _turns(out["a"], b, g)
  ent = -np.sum(np.exp(logp) * logp, -1)
  return Batch(turns=turns, actions=_turns(out["a"], b, g).astype(np.int32),
               states=_slots(out["s"], last["s"], b, g).astype(np.int32),
               true_adv=np.where(mask, _turns(out["adv"], b, g), 0.0).astype(np.float32),
               value_pi=value_pi.astype(np.float32),
               cast_values=(_collected(rewards) + value_pi).astype(np.float32),
               action_logprob=np.where(mask, logp[s, a], 0.0).astype(np.float32),
               action_entropy=np.where(mask, ent[s], 0.0).astype(np.float32))


# --------------------------------------------------------------------------- Sokoban


def sokoban_env(**overrides) -> sokoban.Sokoban:
  return sokoban.Sokoban(**{**SOKOBAN_DEFAULTS, **overrides})


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _sample_sokoban(env, key, num_rooms, group_size):
  k_start, k_act = jax.random.split(key)
  start, _, _ = env.reset(k_start, num_rooms)
  state = jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0), start)
  n = num_rooms * group_size

  def body(state, key):
    moves = jax.random.randint(key, (n,), 0, len(sokoban.MOVES), jnp.int32)  # uniform π
    nxt, _, _, reward, _, info = env.step(state, *env.move_tokens(moves))
    return nxt, dict(sid=env.state_id(state), a=moves, live=~state.done, reward=reward,
                     solved=info["solved"], state=state)

  final, out = jax.lax.scan(body, state, jax.random.split(k_act, env.max_turns))
  return start, out, final, env.state_id(final)


def room_graph(walls, targets, boxes, player, depth: int):
  """The states of one room reachable from its start in < depth moves, and their moves.

  walls, targets, boxes: bool [H, W]; player: int [2]. States are (player cell,
  sorted box cells), flat indices r*W + c; node 0 is the start. Returns (nxt int64
  [M, 4]: the node after each move in `sokoban.MOVES` order (itself for solved
  nodes and nodes first reached at `depth`, which never move), solved bool [M]).
  """
  h, w = walls.shape
  free = ~np.asarray(walls, bool).ravel()
  goal = tuple(int(i) for i in np.flatnonzero(np.asarray(targets).ravel()))
  deltas = [int(dr * w + dc) for dr, dc in sokoban.DIRS]
  start = (int(player[0]) * w + int(player[1]),
           tuple(int(i) for i in np.flatnonzero(np.asarray(boxes).ravel())))
  index, keys, frontier = {start: 0}, [start], [start]
  nxt = []
  for _ in range(depth):
    new = []
    for key in frontier:
      p, bx = key
      row = []
      if bx != goal:
        for delta in deltas:
          q = p + delta
          if not free[q]:
            succ = key
          elif q in bx:
            r = q + delta
            succ = key if (not free[r] or r in bx) else (q, tuple(sorted(
                [c for c in bx if c != q] + [r])))
          else:
            succ = (q, bx)
          if succ not in index:
            index[succ] = len(keys)
            keys.append(succ)
            new.append(succ)
          row.append(index[succ])
      else:
        row = [index[key]] * 4
      nxt.append((index[key], row))
    frontier = new
  table = np.tile(np.arange(len(keys))[:, None], (1, 4))
  for i, row in nxt:
    table[i] = row
  solved = np.array([bx == goal for _, bx in keys])
  return table, solved


def policy_values(nxt, solved, policy, gamma: float, step_penalty: float, horizon: int):
  """Exact Q^π_k, V^π_k on a room's graph: (q float64 [K, M, 4], v float64 [K+1, M]).

  Backward induction from V_K = 0: Q_k(s, a) = r(s, a) + γ [s' not solved] V_{k+1}(s'),
  r = [s' solved] − step_penalty, s' = nxt[s, a]; V_k = Σ_a π(a) Q_k(s, a) (policy
  [4]); solved nodes are terminal (V = Q = 0).
  """
  reward = solved[nxt] - step_penalty
  cont = gamma * ~solved[nxt]
  v = [np.zeros(len(solved))]
  qs = []
  for _ in range(horizon):
    q = np.where(solved[:, None], 0.0, reward + cont * v[0][nxt])
    qs.insert(0, q)
    v.insert(0, q @ policy)
  return np.stack(qs), np.stack(v)


def sokoban_batch(env, start, out, final, final_ids, num_rooms: int, group_size: int,
                  gamma: float) -> Batch:
  """Turns and exact A^π of sampled Sokoban groups (host side; see `_sample_sokoban`)."""
  b, g, k = num_rooms, group_size, env.max_turns
  start, out, final, final_ids = jax.device_get((start, out, final, final_ids))
  mask = _turns(out["live"], b, g)
  actions = _turns(out["a"], b, g).astype(np.int64)
  rewards = np.where(mask, _turns(out["reward"], b, g), 0.0)
  solved_at = mask & _turns(out["solved"], b, g)
  policy = np.full(len(sokoban.MOVES), 1.0 / len(sokoban.MOVES))
  nodes = np.zeros((b, g, k + 1), np.int64)
  true_adv = np.zeros((b, g, k))
  value_pi = np.zeros((b, g, k + 1))
  for i in range(b):
    nxt, solved = room_graph(start.walls[i], start.targets[i], start.boxes[i], start.player[i], k)
    q, v = policy_values(nxt, solved, policy, gamma, env.step_penalty, k)
    m = np.zeros(g, np.int64)
    for t in range(k):
      live, a = mask[i, :, t], actions[i, :, t]
      true_adv[i, :, t] = np.where(live, q[t, m, a] - v[t, m], 0.0)
      value_pi[i, :, t] = np.where(live, v[t, m], 0.0)
      m_next = nxt[m, a]
      if np.any(live & (solved[m_next] != solved_at[i, :, t])) or np.any(
          live & ~np.isclose(rewards[i, :, t], solved[m_next] - env.step_penalty)):
        raise AssertionError(f"room {i}, turn {t}: the replayed graph disagrees with env.step.")
      m = np.where(live, m_next, m)
      nodes[i, :, t + 1] = m
  states = jax.tree.map(lambda x, y: np.concatenate([x, y[None]], 0), out["state"], final)
  flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), states)  # [(K+1)·n, ...]
  v_star = sokoban.optimal_values(env, flat, gamma).reshape(k + 1, b * g).T.reshape(b, g, k + 1)
  rewards = rewards.astype(np.float32)
  turns = Turns(state_ids=_slots(out["sid"], final_ids, b, g).astype(np.int32), rewards=rewards,
                turn_mask=mask, success=solved_at.any(-1))
  return Batch(turns=turns, actions=actions.astype(np.int32), states=nodes.astype(np.int32),
               true_adv=true_adv.astype(np.float32), value_pi=value_pi.astype(np.float32),
               cast_values=(_collected(rewards) + v_star).astype(np.float32),
               action_logprob=np.where(mask, np.log(policy[actions]), 0.0).astype(np.float32),
               action_entropy=np.where(mask, -np.sum(policy * np.log(policy)), 0.0).astype(
                   np.float32))


def sample_sokoban(env, key, num_rooms: int, group_size: int, gamma: float = 0.95) -> Batch:
  """B rooms from `reset`, G trajectories of the uniform policy from each start."""
  return sokoban_batch(env, *_sample_sokoban(env, key, num_rooms, group_size), num_rooms,
                       group_size, gamma)


# --------------------------------------------------------------------------- estimators


def trajectory_rollouts(batch: Batch) -> credit.Rollouts:
  """Trajectories as tokens [B, G, 2K] = [s_0, a_0, s_1, a_1, ...] (module docstring)."""
  t = batch.turns
  mask = np.repeat(np.asarray(t.turn_mask), 2, axis=-1)
  tokens = np.stack([np.asarray(t.state_ids)[..., :-1], np.asarray(batch.actions)], -1)
  tokens = np.where(mask, tokens.reshape(mask.shape), 0).astype(np.int32)
  return credit.Rollouts(tokens, mask, np.asarray(episode_returns(t.rewards, t.turn_mask)))


def turn_rollouts(batch: Batch) -> credit.Rollouts:
  """`trajectory_rollouts` with the turn structure the token-level turn estimators read:
  `turns.token_turn` (k on turn k's action token, −1 on state tokens), the action tokens'
  exact log-probs and entropies, and V^π_k(s_k) as the critic's value at turn k's tokens."""
  r = trajectory_rollouts(batch)
  t = batch.turns
  mask = np.asarray(t.turn_mask)
  k = np.arange(mask.shape[-1])
  token_turn = np.stack([np.full(mask.shape, -1), np.where(mask, k, -1)], -1)
  at_action = lambda x: np.stack([np.zeros(mask.shape), np.where(mask, x, 0.0)], -1).reshape(
      r.mask.shape).astype(np.float32)
  v = np.asarray(batch.value_pi)[..., :-1]
  values = np.repeat(np.where(mask, v, 0.0), 2, -1).astype(np.float32)
  return r.replace(turns=t.replace(token_turn=token_turn.reshape(r.mask.shape).astype(np.int32)),
                   policy_mask=np.asarray(at_action(1.0) > 0) & np.asarray(r.mask),
                   logprobs=at_action(batch.action_logprob),
                   entropy=at_action(batch.action_entropy), values=values)


def estimate(name: str, batch: Batch, gamma: float) -> np.ndarray:
  """The estimator's turn advantages float32 [B, G, K]."""
  hp = {"gamma": gamma} if name in DISCOUNTED else {}
  if name in TURN_LEVEL:
    if name in CAST_FORMS:
      hp = {"values_star": batch.cast_values, **CAST_FORMS[name]}
    return np.asarray(TURN_LEVEL[name](batch.turns, **hp))
  if name in TURN_TOKEN_ESTIMATORS:
    return np.asarray(credit.get(name)(turn_rollouts(batch), **hp))[..., 1::2]
  return np.asarray(cq._jitted(name)(trajectory_rollouts(batch)))[..., 1::2]


def sample(env_name: str, num_groups: int, group_size: int, seed: int, temperature: float = 1.0,
           env_kwargs=None) -> Batch:
  """B groups of G trajectories on 'mdp' (a new MDP and policy per seed) or 'sokoban'."""
  key = jax.random.key(seed)
  if env_name == "mdp":
    env = mdp_env(seed, **(env_kwargs or {}))
    return sample_mdp(env, key, mdp_logits(env, seed, temperature), num_groups, group_size,
                      GAMMA["mdp"])
  if env_name == "sokoban":
    return sample_sokoban(sokoban_env(**(env_kwargs or {})), key, num_groups, group_size,
                          GAMMA["sokoban"])
  raise ValueError(f"unknown env {env_name!r}; choose from {sorted(GAMMA)}.")


def evaluate(full: Batch, estimators, group_sizes, gamma: float,
             sign_threshold: float = 0.05) -> dict:
  """Credit metrics of `estimators` for each G on the first G trajectories of every group.

  Returns {"results": {name: {G: metrics}}, "groups": {G: facts}, "seconds": {name: s}}.
  """
  results = {name: {} for name in estimators}
  groups, seconds = {}, {name: 0.0 for name in estimators}
  for g in group_sizes:
    batch = first_members(full, g)
    mask, true = np.asarray(batch.turns.turn_mask), np.asarray(batch.true_adv)
    decisive = np.abs(true) > sign_threshold
    returns = np.asarray(episode_returns(batch.turns.rewards, batch.turns.turn_mask))
    groups[g] = {"num_groups": int(mask.shape[0]), "turns": int(mask.sum()),
                 "decisive_turns": int((decisive & mask).sum()),
                 "success_rate": float(np.mean(batch.turns.success)),
                 "return_variance_frac": float(np.mean(returns.max(-1) > returns.min(-1))),
                 "mean_turns": float(mask.sum(-1).mean()),
                 "true_adv_std": float(true[mask].std()),
                 "zero_mse": float(np.mean(true[mask] ** 2))}
    for name in estimators:
      begin = time.perf_counter()
      adv = estimate(name, batch, gamma)
      seconds[name] += time.perf_counter() - begin
      if adv.shape != true.shape:
        raise ValueError(f"{name} returned shape {adv.shape}; expected {true.shape}.")
      results[name][g] = cq.credit_metrics(adv, true, mask, decisive)
  return {"results": results, "groups": groups, "seconds": seconds}


def measure(env_name: str, estimators, group_sizes, num_groups: int, seed: int,
            sign_threshold: float = 0.05, temperature: float = 1.0, env_kwargs=None) -> dict:
  """`evaluate` on one draw (`sample`) of B groups of max(G) trajectories, one seed."""
  full = sample(env_name, num_groups, max(group_sizes), seed, temperature, env_kwargs)
  env = mdp_env(seed, **(env_kwargs or {})) if env_name == "mdp" else sokoban_env(
      **(env_kwargs or {}))
  return {"env": env_name, "env_config": repr(env), "gamma": GAMMA[env_name], "seed": seed,
          "group_sizes": list(group_sizes),
          **evaluate(full, estimators, group_sizes, GAMMA[env_name], sign_threshold)}


# --------------------------------------------------------------------------- report


def plot(summaries: dict, group_sizes, path: str, title: str = "") -> str:
  """Correlation and sign agreement vs G, one row per environment."""
  fig, axes = plt.subplots(len(summaries), 2, figsize=(13, 4.2 * len(summaries)), squeeze=False)
  colors = plt.get_cmap("tab10").colors
  for row, (env_name, summary) in zip(axes, summaries.items()):
    for ax, (k, label) in zip(row, (("corr", "Pearson corr(a, A^π)"),
                                    ("sign", "sign agreement, |A^π| > threshold"))):
      cq.plot_metric(ax, summary, group_sizes, k, label, colors)
      ax.set_title(env_name, fontsize=9)
    row[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  return cq.save_figure(fig, path, title)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--group_sizes", type=cq._ints, default=[4, 8, 16])
  parser.add_argument("--envs", default="mdp,sokoban")
  parser.add_argument("--mdp_groups", type=int, default=256, help="B on the MDP.")
  parser.add_argument("--sokoban_rooms", type=int, default=64, help="B on Sokoban.")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--seeds", type=int, default=3, help="runs seeds seed, ..., seed+seeds-1.")
  parser.add_argument("--estimators", default="", help=f"comma list; default: {ESTIMATORS}.")
  parser.add_argument("--sign_threshold", type=float, default=0.05)
  parser.add_argument("--temperature", type=float, default=1.0, help="of the MDP policy.")
  parser.add_argument("--workdir", default="/tmp/treecredit/agent_credit_quality")
  args = parser.parse_args(argv)

  env_names = [e for e in args.envs.split(",") if e]
  for e in env_names:
    if e not in GAMMA:
      raise ValueError(f"unknown env {e!r}; choose from {sorted(GAMMA)}.")
  estimators = [n for n in args.estimators.split(",") if n] or list(ESTIMATORS)
  for name in estimators:
    if name not in TURN_LEVEL:
      credit.get(name)  # an unknown name fails here, listing the valid ones
  seeds = list(range(args.seed, args.seed + args.seeds))
  sizes = {"mdp": args.mdp_groups, "sokoban": args.sokoban_rooms}

  start = time.perf_counter()
  runs, summaries = {}, {}
  for e in env_names:
    runs[e] = [measure(e, estimators, args.group_sizes, sizes[e], s, args.sign_threshold,
                       args.temperature) for s in seeds]
    summaries[e] = cq.summarize(runs[e])
  wall_s = time.perf_counter() - start

  print(f"seeds {seeds}; jax {jax.__version__} on {jax.devices()[0].platform}")
  print("corr: Pearson corr with A^π over taken turns; mse: mean (α·a − A^π)², α least "
        f"squares; sign: sign agreement where |A^π| > {args.sign_threshold}"
        + ("" if len(seeds) == 1 else f"; mean±std over {len(seeds)} seeds"))
  for e in env_names:
    per_seed = " (seed = the run's seed: a new MDP and policy per seed)" if e == "mdp" else ""
    print(f"\n== {e}: {runs[e][0]['env_config']}{per_seed}, γ = {GAMMA[e]}")
    for g in args.group_sizes:
      facts = [run["groups"][g] for run in runs[e]]
      avg = lambda k: np.mean([f[k] for f in facts])
      print(f"G={g:<3} B={facts[0]['num_groups']:<4} turns={avg('turns'):<7.0f} "
            f"decisive={avg('decisive_turns'):<6.0f} turns/traj={avg('mean_turns'):.2f} "
            f"success={avg('success_rate'):.3f} groups with return variance="
            f"{avg('return_variance_frac'):.3f} std A^π={avg('true_adv_std'):.3f}")
    print(cq.format_table(summaries[e], args.group_sizes, len(seeds)))
  print(f"\nmeasured in {wall_s:.1f} s")

  os.makedirs(args.workdir, exist_ok=True)
  json_path = os.path.join(args.workdir, "agent_credit_quality.json")
  png_path = os.path.join(args.workdir, "agent_credit_quality.png")
  report = {"seeds": seeds, "group_sizes": args.group_sizes, "num_groups": sizes,
            "gamma": GAMMA, "sign_threshold": args.sign_threshold,
            "temperature": args.temperature, "estimators": estimators,
            "summary": summaries, "runs": runs, "wall_s": wall_s}
  with open(json_path, "w") as f:
    json.dump(cq._jsonable(report), f, indent=1)
  plot(summaries, args.group_sizes, png_path, title=f"step-level credit accuracy, seeds {seeds}")
  print(f"wrote {json_path} and {png_path}")
  return report


if __name__ == "__main__":
  main()
