"""QAE: a quantile baseline instead of the group mean, vs GRPO.

    python -m experiments.qae [--config.quick=True] [--workdir=/tmp/treecredit/qae]

Methods, sampler and budget: configs/qae.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('qae')
