"""CAST: turn advantages V*(s') − V*(s) from the environment's solver, vs GRPO.

Environment `household`; `configs.agents.paper`: the agents' default budget (expert warm start,
30 RL steps x 16 start states x G = 8, 3 seeds) for every method.
"""

from configs import agents


def get_config():
  return agents.paper('grpo:iid,cast:iid')
