"""The seeds' gradient-saliency token weighting vs GRPO on scratch_add.

    python -m experiments.saliency [--config.quick=True] [--workdir=/tmp/treecredit/saliency]

Methods and budget: configs/saliency.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('saliency')
