"""The seeds' hindsight, answer-conditioned step credit (PBSD, HCAPO, SIOP) vs GRPO on scratch_add.

    python -m experiments.hindsight [--config.quick=True] [--workdir=/tmp/treecredit/hindsight]

Methods and budget: configs/hindsight.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('hindsight')
