"""Turn-level normalisation for agents (issue 23): MT-GRPO (#17), MAPO for dialogue (#6) and
MemoPilot (#42) vs GRPO on household, `configs.agents.paper`'s budget (expert warm start, 30
RL steps x 16 start states x G = 8), 5 seeds, paired intervals at matched environment steps.
Household pays only on the solving turn, so here the turn terms normalise that one reward by
turn position (MT-GRPO's turn term is non-zero on final turns only); the exact-MDP and
Sokoban credit-accuracy rows (experiments/agent_credit_quality.py) have per-step rewards.

`:retry`: MR-Search (#31, `mr_search`: leave-one-out credit per attempt, accumulated over
later attempts, plus the meta-episode's outcome) vs GRPO on `household_retry` (two attempts
of 6 turns at one task, the failed one in context, "retry" opening the second), the same
budget and expert warm start.

`:confidence`: the turn-confidence reweightings, TAURA (#45, `taura`: GRPO scaled per turn by
its action entropy over the trajectory's mean) and CoPO (#43, `copo_turns`: by its confidence,
exp of the action's mean log-prob), vs GRPO, the same budget and expert warm start.

`:slea`: SLEA-RL (#46) on household inside the experience wrapper (envs/experience.py: every
observation followed by the library's strategy and failure pattern for its cluster, the
observation): `gigpo:experience` (the library, filled by sampler 'experience', plus GiGPO's
step credit over the same clusters) against `grpo:iid` and `gigpo:iid` on the same wrapped
environment with the library left empty (no hints: it isolates the library), the same budget;
the warm start imitates the expert with no hints shown.
"""

from configs import agents


def get_config(arg: str = ''):
  if arg not in ('', 'retry', 'slea', 'confidence'):
    raise ValueError(f'configs/turn_norm.py:{arg}: valid variants are "", retry, slea and '
                     f'confidence')
  if arg == 'confidence':
    c = agents.paper('grpo:iid,taura:iid,copo_turns:iid')
  elif arg == 'slea':
    c = agents.paper('grpo:iid,gigpo:iid,gigpo:experience')
    c.agent.experience_slots = 2048
  elif arg == 'retry':
    c = agents.paper('grpo:iid,mr_search:iid')
    c.task.name, c.task.kwargs = 'household_retry', {'attempts': 2, 'max_turns': 12}
  else:
    c = agents.paper('grpo:iid,mt_grpo:iid,mapo_turns:iid,memopilot:iid')
  c.seeds = (0, 1, 2, 3, 4)
  return c
