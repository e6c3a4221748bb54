import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))  # reference_trie and strategies
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
# The suite runs on the CPU. With libtpu installed (the test extra, for test_compile_tpu) JAX
# would otherwise probe for a TPU in every process and print libtpu's start-up warnings; the
# TPU topologies used for AOT compiles are still available with this set.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling is most of the suite's time: XLA's backend optimizations are off in the tests
# and their subprocesses (about 30 % less time; same programs, floats rounded a little
# differently; the golden matrix's fast subset has records taken so). The numbers a user gets
# are checked with them on: the full golden matrix (slow; tests/golden/record.py) and the main
# job's pin (test_main_job.py).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One persistent compilation cache for the run, shared by the xdist workers (they inherit the
# controller's environment) and the subprocesses tests start: without it every module
# recompiles what earlier ones compiled (their in-memory caches are dropped below), e.g. the
# quick loop's sampler and update in every family test; with it the suite runs about a quarter
# faster. A cache directory the user set is used and kept; ours is deleted at the end.
_OWN_CACHE = ("PYTEST_XDIST_WORKER" not in os.environ
              and "JAX_COMPILATION_CACHE_DIR" not in os.environ)
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="treecredit-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

from hypothesis import settings  # noqa: E402

settings.register_profile("default", max_examples=20, deadline=None, derandomize=True)
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


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True)


@pytest.fixture
def final_plots_only(monkeypatch):
  """A comparison rewrites summary.json and its plots after every run; with this fixture only
  its final report draws plots (matplotlib: about a second of CPU a report, most of a quick
  report's time). The partial reports still write their summaries (tested: test_tracking),
  and plot_runs reads only the rows' common fields, which the final report plots for every
  method."""
  import contextlib
  import inspect
  from unittest import mock
  from experiments.training import compare
  real = compare._report

  def report(*args, **kwargs):
    partial = inspect.signature(real).bind(*args, **kwargs).arguments['done'] is not None
    with (mock.patch.object(compare.plots, 'plot_runs', lambda *a, **k: []) if partial
          else contextlib.nullcontext()):
      return real(*args, **kwargs)

  monkeypatch.setattr(compare, '_report', report)
