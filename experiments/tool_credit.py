"""Tool-call and evidence credit (TACO's tool credit, ICA) vs GRPO on webshop.

    python -m experiments.tool_credit [--config.quick=True] [--workdir=/tmp/treecredit/tool_credit]

Methods, environment and budget: configs/tool_credit.py. Shared machinery:
experiments/training/compare.py; the probes: experiments/rollouts/agent_sampling.py.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('tool_credit')
