"""The seeds' policy-implied values vs GRPO on scratch_add.

    python -m experiments.implied_values [--config.quick=True] [--workdir=/tmp/treecredit/implied_values]

Methods and budget: configs/implied_values.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('implied_values')
