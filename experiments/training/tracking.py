"""Metrics sinks: where a run's metric rows go, chosen by the config's `log` section.

    log.sinks = 'jsonl'          # comma-separated: jsonl, tensorboard, wandb
    log.wandb_project = 'treecredit'
    log.wandb_mode = 'offline'   # no network (`wandb sync` uploads later); 'online', 'disabled'

JSONL (<run>/metrics.jsonl, `metrics_io.MetricsWriter`) is always on, listed or not: it is
the record resume, summaries and plots read. TensorBoard writes <run>/tensorboard/ (one
scalar per numeric field at the row's step; `tensorboard --logdir=<workdir>`), W&B a run
under <run>/wandb/. Both are imported only when asked for (`pip install -e ".[tracking]"`).
"""

import importlib
import importlib.util
import numbers
import os
from typing import Optional, Protocol

from experiments.training.metrics_io import MetricsWriter

SINKS = ('jsonl', 'tensorboard', 'wandb')
PACKAGES = {'tensorboard': 'tensorboardX', 'wandb': 'wandb'}  # sink -> the package it imports
WANDB_MODES = ('offline', 'online', 'disabled')
DEFAULTS = dict(sinks='jsonl', wandb_project='treecredit', wandb_mode='offline')


class Sink(Protocol):
  """Takes one metric row (a dict with an int 'step') at a time."""

  def write(self, row: dict) -> None: ...

  def close(self) -> None: ...


def log_config(cfg) -> dict:
  """cfg's `log` section over `DEFAULTS` (a config without one: JSONL only)."""
  log = cfg.get('log', None) if hasattr(cfg, 'get') else None
  return {**DEFAULTS, **(dict(log) if log is not None else {})}


def parse_sinks(spec: str) -> tuple:
  """('jsonl', the others named in `spec` in order, once each); unknown names refused."""
  names = [s.strip() for s in str(spec).split(',') if s.strip()]
  for name in names:
    if name not in SINKS:
      raise ValueError(f'unknown log sink {name!r} in log.sinks={spec!r}; valid: '
                       f'{", ".join(SINKS)} (jsonl is always on)')
  return ('jsonl',) + tuple(dict.fromkeys(n for n in names if n != 'jsonl'))


def check(cfg) -> tuple:
  """The sinks cfg asks for, checked before any work: names, W&B mode, packages installed."""
  log = log_config(cfg)
  names = parse_sinks(log['sinks'])
  if 'wandb' in names and log['wandb_mode'] not in WANDB_MODES:
    raise ValueError(f'unknown log.wandb_mode {log["wandb_mode"]!r}; valid: '
                     f'{", ".join(WANDB_MODES)}')
  for name in names[1:]:
    if importlib.util.find_spec(PACKAGES[name]) is None:
      raise ImportError(_missing(name))
  return names


def _missing(name: str) -> str:
  return (f'log.sinks names {name!r}, which needs the package {PACKAGES[name]!r}, not '
          f'installed: pip install -e ".[tracking]" (or pip install {PACKAGES[name]})')


def _require(name: str):
  """The module of sink `name`, or an ImportError naming the package and the extra."""
  try:
    return importlib.import_module(PACKAGES[name])
  except ImportError as e:
    raise ImportError(_missing(name)) from e


def scalars(row: dict) -> dict:
  """{field: float} of the row's numeric fields (bools as 0/1), 'step' and the rest left out."""
  return {k: float(v) for k, v in row.items()
          if k != 'step' and isinstance(v, numbers.Real)}


class TensorBoardSink:
  """One scalar per numeric field at step = the row's 'step' (tags as tensorboardX cleans
  them: 'pass@8' -> 'pass_8'), flushed every row. On resume (`purge_step`: the first step
  written again) TensorBoard hides the earlier files' events from that step on; the file's
  name ends in that step, so a resume in the same second as the start writes another file."""

  def __init__(self, logdir: str, purge_step: Optional[int] = None):
    self.writer = _require('tensorboard').SummaryWriter(
        logdir=logdir, purge_step=purge_step, filename_suffix=f'.from{purge_step or 0:09d}')

  def write(self, row: dict) -> None:
    for k, v in scalars(row).items():
      self.writer.add_scalar(k, v, global_step=int(row['step']))
    self.writer.flush()

  def close(self) -> None:
    self.writer.close()


class WandbSink:
  """A W&B run under `workdir` (<workdir>/wandb/), its numeric fields logged at the row's
  step; finished on close. Offline mode needs no network (`wandb sync` uploads later)."""

  def __init__(self, workdir: str, project: str, mode: str, name: str,
               group: Optional[str] = None, config: Optional[dict] = None):
    os.makedirs(workdir, exist_ok=True)
    self.run = _require('wandb').init(project=project, name=name, group=group, mode=mode,
                                      dir=workdir, config=config, reinit='create_new')

  def write(self, row: dict) -> None:
    self.run.log(scalars(row), step=int(row['step']))

  def close(self) -> None:
    self.run.finish()


class Sinks:
  """Every chosen sink, JSONL first (a row reaches the others once it is on disk).
  `rows`: the JSONL writer's kept rows (up to the restored step on resume)."""

  def __init__(self, sinks):
    self.sinks = tuple(sinks)

  @property
  def rows(self) -> list:
    return self.sinks[0].rows

  def write(self, row: dict) -> None:
    for s in self.sinks:
      s.write(row)

  def close(self) -> None:
    for s in self.sinks:
      s.close()


def open_sinks(cfg, metrics_path: str, resume_step: Optional[int], name: str,
               group: Optional[str] = None, config: Optional[dict] = None) -> Sinks:
  """The sinks of cfg's `log` section for the run writing `metrics_path` (its directory
  holds tensorboard/ and wandb/): JSONL always, the others on the writing process only.
  `name`, `group`, `config`: the W&B run's."""
  names = check(cfg)
  jsonl = MetricsWriter(metrics_path, resume_step)
  if not jsonl.enabled:  # multi-host: process 0 alone logs
    return Sinks([jsonl])
  log, workdir = log_config(cfg), os.path.dirname(os.path.abspath(metrics_path))
  out = [jsonl]
  try:
    for n in names[1:]:
      out.append(TensorBoardSink(os.path.join(workdir, 'tensorboard'),
                                 None if resume_step is None else resume_step + 1)
                 if n == 'tensorboard' else
                 WandbSink(workdir, log['wandb_project'], log['wandb_mode'], name, group, config))
  except BaseException:
    Sinks(out).close()  # the sinks already opened
    raise
  return Sinks(out)
