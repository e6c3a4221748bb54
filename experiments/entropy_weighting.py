"""The seeds' entropy and surprisal token weightings vs GRPO on scratch_add.

    python -m experiments.entropy_weighting [--config.quick=True] [--workdir=/tmp/treecredit/entropy_weighting]

Methods and budget: configs/entropy_weighting.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('entropy_weighting')
