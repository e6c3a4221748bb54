"""Sampling and training throughput of the real model on this machine, against transformers.

    python -m experiments.bench_lm [--batch=64] [--prompt_len=32] [--new_tokens=64]

Ours: the jitted i.i.d. sampler (`sampling.sample_iid`, temperature 1, no stop
token, so every row generates exactly new_tokens) on SmolLM2-135M-Instruct in
float32, then the update step (`train_step`, Adam, remat) on `--train_rows`
responses twice: full fine-tuning, and LoRA (rank `--lora_rank` on every
projection, `make_optimizer(lora_only=True)`: only the adapters are differentiated),
each with the update's peak device memory (XLA's memory analysis of the compiled
step: arguments + temporaries + outputs - donated) and the LoRA / full ratios. Reference, in the same run when torch and transformers
are installed (they are not dependencies; `pip install torch transformers`):
`model.generate` on CPU at the same batch and lengths (experiments/hf_reference.py),
in a subprocess so that each side's peak resident memory is its own. Prints one
table with ours / transformers ratios; absolute numbers depend on the machine.
"""

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.rollouts import sampling
from experiments.training import train_step as ts
from experiments.models import decoder, pretrained


def parse(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--batch', type=int, default=64, help='sampled rows')
  p.add_argument('--prompt_len', type=int, default=32, help='prompt tokens per row')
  p.add_argument('--new_tokens', type=int, default=64, help='generated tokens per row')
  p.add_argument('--train_rows', type=int, default=16, help='rows in the timed update step')
  p.add_argument('--lora_rank', type=int, default=8, help='LoRA rank of the second update step')
  p.add_argument('--repeats', type=int, default=2,
                 help='timed repeats after the compiling call (best is kept)')
  p.add_argument('--threads', type=int, default=2, help='torch threads for the transformers run')
  p.add_argument('--no_hf', action='store_true',
                 help='skip timing transformers generate (needs torch + transformers)')
  p.add_argument('--part', default='all', choices=('all', 'hf'),
                 help="internal: 'hf' is the transformers subprocess")
  return p.parse_args(argv)


def peak_rss_gb() -> float:
  """This process's peak resident memory (VmHWM; ru_maxrss would carry over across exec)."""
  try:
    with open('/proc/self/status') as f:
      kb = next(int(l.split()[1]) for l in f if l.startswith('VmHWM:'))
  except (OSError, StopIteration):
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return kb / 2**20


def best_time(fn, repeats):
  jax.block_until_ready(fn(0))  # compile
  times = []
  for r in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(r + 1))
    times.append(time.perf_counter() - t)
  return min(times)


def ours(batch, prompt_len, new_tokens, train_rows, repeats, lora_rank) -> dict:
  lm = pretrained.load('smollm2', max_len=prompt_len + new_tokens, remat=True)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(100, lm.cfg.vocab_size, (batch, prompt_len)), jnp.int32)
  sample = lambda r: sampling.sample_iid(lm.params, lm.cfg, jax.random.PRNGKey(r), prompts, 1,
                                         new_tokens, eos_id=None).tokens
  t_sample = best_time(sample, repeats)
  s = sampling.sample_iid(lm.params, lm.cfg, jax.random.PRNGKey(0), prompts[:train_rows], 1,
                          new_tokens, eos_id=None)
  batch_ = ts.Batch(prompts=prompts[:train_rows], tokens=s.tokens[:, 0], mask=s.mask[:, 0],
                    advantages=jnp.asarray(rng.standard_normal((train_rows, 1)) *
                                           np.ones((1, new_tokens)), jnp.float32),
                    old_logprobs=s.logprobs[:, 0])
  loss_cfg = ts.LossConfig(num_minibatches=1, num_microbatches=2)
  out = dict(sample_tokens_per_s=batch * new_tokens / t_sample, sample_s=t_sample)
  for name, cfg, params, tx in (
      ('full', lm.cfg, lm.params, ts.make_optimizer(1e-6)),
      ('lora', dataclasses.replace(lm.cfg, lora_rank=lora_rank, lora_alpha=2.0 * lora_rank),
       None, ts.make_optimizer(1e-6, lora_only=True))):
    if params is None:
      params = decoder.add_lora(jax.random.PRNGKey(1), lm.params, cfg)
    # A copy: the update step donates its state, and lm.params is shared (pretrained.load cache).
    holder = {'state': ts.init_state(jax.tree.map(jnp.copy, params), tx)}
    mem = ts.train_step_jit.lower(holder['state'], batch_, cfg=cfg,
                                  loss_cfg=loss_cfg).compile().memory_analysis()

    def update(r):
      holder['state'], m = ts.train_step_jit(holder['state'], batch_, cfg=cfg, loss_cfg=loss_cfg)
      return m['loss']

    t_train = best_time(update, repeats)
    out[f'{name}_train_tokens_per_s'] = train_rows * new_tokens / t_train
    out[f'{name}_train_s'] = t_train
    out[f'{name}_train_gb'] = (mem.argument_size_in_bytes + mem.temp_size_in_bytes +
                               mem.output_size_in_bytes - mem.alias_size_in_bytes) / 2**30
    del holder
  out['peak_rss_gb'] = peak_rss_gb()
  return out


