"""IGPO (Wang et al. 2025): information-gain turn rewards from gold-answer probes, vs GRPO.

    python -m experiments.igpo [--config.quick=True] [--workdir=/tmp/treecredit/igpo]

Methods, environment and budget: configs/igpo.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('igpo')
