"""SALT: a step's advantage is the mean trajectory advantage through it, vs GRPO.

    python -m experiments.salt [--config.quick=True] [--workdir=/tmp/treecredit/salt]

Methods, environment and budget: configs/salt.py. Shared machinery: experiments/compare.py
(the loop plays the environment through experiments/agent_rollouts.py).
"""

from experiments.compare import main

if __name__ == '__main__':
  main('salt')
