"""IGPO (Wang et al. 2025): information-gain turn rewards from gold-answer probes, vs GRPO.

Environment `webshop`; `configs.agents.paper`: the agents' default budget (expert warm start,
30 RL steps x 16 start states x G = 8, 3 seeds) for every method.
"""

from configs import agents


def get_config():
  return agents.paper('grpo:iid,igpo:iid', **{'task': {'name': 'webshop', 'kwargs': {'max_turns': 6}}})
