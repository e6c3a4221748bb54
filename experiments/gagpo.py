"""GAGPO: GAE over state values V̂(s) averaged over the group's visits, vs GRPO.

    python -m experiments.gagpo [--config.quick=True] [--workdir=/tmp/treecredit/gagpo]

Methods, environment and budget: configs/gagpo.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('gagpo')
