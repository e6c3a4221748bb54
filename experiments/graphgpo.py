"""GraphGPO: distance-to-success edge returns on the group's state graph, vs GRPO.

    python -m experiments.graphgpo [--config.quick=True] [--workdir=/tmp/treecredit/graphgpo]

Methods, environment and budget: configs/graphgpo.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('graphgpo')
