"""The seeds' self-probe potentials on reasoning steps (SPAE, P2S, MIG) vs GRPO on scratch_add.

    python -m experiments.probes [--config.quick=True] [--workdir=/tmp/treecredit/probes]

Methods and budget: configs/probes.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('probes')
