"""Turn-level normalisation (MT-GRPO, MAPO for dialogue, MemoPilot) vs GRPO on household.

    python -m experiments.turn_norm [--config.quick=True] [--workdir=/tmp/treecredit/milestones]

Methods, environment and budget: configs/turn_norm.py (the GRPO runs are those of
configs/milestones.py: pass its workdir to share them). Shared machinery:
experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('turn_norm')
