"""Scripts and the shared training machinery.

With libtpu installed (the test extra installs it, for the TPU compile check) JAX probes for
a TPU when its backends start and libtpu prints errors on a host that has none. On a host
with no TPU chip (JAX's own PCI check) and no GPU plugin, the experiments use the CPU alone,
unless JAX_PLATFORMS says otherwise; AOT compiles for TPU topologies still work.
"""

import importlib.util
import os

_GPU_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm60_plugin', 'jax_rocm7_plugin')


def _cpu_without_tpu():
  if 'JAX_PLATFORMS' in os.environ or importlib.util.find_spec('libtpu') is None:
    return
  if any(importlib.util.find_spec(p) for p in _GPU_PLUGINS):
    return
  import jax
  from jax._src import hardware_utils
  if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
    jax.config.update('jax_platforms', 'cpu')


_cpu_without_tpu()
