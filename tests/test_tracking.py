"""Metric sinks (experiments/training/tracking.py) read back from disk, and the comparison's
plots, summary.json and table written as each run finishes (compare.run_experiment)."""

import glob
import json
import os
import re
import struct
import sys
import time
import zlib

import ml_collections
import pytest

from configs import tempo as tempo_config
from experiments.training import loop, tracking

ROWS = [dict(step=0, wall_s=0.0, method='grpo:iid', seed=0, greedy_acc=0.25, **{'pass@4': 0.5}),
        dict(step=1, wall_s=1.5, reward=0.125, loss=-0.3, done=True, tag='x',
             **{'credit_state/ema': 0.1}),
        dict(step=2, wall_s=3.0, reward=0.375, loss=float('nan'), greedy_acc=0.5)]
NUMERIC = {r['step']: {k: v for k, v in r.items() if k not in ('step', 'method', 'tag')}
           for r in ROWS}  # bools as 0/1


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
  """W&B with no network and nothing under $HOME."""
  for var, value in (('WANDB_SILENT', 'true'), ('WANDB_MODE', 'offline'),
                     ('WANDB_DIR', tmp_path / 'wandb_dir'),
                     ('WANDB_CONFIG_DIR', tmp_path / 'wandb_config'),
                     ('WANDB_CACHE_DIR', tmp_path / 'wandb_cache'),
                     ('WANDB_DATA_DIR', tmp_path / 'wandb_data')):
    monkeypatch.setenv(var, str(value))


def log_cfg(sinks: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(log=dict(sinks=sinks, wandb_project='test',
                                                 wandb_mode='offline')))


def write_rows(cfg, path, rows=ROWS, **kw):
  sinks = tracking.open_sinks(cfg, str(path), None, name='grpo:iid/seed0', **kw)
  for r in rows:
    sinks.write(r)
  sinks.close()
  return sinks


def test_sink_names_checked_and_jsonl_always_on():
  assert tracking.parse_sinks('jsonl') == ('jsonl',)
  assert tracking.parse_sinks(' wandb, tensorboard,wandb ') == ('jsonl', 'wandb', 'tensorboard')
  assert tracking.check(ml_collections.ConfigDict(dict(x=1))) == ('jsonl',)  # no log section
  with pytest.raises(ValueError, match="'tensorbord'.*valid: jsonl, tensorboard, wandb"):
    tracking.parse_sinks('jsonl,tensorbord')
  cfg = log_cfg('wandb')
  cfg.log.wandb_mode = 'offlne'
  with pytest.raises(ValueError, match="'offlne'; valid: offline, online, disabled"):
    tracking.check(cfg)


