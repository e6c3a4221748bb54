"""Expert-trace and counterfactual turn credit (MatchTIR, InfoPO) vs GRPO on household.

    python -m experiments.expert_traces [--config.quick=True] [--workdir=/tmp/treecredit/milestones]

Methods, environment and budget: configs/expert_traces.py. Shared machinery:
experiments/training/compare.py; the matching: experiments/rollouts/agent_sampling.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('expert_traces')
