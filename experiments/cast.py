"""CAST (GRPO + the solver's step-count advantage, the paper's recipe) vs GRPO on household.

    python -m experiments.cast [--config.quick=True] [--workdir=/tmp/treecredit/cast]

Methods, environment and budget: configs/cast.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('cast')
