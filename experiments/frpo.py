"""FRPO: GRPO with a future-KL correction in the advantages, vs GRPO.

    python -m experiments.frpo [--config.quick=True] [--workdir=/tmp/treecredit/frpo]

Methods, sampler and budget: configs/frpo.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('frpo')
