"""Orbax checkpoints of a run: the train state and the loop state beside it, a
config fingerprint, corrupt checkpoints set aside."""

import errno
import json
import os
import warnings

import jax
import orbax.checkpoint as ocp

from experiments.training import train_step as ts


def _manager(path):
  # cleanup_tmp_directories: a save cut short (kill -9, full disk) leaves a
  # `<step>.orbax-checkpoint-tmp-*` directory that orbax never lists; it is removed here.
  return ocp.CheckpointManager(
      os.path.abspath(path),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False,
                                           create=True, cleanup_tmp_directories=True))


def _train_tree(state: ts.TrainState) -> dict:
  return {'params': state.params, 'opt_state': state.opt_state, 'step': state.step,
          'rng': state.rng}


def _state_tree(state: ts.TrainState, aux=None):
  """The checkpointed tree: the train state, and each non-None `aux` entry (the loop state
  that persists across steps: 'credit_state' a stateful estimator's, 'critic' the learned
  critic's `TrainState`, 'replay' the replay store, 'behaviour' the lagged sampler's
  params, 'expert_opt' DistIL's SFT optimizer state, 'pass_rate' the knapsack sampler's
  per-prompt pass rates), saved with the step's."""
  tree = _train_tree(state)
  for name, value in (aux or {}).items():
    if value is not None:
      tree[name] = _train_tree(value) if isinstance(value, ts.TrainState) else value
  return tree


def save_checkpoint(mngr, step: int, state: ts.TrainState, meta: dict, aux=None):
  """Saves `step` (orbax writes a temporary directory and renames it when complete, so a
  save cut short leaves the previous checkpoints intact), with the loop state after that
  step in `aux` ({name: pytree or TrainState or None}, `_state_tree`).
  A failed write (e.g. a full disk) raises an error (OSError for an OS error, same errno;
  else RuntimeError) naming the checkpoint and the newest intact one a rerun resumes from."""
  tree = ts.to_global(_state_tree(state, aux))  # multi-process: global only
  try:
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                            meta=ocp.args.JsonSave(meta)), force=True)
    mngr.wait_until_finished()
    if jax.process_index() == 0:
      _record_sizes(os.path.join(str(mngr.directory), str(step)))
  except Exception as e:  # noqa: BLE001 (re-raised with the checkpoint named)
    path = os.path.join(str(mngr.directory), str(step))
    # The partial write stays in orbax's temporary directory (never listed as a step); the
    # rerun's manager removes it (`cleanup_tmp_directories`) before it writes anything.
    try:
      mngr.reload()
      intact = [s for s in mngr.all_steps() if s != step]
      resume = f'step {max(intact)}' if intact else 'the start (no earlier checkpoint)'
    except Exception:  # noqa: BLE001 (the directory itself unreadable)
      resume = 'its newest intact checkpoint'
    full = getattr(e, 'errno', None) == errno.ENOSPC or 'No space left' in str(e)
    message = (f'could not write checkpoint {path}: {type(e).__name__}: {e}'
               f'{" (the disk is full)" if full else ""}; '
               f'the run stopped at step {step}. Rerun the same command to resume from '
               f'{resume} (metric rows after it are recomputed).')
    if isinstance(e, OSError):
      raise OSError(e.errno, message) from e
    raise RuntimeError(message) from e


SIZES = 'sizes.treecredit.json'  # beside orbax's items in each step directory


def _record_sizes(step_dir: str) -> None:
  """Writes the size of every file of a finished checkpoint (`SIZES`), so a later restore can
  tell a file cut short on disk (which orbax may read without an error) for the cost of a
  stat per file."""
  sizes = {}
  for root, _, files in os.walk(step_dir):
    for f in files:
      path = os.path.join(root, f)
      sizes[os.path.relpath(path, step_dir)] = os.path.getsize(path)
  tmp = os.path.join(step_dir, SIZES + '.tmp')
  with open(tmp, 'w') as f:
    json.dump(sizes, f)
  os.replace(tmp, os.path.join(step_dir, SIZES))


