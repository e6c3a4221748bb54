"""The seeds' search trees (ELPO's binary-search tree, TreePS-RAG's step tree) vs GRPO on
scratch_add.

    python -m experiments.tree_search [--config=configs/tree_search.py:steps] [--config.quick=True]

Methods and budget: configs/tree_search.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('tree_search')
