"""Tool-call, evidence and pivot credit for agents (issue 23): TACO's tool credit (#134:
each call's Differential Answer-Probe Reward, the gold answer's probability with minus
without the view the call returned, plus the outcome advantage routed to the calls whose
DAPR has its sign), ICA (#155: each retrieved view's leave-one-out contribution to the gold
answer's posterior at the final decision, group-normalised and added to the outcome
advantage) and PiCA (#187: potential-based shaping by the gold answer's probe probability,
the potential moving only at pivot states, those a success of the same group reached) vs
GRPO on webshop (K = 6: search and click are the calls, buy the answer), the agents' default
budget (expert warm start, 30 RL steps x 16 start states x G = 8), 5 seeds, paired intervals
at matched environment steps.

    python -m experiments.tool_credit [--config.quick=True]
"""

from configs import agents


def get_config():
  c = agents.paper('grpo:iid,taco_tools:iid,ica:iid,pica:iid',
                   **{'task': {'name': 'webshop', 'kwargs': {'max_turns': 6}}})
  c.seeds = (0, 1, 2, 3, 4)
  return c
