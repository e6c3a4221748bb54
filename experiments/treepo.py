"""TreePO (Li et al. 2025): subtree-averaged advantages on a fixed-branching tree, vs GRPO.

    python -m experiments.treepo [--config.quick=True] [--workdir=/tmp/treecredit/treepo]

Methods, sampler and budget: configs/treepo.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('treepo')
