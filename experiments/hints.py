"""The seeds' hinted rollouts (MCTS-staged GRPO, ADHint) vs GRPO on scratch_add.

    python -m experiments.hints [--config=configs/hints.py:adhint] [--config.quick=True]

Methods and budget: configs/hints.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('hints')
