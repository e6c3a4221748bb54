"""SALT: a step's advantage is the mean trajectory advantage through it, vs GRPO.

    python -m experiments.salt [--config.quick=True] [--workdir=/tmp/treecredit/salt]

Methods, environment and budget: configs/salt.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('salt')
