import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # reference_trie and strategies
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

from hypothesis import settings  # noqa: E402

settings.register_profile("default", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("default")
