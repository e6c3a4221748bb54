"""SPO (Guo et al. 2025): SPO-tree on a fixed-branching tree and SPO-chain at low-probability cutpoints, vs GRPO.

    python -m experiments.spo [--config.quick=True] [--workdir=/tmp/treecredit/spo]

Methods, sampler and budget: configs/spo.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('spo')
