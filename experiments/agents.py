"""Every turn-level agent estimator vs GRPO (and TEMPO over whole trajectories) on one
multi-turn environment, from one expert warm start: `python -m experiments.agents`.

    python -m experiments.agents [--config.quick=True] [--config.task.name=webshop]
        [--config.methods=grpo:iid,gigpo:iid] [--workdir=/tmp/treecredit/agents]

Methods, environment and budget: configs/agents.py; the per-paper scripts (gigpo, gagpo,
salt, graphgpo, gtpo, cast, igpo, tree_grpo_turns) run subsets of it.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('agents')
