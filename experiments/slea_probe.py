"""Probes of SLEA-RL's trained policies and libraries (README, "Multi-turn agents").

    python -m experiments.slea_probe --workdir=/tmp/treecredit/slea
    python -m experiments.slea_probe --workdir=<dir> --failure_patterns=False   # strategies only

Reads the finished runs of `configs/turn_norm.py:slea` in `workdir` (gigpo:experience and
grpo:iid, seeds 0-4; run the comparison first) and plays the evaluation's 256 greedy episodes
(eval.seed) with each final policy:
  - with its own library (`own`) and with none (`none`): success; on the turns whose
    observation showed a strategy, how often the action is that strategy (`follows`), on those
    that showed a failure pattern, how often the action is the one to avoid (`repeats`); for
    `none`, the same rates on the turns whose cluster the library holds, hints not shown;
  - with an oracle library (the expert's action as the strategy of every observation on the
    expert's paths from the same starts): success and `follows`, for the warm start too;
  - how many of the library's strategies on those clusters equal the expert's action.
Prints one JSON line per policy.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import turn_norm
from envs import experience as exp_env
from experiments.rollouts import agent_sampling as ags
from experiments.training import compare, loop

WORKDIR = flags.DEFINE_string('workdir', '/tmp/treecredit/slea', 'The comparison\'s workdir.')
FAILURE_PATTERNS = flags.DEFINE_bool('failure_patterns', True,
                                     'The runs\' sampler.failure_patterns.')
SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2', '3', '4'], 'Seeds to probe.')


def oracle_library(problem, ecfg) -> exp_env.Library:
  """The expert's action as the strategy of every cluster on its paths from the eval starts
  (the first to claim a slot keeps it)."""
  env = problem.env
  e = ags.expert_episodes(env, jax.random.PRNGKey(ecfg.seed), ecfg.num_prompts,
                          num_turns=problem.num_turns, start=problem.eval_starts(ecfg))
  _, acts, _ = ags.split_slots(e.tokens, env, problem.num_turns)
  lib = env.empty()
  keys, tips, score = (np.asarray(x).copy() for x in (lib.tip_key, lib.tip, lib.tip_score))
  for c, a, taken in zip(np.asarray(e.state_ids[:, 0, :-1]).ravel(),
                         np.asarray(acts[:, 0, :, :-1]).reshape(-1, env.action_len - 1),
                         np.asarray(e.turn_mask[:, 0]).ravel()):
    s = int(exp_env.slot_of(jnp.int32(c), env.slots))
    if taken and score[s] < 0:
      keys[s], tips[s], score[s] = c, a, 1.0
  return lib.replace(tip_key=jnp.asarray(keys), tip=jnp.asarray(tips), tip_score=jnp.asarray(score))


def play(problem, params, library, ecfg, shown=None) -> dict:
  """Greedy eval episodes reading `library`; rates on the turns where `shown` (default
  `library`) holds a strategy / failure pattern for the observation."""
  env = problem.env
  e = problem.greedy_episodes(params, ecfg, library)
  _, acts, _ = ags.split_slots(e.tokens, env, problem.num_turns)
  moves = np.asarray(acts[..., :-1]).reshape(-1, env.action_len - 1)
  clusters = jnp.asarray(np.asarray(e.state_ids[..., :-1]).ravel())
  tip, has_tip, avoid, has_avoid = jax.vmap(exp_env.lookup, (None, 0))(
      library if shown is None else shown, clusters)
  taken = np.asarray(e.turn_mask).ravel()
  rate = lambda hint, has: (float(np.all(moves == np.asarray(hint), -1)[has & taken].mean())
                            if np.any(has & taken) else None)
  return dict(success=float(np.mean(e.success)), tip_turns=int(np.sum(has_tip & taken)),
              follows=rate(tip, np.asarray(has_tip)), avoid_turns=int(np.sum(has_avoid & taken)),
              repeats=rate(avoid, np.asarray(has_avoid)))


def agreement(library, oracle) -> float:
  """The fraction of the library's strategies on the oracle's clusters that are its action."""
  same = ((np.asarray(library.tip_score) >= 0) & (np.asarray(oracle.tip_score) >= 0)
          & (np.asarray(library.tip_key) == np.asarray(oracle.tip_key)))
  return float(np.all(np.asarray(library.tip) == np.asarray(oracle.tip), -1)[same].mean())


def main(_):
  cfg = turn_norm.get_config('slea')
  cfg.progress, cfg.sampler.failure_patterns = False, FAILURE_PATTERNS.value
  run = compare._run_cfg(cfg)
  problem = loop.build_problem(run)
  params0, _ = loop.sft(run, f'{WORKDIR.value}/sft')
  oracle, empty = oracle_library(problem, cfg.eval), problem.env.empty()
  print(json.dumps(dict(policy='warm start', oracle=play(problem, params0, oracle, cfg.eval))))
  for method in ('gigpo:experience', 'grpo:iid'):
    for seed in map(int, SEEDS.value):
      d = compare.run_dir(WORKDIR.value, method, seed)
      if not os.path.exists(os.path.join(d, 'metrics.jsonl')):
        raise FileNotFoundError(f'{d} has no run: run the comparison first (module docstring)')
      out = loop.train(run, d, params0, method=method, seed=seed)  # restores the finished run
      lib = out.get('library')
      row = dict(policy=method, seed=seed, oracle=play(problem, out['params'], oracle, cfg.eval),
                 none=play(problem, out['params'], empty, cfg.eval, shown=lib))
      if lib is not None:
        row.update(own=play(problem, out['params'], lib, cfg.eval),
                   agrees_with_expert=agreement(lib, oracle))
      print(json.dumps(row), flush=True)


if __name__ == '__main__':
  app.run(main)
