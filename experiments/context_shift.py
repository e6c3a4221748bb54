"""The seeds' context-shift token credit vs GRPO on scratch_add.

    python -m experiments.context_shift [--config.quick=True] [--workdir=/tmp/treecredit/context_shift]

Methods and budget: configs/context_shift.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('context_shift')
