"""CAST (the paper's recipe: GRPO + 0.1 x the asinh, batch-RMS-normalised step-count advantage
from the environment's solver; `credit.turn_signals.cast`) vs GRPO.

Environment `household`; `configs.agents.paper`: the agents' default budget (expert warm start,
30 RL steps x 16 start states x G = 8) for every method, 5 seeds (issue 23 asks for CAST's
curves over >= 5).
"""

from configs import agents


def get_config():
  c = agents.paper('grpo:iid,cast:iid')
  c.seeds = (0, 1, 2, 3, 4)
  return c
