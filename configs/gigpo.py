"""GiGPO (Feng et al. 2025): episode term + anchor-state step term, vs GRPO.

Environment `household`; `configs.agents.paper`: the agents' default budget (expert warm start,
30 RL steps x 16 start states x G = 8, 3 seeds) for every method.
"""

from configs import agents


def get_config():
  return agents.paper('grpo:iid,gigpo:iid')  # gamma 0.95, omega 1: gigpo's defaults