def hf(batch, prompt_len, new_tokens, threads) -> dict:
  from experiments import hf_reference
  model, _ = hf_reference.load_smollm2_hf(threads=threads)
  out = hf_reference.hf_generate_throughput(model, batch, prompt_len, new_tokens)
  out['peak_rss_gb'] = peak_rss_gb()
  return out


def main(argv=None):
  f = parse(argv)
  if f.part == 'hf':
    print('JSON' + json.dumps(hf(f.batch, f.prompt_len, f.new_tokens, f.threads)))
    return
  rows = {'ours (jax sampler)': ours(f.batch, f.prompt_len, f.new_tokens, f.train_rows, f.repeats,
                                     f.lora_rank)}
  if not f.no_hf:
    proc = subprocess.run([sys.executable, '-m', 'experiments.bench_lm', '--part=hf',
                           f'--batch={f.batch}', f'--prompt_len={f.prompt_len}',
                           f'--new_tokens={f.new_tokens}', f'--threads={f.threads}'],
                          capture_output=True, text=True)
    line = [l for l in proc.stdout.splitlines() if l.startswith('JSON')]
    if line:
      h = json.loads(line[0][4:])
      rows['transformers generate'] = dict(sample_tokens_per_s=h['tokens_per_s'],
                                           sample_s=h['seconds'], peak_rss_gb=h['peak_rss_gb'])
    else:
      print('transformers run failed (torch/transformers installed?):\n' + proc.stderr[-2000:])
  print(f'SmolLM2-135M-Instruct f32, batch {f.batch}, prompt {f.prompt_len}, '
        f'{f.new_tokens} new tokens, {jax.devices()[0].platform}')
  print(f'{"":>24} {"sampled tok/s":>14} {"peak RSS GB":>12}')
  for name, r in rows.items():
    print(f'{name:>24} {r["sample_tokens_per_s"]:>14.1f} {r["peak_rss_gb"]:>12.2f}')
  o = rows['ours (jax sampler)']
  print(f'update step, {f.train_rows} rows x {f.new_tokens} tokens (2 micro-batches):')
  print(f'{"":>24} {"train tok/s":>12} {"step s":>8} {"step GiB":>9}')
  for name in ('full', 'lora'):
    label = 'full fine-tuning' if name == 'full' else f'LoRA rank {f.lora_rank}'
    print(f'{label:>24} {o[name + "_train_tokens_per_s"]:>12.1f} {o[name + "_train_s"]:>8.2f} '
          f'{o[name + "_train_gb"]:>9.2f}')
  print(f'ratio LoRA / full: {o["lora_train_tokens_per_s"] / o["full_train_tokens_per_s"]:.2f}x '
        f'tokens/s, {o["lora_train_gb"] / o["full_train_gb"]:.2f}x memory')
  if len(rows) == 2:
    a, b = rows.values()
    print(f'ratio ours / transformers (sampling): {a["sample_tokens_per_s"] / b["sample_tokens_per_s"]:.2f}x')


if __name__ == '__main__':
  main()
