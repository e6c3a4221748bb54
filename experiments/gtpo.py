"""GTPO-style normalised discounted turn returns (per group and turn index), vs GRPO.

    python -m experiments.gtpo [--config.quick=True] [--workdir=/tmp/treecredit/gtpo]

Methods, environment and budget: configs/gtpo.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('gtpo')
