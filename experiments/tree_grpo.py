"""Tree-GRPO (Ji et al. 2025): group- plus tree-relative advantages on forked trees, vs GRPO.

    python -m experiments.tree_grpo [--config.quick=True] [--workdir=/tmp/treecredit/tree_grpo]

Methods, sampler and budget: configs/tree_grpo.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('tree_grpo')