def _check_sizes(step_dir: str) -> None:
  """Raises ValueError naming the first file of the checkpoint whose size is not the one
  written (checkpoints without `SIZES`, written before it, are not checked)."""
  path = os.path.join(step_dir, SIZES)
  if not os.path.exists(path):
    return
  with open(path) as f:
    sizes = json.load(f)
  for rel, size in sorted(sizes.items()):
    full = os.path.join(step_dir, rel)
    if os.path.exists(full) and os.path.getsize(full) != size:  # another host's: not here
      raise ValueError(f'{rel} is {os.path.getsize(full)} bytes, {size} when it was written '
                       f'(cut short or overwritten on disk)')


def _set_aside(mngr, step: int) -> str:
  """Renames the checkpoint directory of `step` to `<step>.corrupt` (`.corrupt.<n>` if taken),
  which orbax does not list; nothing is deleted. Returns the new path."""
  src = os.path.join(str(mngr.directory), str(step))
  dst, n = src + '.corrupt', 1
  while os.path.exists(dst):
    dst, n = f'{src}.corrupt.{n}', n + 1
  os.rename(src, dst)
  return dst


def restore_checkpoint(mngr, template: ts.TrainState, fp: str, flat_cfg: dict, aux=None):
  """(state, meta) from the newest intact checkpoint, or (None, None) if there is none;
  refuses another config's. With `aux` templates ({name: pytree or TrainState or None}, as
  `save_checkpoint` takes them: shapes and dtypes) it returns (state, meta, aux), each entry
  from the checkpoint or, if there is none, the template itself (None stays None).

  A checkpoint that cannot be read (truncated or garbled files, a missing item, a file whose
  size is not the one recorded when it was written: `_check_sizes`) is set aside
  as `<step>.corrupt` with a warning naming it, and the one before it is tried: the run
  resumes exactly from the newest intact step (metric rows after it are recomputed), or
  starts over if none is intact (a run is a function of (config, step)).
  """
  bad = []
  state = meta = None
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      _check_sizes(os.path.join(str(mngr.directory), str(step)))
      meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
      if not isinstance(meta, dict):
        raise ValueError(f'its meta item is {type(meta).__name__}, not a JSON object')
    except Exception as e:  # noqa: BLE001 (any unreadable checkpoint is set aside)
      bad.append((step, e))
      meta = None
      continue
    if meta.get('fingerprint') != fp:
      old = meta.get('config', {})
      diff = sorted(k for k in set(old) | set(flat_cfg) if old.get(k) != flat_cfg.get(k))
      details = ', '.join(f'{k}: {old.get(k)!r} -> {flat_cfg.get(k)!r}' for k in diff[:10])
      raise ValueError(
          f'incompatible checkpoint in {mngr.directory}: it was written with a different config '
          f'(fingerprint {meta.get("fingerprint")} != {fp}; differences: {details}). '
          'Use another --workdir or delete the checkpoints to start over.')
    # Restored with the template's shardings (whatever mesh or process count wrote it).
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            ts.to_global(_state_tree(template, aux)))
    try:
      tree = mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract)))['state']
    except Exception as e:  # noqa: BLE001
      bad.append((step, e))
      meta = None
      continue
    state = template.replace(params=tree['params'], opt_state=tree['opt_state'],
                             step=tree['step'], rng=tree['rng'])
    restored_aux = {name: (None if value is None else value.replace(**tree[name])
                           if isinstance(value, ts.TrainState) else tree[name])
                    for name, value in (aux or {}).items()}
    break
  if bad:
    good = ('starting over (no intact checkpoint)' if state is None
            else f'resuming from step {step}')
    if jax.process_index() == 0:  # one process renames (and says so)
      for s, e in bad:
        where = os.path.join(str(mngr.directory), str(s))
        aside = _set_aside(mngr, s)
        warnings.warn(f'corrupt checkpoint {where} ({type(e).__name__}: {str(e)[:300]}); set '
                      f'aside as {aside}, {good}', RuntimeWarning, stacklevel=2)
    if jax.process_count() > 1:  # every process sees the renamed directory before going on
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices('treecredit_checkpoint_set_aside')
    mngr.reload()
  if aux is None:
    return state, meta
  return state, meta, (restored_aux if state is not None else dict(aux))
