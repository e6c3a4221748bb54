"""GRPO vs TEMPO on a pretrained LM (SmolLM2-135M-Instruct built in) and a reasoning-gym task.

    python -m experiments.lm [--config=configs/lm.py] [--workdir=/tmp/treecredit/lm]
        [--config.quick=True] [--config.lm.source=/path/to/hf_dir_or.gguf]

Same loop, samplers, estimators and update step as the JAX-task scripts; see
configs/lm.py for the budget and experiments/training/compare.py for the workdir layout.
"""

from experiments.training.compare import main

if __name__ == '__main__':
  main('lm')
