"""Pass@k training (Chen et al. 2025): analytic Pass@k advantages, vs GRPO.

    python -m experiments.passk [--config.quick=True] [--workdir=/tmp/treecredit/passk]

Methods, sampler and budget: configs/passk.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('passk')
