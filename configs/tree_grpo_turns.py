"""Tree-GRPO over turns (Ji et al. 2025): chains forked at a turn boundary, vs GRPO on the same trees and i.i.d..

Environment `household`; `configs.agents.paper`: the agents' default budget (expert warm start,
30 RL steps x 16 start states x G = 8, 3 seeds) for every method.
"""

from configs import agents


def get_config():
  return agents.paper('grpo:iid,grpo:tree_turns,tree_grpo:tree_turns')
