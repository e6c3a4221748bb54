"""NGRPO: GRPO statistics with one virtual maximum-reward sample, vs GRPO.

    python -m experiments.ngrpo [--config.quick=True] [--workdir=/tmp/treecredit/ngrpo]

Methods, sampler and budget: configs/ngrpo.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('ngrpo')
