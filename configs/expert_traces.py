"""Expert-trace and counterfactual turn credit for agents (issue 23): MatchTIR (#27, turn
rewards from a one-to-one matching of the trajectory's actions against the environment
expert's trace from the same start, plus a dual-level advantage) and InfoPO (#41, how much
each turn's feedback changed the next action against a masked-feedback counterfactual,
fused with the outcome) vs GRPO on household, `configs.agents.paper`'s budget
(expert warm start, 30 RL steps x 16 start states x G = 8), 5 seeds, paired intervals at
matched environment steps (the GRPO runs are those of configs/milestones.py and
configs/turn_norm.py: share a workdir to reuse them).

`:steps`: InT (#131, `intervention`) and DistIL (#169, `distil`) vs GRPO on scratch_add,
`configs.tempo.family`'s budget. InT: before RL, 10 SFT steps on the policy's own failures
with their first wrong step replaced by the demonstration's (experiments/training/
interventions.py; its sampled tokens count in the matched generated tokens). DistIL: the
same correction of each step's own samples, one SFT step (its own Adam) after every update.

    python -m experiments.expert_traces [--config=configs/expert_traces.py:steps]
"""

from configs import agents, tempo


def get_config(arg: str = ''):
  if arg == 'steps':
    return tempo.family('intervention:iid,distil:iid')
  if arg:
    raise ValueError(f'configs/expert_traces.py:{arg}: valid variants are "" (household) and '
                     f'steps')
  c = agents.paper('grpo:iid,matchtir:iid,infopo:iid')
  c.seeds = (0, 1, 2, 3, 4)
  return c
