"""Turn-level normalisation (MT-GRPO, MAPO for dialogue, MemoPilot) vs GRPO on household,
MR-Search's attempt credit on household_retry (`:retry`), SLEA-RL's step-level experience
library on household (`:slea`) and the turn-confidence reweightings TAURA and CoPO on
household (`:confidence`).

    python -m experiments.turn_norm [--config.quick=True] [--workdir=/tmp/treecredit/milestones]
    python -m experiments.turn_norm --config=configs/turn_norm.py:retry [--workdir=...]
    python -m experiments.turn_norm --config=configs/turn_norm.py:slea [--workdir=...]
    python -m experiments.turn_norm --config=configs/turn_norm.py:confidence [--workdir=...]

Methods, environment and budget: configs/turn_norm.py (the GRPO runs are those of
configs/milestones.py: pass its workdir to share them; `:retry` and `:slea` have their own). Shared machinery:
experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('turn_norm')
