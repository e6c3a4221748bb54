"""Host memory of loading a ~1B-parameter bf16 HF checkpoint onto an 8-device fsdp mesh.

    python -m experiments.bench_load [--layers 18] [--skip_old]

Writes a random Llama-shaped checkpoint (d 2048, ffn 5632, vocab 32000, untied; 18
layers = 1.06B params) with `save_hf_dir(dtype='bfloat16', shard_size=1 GiB)` under
/tmp, then in fresh subprocesses with 8 host CPU devices loads it (a) with
`sharded_load.load_hf_dir_sharded` and (b) the old path, `hf_loader.load_hf_dir`
then `device_put` with the training step's shardings, and reports per path: the
file size, the peak RSS above the RSS before loading (VmHWM; and, sampled every
few ms, its anonymous and file-backed parts), the bytes each device holds
(`addressable_shards`) and the peak minus what the devices hold at the end. The
checkpoint is deleted at the end.

What the CPU numbers mean: host "devices" live in host memory, so the device bytes
(float32: 2x the bf16 file) are part of the RSS; "peak - devices" is what loading
costs on top of the placed model, i.e. the host memory an accelerator host would
need. File-backed RSS is safetensors' memory map (page cache the kernel may reclaim).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

GiB = 1 << 30


def _status() -> dict:
  out = {}
  with open('/proc/self/status') as f:
    for line in f:
      k, _, v = line.partition(':')
      if k in ('VmRSS', 'VmHWM', 'RssAnon', 'RssFile'):
        out[k] = int(v.split()[0]) * 1024
  return out


class Sampler:
  """Peaks of RssAnon / RssFile / VmRSS, sampled every `dt` seconds in a thread."""

  def __init__(self, dt=0.002):
    self.dt, self.peak, self._stop = dt, {}, threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      for k, v in _status().items():
        self.peak[k] = max(self.peak.get(k, 0), v)
      time.sleep(self.dt)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def write_checkpoint(path, layers):
  import ml_dtypes
  import numpy as np
  import jax
  from experiments.models import decoder, hf_loader
  cfg = decoder.PolicyConfig(vocab_size=32000, d_model=2048, num_layers=layers, num_heads=16,
                             num_kv_heads=16, d_ff=5632, max_len=2048)
  shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), cfg))
  rng = np.random.default_rng(0)
  params = jax.tree.map(
      lambda s: (0.02 * rng.standard_normal(s.shape, np.float32)).astype(ml_dtypes.bfloat16),
      shapes)
  n = sum(x.size for x in jax.tree.leaves(params))
  hf_loader.save_hf_dir(path, params, cfg, dtype='bfloat16', shard_size=GiB)
  return n


def child(path, which):
  import jax
  from experiments.training import train_step as ts
  mesh = ts.make_mesh(fsdp=8)
  assert jax.device_count() == 8, jax.devices()
  from experiments.models import hf_loader, sharded_load  # noqa: F401 (imports before `before`)
  before = _status()
  t0 = time.time()
  with Sampler() as s:
    if which == 'sharded':
      params, cfg, _ = sharded_load.load_hf_dir_sharded(path, mesh, max_len=2048)
    else:
      host, cfg, _ = hf_loader.load_hf_dir(path, max_len=2048)
      params = jax.device_put(host, ts.param_sharding(host, mesh))
      jax.block_until_ready(params)
      del host
    jax.block_until_ready(params)
  seconds = time.time() - t0
  after = _status()
  per_device = {}
  for x in jax.tree.leaves(params):
    for sh in x.addressable_shards:
      per_device[str(sh.device)] = per_device.get(str(sh.device), 0) + sh.data.nbytes
  replicated = sum(x.nbytes for x in jax.tree.leaves(params) if x.sharding.is_fully_replicated)
  print('RESULT ' + json.dumps(dict(
      which=which, seconds=seconds, rss_before=before['VmRSS'], hwm=after['VmHWM'],
      rss_after=after['VmRSS'], peak_anon=s.peak.get('RssAnon', 0),
      peak_file=s.peak.get('RssFile', 0), anon_before=before['RssAnon'],
      file_before=before['RssFile'], per_device=per_device,
      total_param_bytes=sum(x.nbytes for x in jax.tree.leaves(params)),
      replicated_bytes=replicated, dtypes=sorted({str(x.dtype) for x in jax.tree.leaves(params)}))))


def run_child(path, which):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-m', 'experiments.bench_load', '--child', which, path],
                        env=env, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f'{which} child failed:\n{proc.stdout}\n{proc.stderr}')
  line = next(l for l in proc.stdout.splitlines() if l.startswith('RESULT '))
  return json.loads(line[len('RESULT '):])


def report(r, file_bytes):
  dev = sum(r['per_device'].values())
  peak = r['hwm'] - r['rss_before']
  g = lambda b: f'{b / GiB:.2f} GiB'
  x = lambda b: f'{b / file_bytes:.2f}x file'
  per = sorted(set(r['per_device'].values()))
  return '\n'.join([
      f"[{r['which']}] {r['seconds']:.1f} s, params {r['dtypes']}",
      f"  peak RSS - RSS before (VmHWM): {g(peak)} = {x(peak)}",
      f"  devices hold at the end:       {g(dev)} = {x(dev)} "
      f"(each of {len(r['per_device'])}: {', '.join(g(p) for p in per)}; replicated leaves "
      f"{r['replicated_bytes'] / 2**20:.2f} MiB)",
      f"  peak - devices:                {g(peak - dev)} = {x(peak - dev)}",
      f"  sampled peak anon - before:    {g(r['peak_anon'] - r['anon_before'])}; "
      f"minus devices {g(r['peak_anon'] - r['anon_before'] - dev)} = "
      f"{x(r['peak_anon'] - r['anon_before'] - dev)}",
      f"  sampled peak file-backed (mmap page cache) - before: "
      f"{g(r['peak_file'] - r['file_before'])}",
  ])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--child', nargs=2, metavar=('WHICH', 'PATH'))
  ap.add_argument('--layers', type=int, default=18)
  ap.add_argument('--skip_old', action='store_true')
  ap.add_argument('--dir', default=tempfile.gettempdir())
  args = ap.parse_args()
  if args.child:
    return child(args.child[1], args.child[0])
  free = shutil.disk_usage(args.dir).free
  need = 2 * 2 * args.layers * 52e6 + 2 * 131e6
  if free < 1.5 * need:
    raise SystemExit(f'{args.dir}: {free / GiB:.1f} GiB free, need ~{need / GiB:.1f} GiB')
  path = tempfile.mkdtemp(prefix='bench_load_', dir=args.dir)
  try:
    t0 = time.time()
    n = write_checkpoint(path, args.layers)
    files = sorted(f for f in os.listdir(path) if f.endswith('.safetensors'))
    file_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    print(f'checkpoint: {n / 1e9:.3f}B params, bf16, {len(files)} files, '
          f'{file_bytes / GiB:.2f} GiB ({time.time() - t0:.0f} s to write); '
          f'1.3x file = {1.3 * file_bytes / GiB:.2f} GiB')
    results = [run_child(path, 'sharded')]
    print(report(results[0], file_bytes), flush=True)
    if not args.skip_old:
      results.append(run_child(path, 'old'))
      print(report(results[1], file_bytes), flush=True)
    print('JSON ' + json.dumps(dict(params=n, file_bytes=file_bytes, results=results)))
  finally:
    shutil.rmtree(path, ignore_errors=True)


if __name__ == '__main__':
  main()
