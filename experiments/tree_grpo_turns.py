"""Tree-GRPO over turns (Ji et al. 2025): chains forked at a turn boundary, vs GRPO on the same trees and i.i.d..

    python -m experiments.tree_grpo_turns [--config.quick=True] [--workdir=/tmp/treecredit/tree_grpo_turns]

Methods, environment and budget: configs/tree_grpo_turns.py. Shared machinery: experiments/training/compare.py
(the loop plays the environment through experiments/rollouts/agent_rollouts.py).
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('tree_grpo_turns')
