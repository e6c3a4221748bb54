"""The seeds' replay and off-policy methods (R³, off-policy GRPO) vs GRPO on scratch_add.

    python -m experiments.replay [--config.quick=True] [--workdir=/tmp/treecredit/replay]

Methods, prompt pool and budget: configs/replay.py. Shared machinery:
experiments/training/compare.py; the replay store and the lagged sampler:
experiments/training/replay.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('replay')
