"""The seeds' response-level confidence and difficulty reweightings vs GRPO on scratch_add.

    python -m experiments.confidence [--config.quick=True] [--workdir=/tmp/treecredit/confidence]

Methods and budget: configs/confidence.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('confidence')
