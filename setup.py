"""Tree-structured rollouts and fine-grained credit assignment for RL post-training, in JAX."""
from setuptools import setup

setup(
    name="treecredit",
    version="0.1.0",
    description=__doc__,
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=["trees", "credit", "envs", "experiments", "experiments.models", "experiments.rollouts",
              "experiments.training", "experiments.training.passes", "configs"],
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "ml-collections>=1.1.0",
        "absl-py>=2.0",
        "numpy>=2.0",
        "scipy>=1.17",  # t quantiles (experiments/training/stats.py); also a dependency of jax
        "matplotlib>=3.8",
        "tqdm>=4.60",
        # Pretrained models, tokenizers and text tasks (the lowest versions tested).
        "gguf>=0.19.0",
        "tokenizers>=0.23.3",
        "safetensors>=0.8.0",
        "jinja2>=3.1.6",
        "reasoning-gym>=0.1.25",
        "qwix>=0.1.8",
    ],
    extras_require={
        # pytest-xdist: the README's command runs the suite in 2 processes (one core each;
        # tests/conftest.py keeps XLA single-threaded).
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "hypothesis>=6.100",
                 # tests/test_notebook.py executes experiments/trees_notebook.ipynb.
                 "nbclient>=0.11.0", "nbformat>=5.11.1", "ipykernel>=7.4.0",
                 "treescope>=0.1.10",
                 # tests/test_compile_tpu.py compiles the RL step for TPU slices with libtpu
                 # (no TPU needed; JAX still runs on the CPU). libtpu ships for Linux x86_64.
                 "jax[tpu]>=0.10.2; sys_platform == 'linux' and platform_machine == 'x86_64'"],
        # Optional, not required: `pip install graphviz` (>= 0.21 tested) and Graphviz's
        # `dot` binary make the notebook draw its tree; without them it prints the DOT source.
    },
)
