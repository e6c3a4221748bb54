"""The seeds' polarity asymmetries and curricula vs GRPO on scratch_add.

    python -m experiments.polarity [--config.quick=True] [--workdir=/tmp/treecredit/polarity]

Methods and budget: configs/polarity.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('polarity')
