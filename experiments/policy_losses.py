"""The seeds' alternative policy losses and gradient masks vs GRPO on scratch_add.

    python -m experiments.policy_losses [--config.quick=True] [--workdir=/tmp/treecredit/policy_losses]

Methods and budget: configs/policy_losses.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('policy_losses')
