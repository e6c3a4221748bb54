"""TEMPO vs GRPO (i.i.d. and branching samplers) from one shared SFT warm start.

    python -m experiments.tempo [--config=configs/tempo.py] [--workdir=/tmp/treecredit/tempo]
        [--config.quick=True] [--config.rl.steps=100] [--config.methods=grpo:iid,tempo:iid]

See `experiments/training/compare.py` for the workdir layout.
"""

from experiments.training.compare import format_table, main, run_experiment, unknown_override  # noqa: F401

if __name__ == '__main__':
  main('tempo')
