"""Milestone and hierarchical turn credit (BEACON #28, issue 23) vs GRPO on household.

    python -m experiments.milestones [--config.quick=True]

`configs.agents.paper`: the agents' default budget (expert warm start, 30 RL steps x 16 start
states x G = 8) for every method, 5 seeds, paired intervals at matched environment steps.
The loop fills `Turns.milestones` from household's sub-goals (holding or placing the object,
cleaning it when asked, solving).
"""

from configs import agents


def get_config():
  c = agents.paper('grpo:iid,beacon:iid')
  c.seeds = (0, 1, 2, 3, 4)
  return c