def test_missing_package_names_it_and_the_extra(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorboardX', None)  # import fails
  with pytest.raises(ImportError, match=r"'tensorboardX'.*pip install -e \"\.\[tracking\]\""):
    tracking.check(log_cfg('tensorboard'))
  with pytest.raises(ImportError, match=r"'tensorboardX'.*\.\[tracking\]"):
    tracking.TensorBoardSink(str(tmp_path))


def test_jsonl_rows_read_back_exactly(tmp_path):
  sinks = write_rows(log_cfg(''), tmp_path / 'metrics.jsonl')
  assert [type(s).__name__ for s in sinks.sinks] == ['MetricsWriter']
  back = loop.read_metrics(tmp_path / 'metrics.jsonl')
  assert json.dumps(back) == json.dumps(ROWS)  # nan included
  assert not os.path.exists(tmp_path / 'tensorboard') and not os.path.exists(tmp_path / 'wandb')


def tfrecords(path):
  """The records of a TFRecord file: [len u64][masked crc32c of len][data][masked crc32c]."""
  from tensorboardX.record_writer import masked_crc32c
  data, pos, out = open(path, 'rb').read(), 0, []
  while pos < len(data):
    header = data[pos:pos + 8]
    (n,), (crc,) = struct.unpack('<Q', header), struct.unpack('<I', data[pos + 8:pos + 12])
    assert crc == masked_crc32c(header)
    body = data[pos + 12:pos + 12 + n]
    assert struct.unpack('<I', data[pos + 12 + n:pos + 16 + n])[0] == masked_crc32c(body)
    out.append(body)
    pos += 16 + n
  return out


def tensorboard_scalars(logdir) -> dict:
  """{step: {tag: value}} of every event file under logdir (tensorboardX's protobufs)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in sorted(glob.glob(os.path.join(logdir, 'events.out.tfevents.*'))):
    for raw in tfrecords(path):
      event = event_pb2.Event.FromString(raw)
      for v in event.summary.value:
        out.setdefault(event.step, {})[v.tag] = v.simple_value
  return out


def test_tensorboard_scalars_read_back(tmp_path):
  write_rows(log_cfg('tensorboard'), tmp_path / 'metrics.jsonl')
  assert json.dumps(loop.read_metrics(tmp_path / 'metrics.jsonl')) == json.dumps(ROWS)
  back = tensorboard_scalars(tmp_path / 'tensorboard')
  assert set(back) == set(NUMERIC)
  tag = lambda k: re.sub(r'[^-/\w.]', '_', k)  # tensorboardX's legal tags: 'pass@4' -> 'pass_4'
  for step, fields in NUMERIC.items():  # simple_value is a float32
    assert back[step] == pytest.approx({tag(k): float(v) for k, v in fields.items()}, rel=1e-7,
                                       nan_ok=True), step


def wandb_records(path):
  """The records of a .wandb file: a 7-byte header (':W&B', magic, version), then 32 KiB
  blocks of chunks [crc32 of type + data: u32][length: u16][type: u8][data] (types 1 full,
  2 first, 3 middle, 4 last), each record a `wandb_internal_pb2.Record`. W&B ships no public
  reader of it (its own lives in the Go core): this follows the format and uses W&B's
  generated protobufs (`wandb.proto`, an internal module)."""
  from wandb.proto import wandb_internal_pb2
  data = open(path, 'rb').read()
  assert data[:4] == b':W&B'
  pos, buf, out = 7, b'', []
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header: padding
      pos += 32768 - pos % 32768
      continue
    crc, n, kind = struct.unpack('<IHB', data[pos:pos + 7])
    if pos + 7 + n > len(data):  # a chunk still being written
      break
    chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
    assert zlib.crc32(bytes([kind]) + chunk) == crc
    buf += chunk
    if kind in (1, 4):
      out.append(wandb_internal_pb2.Record.FromString(buf))
      buf = b''
  return out


def finished_records(path, timeout=60.0):
  """The records once the run's exit record is on disk: `finish` returns before W&B's core
  process has written everything (a loaded CI host once read a file with no records yet)."""
  deadline = time.monotonic() + timeout
  while True:
    records = wandb_records(path)
    if any(r.WhichOneof('record_type') == 'exit' for r in records) or time.monotonic() > deadline:
      return records
    time.sleep(0.1)


def test_wandb_offline_run_read_back(tmp_path, offline_wandb):
  t0 = time.perf_counter()
  write_rows(log_cfg('wandb'), tmp_path / 'metrics.jsonl', group='grpo:iid',
             config={'optimizer.lr': 3e-4})
  wall = time.perf_counter() - t0
  print(f'W&B offline: init + {len(ROWS)} rows + finish {wall:.2f} s')
  runs = glob.glob(str(tmp_path / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
  assert len(runs) == 1, runs
  records = finished_records(runs[0])
  run, = [r.run for r in records if r.WhichOneof('record_type') == 'run']
  assert (run.project, run.display_name, run.run_group) == ('test', 'grpo:iid/seed0', 'grpo:iid')
  assert {u.key: json.loads(u.value_json) for u in run.config.update}['optimizer.lr'] == 3e-4
  back = {}
  for r in records:
    if r.WhichOneof('record_type') == 'history':
      items = {'/'.join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
      back[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith('_')}
  assert set(back) == set(NUMERIC)
  for step, fields in NUMERIC.items():  # JSON: the float64 values exactly
    assert back[step] == pytest.approx({k: float(v) for k, v in fields.items()}, rel=0,
                                       abs=0, nan_ok=True), step
  assert any(r.WhichOneof('record_type') == 'exit' for r in records)  # finished


def test_all_sinks_from_one_config(tmp_path, offline_wandb):
  sinks = write_rows(log_cfg('jsonl,tensorboard,wandb'), tmp_path / 'metrics.jsonl',
                     rows=ROWS[:2])
  assert [type(s).__name__ for s in sinks.sinks] == ['MetricsWriter', 'TensorBoardSink',
                                                      'WandbSink']
  assert [r['step'] for r in loop.read_metrics(tmp_path / 'metrics.jsonl')] == [0, 1]
  assert set(tensorboard_scalars(tmp_path / 'tensorboard')) == {0, 1}
  assert glob.glob(str(tmp_path / 'wandb' / 'offline-run-*' / 'run-*.wandb'))


def test_resumed_tensorboard_purges_from_the_restored_step(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  write_rows(log_cfg('tensorboard'), path)
  sinks = tracking.open_sinks(log_cfg('tensorboard'), str(path), 1, name='r')
  assert [r['step'] for r in sinks.rows] == [0, 1]  # the JSONL rows kept
  sinks.write(dict(step=2, reward=0.75))
  sinks.close()
  first, second = sorted(glob.glob(str(tmp_path / 'tensorboard' / 'events.out.tfevents.*')))
  from tensorboardX.proto import event_pb2
  starts = [e.step for e in map(event_pb2.Event.FromString, tfrecords(second))
            if e.HasField('session_log')]
  assert starts == [2]  # TensorBoard drops the first file's events from step 2 on


# ---------------------------------------------------------------------------------------
# The comparison reports as runs finish.


def fake_run(d, rows, pass_k: int) -> dict:
  """A stand-in for `loop.train`: writes `rows` as d/metrics.jsonl, returns their summary."""
  os.makedirs(d)
  with open(os.path.join(d, 'metrics.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  return dict(loop.summarize(rows, pass_k), sampled_tokens_per_s=1.0, train_tokens_per_s=1.0,
              credit_frac=0.0)


def fake_sft(pass_k: int):
  """A stand-in for `loop.sft`: no params, a zero warm-start row."""
  return lambda c, d: (None, dict(greedy_acc=0.0, wall_s=0.0, **{f'pass@{pass_k}': 0.0}))


def quick_cfg():
  cfg = tempo_config.shrink(tempo_config.get_config())
  cfg.quick, cfg.progress = False, False
  cfg.task.name, cfg.task.kwargs = 'addition', {'num_digits': 3}
  return cfg


def test_comparison_writes_plots_summary_and_table_as_runs_finish(tmp_path, monkeypatch,
                                                                  capsys):
  """2 methods x 2 lrs (one seed) with stand-ins for loop.sft / loop.train: before each run,
  summary.json and the plots hold exactly the runs finished so far."""
  from experiments.training import compare
  cfg = quick_cfg()
  cfg.seeds, cfg.methods, cfg.lr_grid = (0,), 'grpo:iid,tempo:iid', (1e-4, 3e-4)
  acc = {('grpo:iid', 1e-4): 0.2, ('grpo:iid', 3e-4): 0.4, ('tempo:iid', 1e-4): 0.5,
         ('tempo:iid', 3e-4): 0.3}
  seen = []

  def fake_train(c, d, params, method, seed):
    written = [tmp_path / f for f in ('summary.json', 'curves_vs_step.png', 'curves_vs_wall.png',
                                      'curves_vs_generated_tokens.png')]
    assert all(f.exists() == bool(seen) for f in written)  # removed below after each run
    if seen:  # the previous runs are reported before this one starts
      saved = json.load(open(written[0]))
      assert saved['partial'] == dict(runs_done=len(seen), runs_total=4)
      assert set(saved['methods']) == {m for m, _ in seen}
      assert {(m, float(lr)) for m, runs in saved['lr_grid']['runs'].items()
              for lr in runs} == set(seen)
      assert f'After {len(seen)} of 4 runs' in capsys.readouterr().out
      for f in written:
        f.unlink()
    seen.append((method, c.optimizer.lr))
    return fake_run(d, [dict(step=0, wall_s=0.0, greedy_acc=0.0),
                        dict(step=2, wall_s=1.0, generated_tokens_total=100.0,
                             greedy_acc=acc[method, c.optimizer.lr])], cfg.eval.pass_k)

  monkeypatch.setattr(loop, 'sft', fake_sft(cfg.eval.pass_k))
  monkeypatch.setattr(loop, 'train', fake_train)
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert len(seen) == 4
  out = capsys.readouterr().out
  assert 'After 4 of 4' not in out and out.count('Learning-rate grid') == 1  # the final table
  saved = json.load(open(tmp_path / 'summary.json'))
  assert 'partial' not in saved and 'partial' not in summary
  assert saved['lr_grid']['best'] == {'grpo:iid': 3e-4, 'tempo:iid': 1e-4}
  assert json.dumps(saved, sort_keys=True) == json.dumps(summary, sort_keys=True)
