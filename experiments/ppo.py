"""PPO with a learned critic (verl's recipe) vs GRPO and TEMPO, on scratch_add or household.

    python -m experiments.ppo [--config=configs/ppo.py[:household]] [--config.quick=True]
        [--workdir=/tmp/treecredit/ppo]

Methods, critic and budget: configs/ppo.py. Shared machinery: experiments/training/compare.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('ppo')
