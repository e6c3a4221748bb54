"""TreeRL (Hou et al. 2025): EPTree forks at the most uncertain tokens and TreeRL's process credit, vs GRPO.

    python -m experiments.treerl [--config.quick=True] [--workdir=/tmp/treecredit/treerl]

Methods, sampler and budget: configs/treerl.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('treerl')
