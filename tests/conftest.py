import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # reference_trie and strategies
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
# The suite runs on the CPU. With libtpu installed (the test extra, for test_compile_tpu) JAX
# would otherwise probe for a TPU in every process and print libtpu's start-up warnings; the
# TPU topologies used for AOT compiles are still available with this set.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

settings.register_profile("default", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("default")


import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops each module's compiled programs after it: a full run in one process otherwise
  grows past 6 GB and has crashed inside XLA's CPU compiler (test_tree_credit, ~400 tests in)."""
  yield
  jax.clear_caches()
  gc.collect()
