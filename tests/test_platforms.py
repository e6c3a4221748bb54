"""A CPU host with libtpu installed (the test extra) starts the experiments without libtpu's
errors: `experiments/__init__.py` keeps JAX on the CPU when the host has no TPU chip."""

import importlib.util
import os
import subprocess
import sys

import pytest

from experiments import _GPU_PLUGINS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = 'import experiments, jax; print(jax.config.jax_platforms, jax.devices()[0].platform)'


def run(**env_changes):
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  env.update(env_changes)
  return subprocess.run([sys.executable, '-c', PROBE], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None
                    or any(importlib.util.find_spec(p) for p in _GPU_PLUGINS),
                    reason='needs libtpu and no GPU plugin')
def test_no_tpu_errors_on_a_cpu_host_and_jax_platforms_wins():
  out = run()
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ['cpu', 'cpu'] and 'TPU' not in out.stderr, out.stderr
  out = run(JAX_PLATFORMS='cpu')  # the user's setting is left as it is
  assert out.returncode == 0 and out.stdout.split() == ['cpu', 'cpu'], out.stderr
