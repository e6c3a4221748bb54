"""Milestone, phase and hierarchical turn credit (BEACON, ReBel, HiPER) vs GRPO on household.

    python -m experiments.milestones [--config.quick=True] [--workdir=/tmp/treecredit/milestones]

Methods, environment and budget: configs/milestones.py. Shared machinery:
experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('milestones')
