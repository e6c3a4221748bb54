"""GiGPO (Feng et al. 2025): episode term + anchor-state step term, vs GRPO.

    python -m experiments.gigpo [--config.quick=True] [--workdir=/tmp/treecredit/gigpo]

Methods, environment and budget: configs/gigpo.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('gigpo')
