"""Sampling and training throughput of the real model on this machine, against transformers.

    python -m experiments.bench_lm [--batch=64] [--prompt_len=32] [--new_tokens=64]

Ours: the jitted i.i.d. sampler (`sampling.sample_iid`, temperature 1, no stop
token, so every row generates exactly new_tokens) on SmolLM2-135M-Instruct in
float32, then one full-fine-tuning update step (`train_step`, Adam, remat) on
`--train_rows` responses. Reference, in the same run when torch and transformers
are installed (they are not dependencies; `pip install torch transformers`):
`model.generate` on CPU at the same batch and lengths (experiments/hf_reference.py),
in a subprocess so that each side's peak resident memory is its own. Prints one
table with ours / transformers ratios; absolute numbers depend on the machine.
"""

import json
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.rollouts import sampling
from experiments.training import train_step as ts
from experiments.models import pretrained

FLAGS = flags.FLAGS
flags.DEFINE_integer('batch', 64, 'Sampled rows.')
flags.DEFINE_integer('prompt_len', 32, 'Prompt tokens per row.')
flags.DEFINE_integer('new_tokens', 64, 'Generated tokens per row.')
flags.DEFINE_integer('train_rows', 16, 'Rows in the timed update step.')
flags.DEFINE_integer('repeats', 2, 'Timed repeats after the compiling call (best is kept).')
flags.DEFINE_integer('threads', 2, 'torch threads for the transformers run.')
flags.DEFINE_bool('hf', True, 'Also time transformers generate (needs torch + transformers).')
flags.DEFINE_string('part', 'all', "'all', or 'hf' (internal: the transformers subprocess).")


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


def ours(batch, prompt_len, new_tokens, train_rows, repeats) -> dict:
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
  # A copy: the update step donates its state, and lm.params is shared (pretrained.load cache).
  state = ts.init_state(jax.tree.map(jnp.copy, lm.params), ts.make_optimizer(1e-6))
  loss_cfg = ts.LossConfig(num_minibatches=1, num_microbatches=2)
  holder = {'state': state}

  def update(r):
    holder['state'], m = ts.train_step_jit(holder['state'], batch_, cfg=lm.cfg, loss_cfg=loss_cfg)
    return m['loss']

  t_train = best_time(update, repeats)
  return dict(sample_tokens_per_s=batch * new_tokens / t_sample, sample_s=t_sample,
              train_tokens_per_s=train_rows * new_tokens / t_train, train_s=t_train,
              peak_rss_gb=peak_rss_gb())


def hf(batch, prompt_len, new_tokens, threads) -> dict:
  from experiments import hf_reference
  model, _ = hf_reference.load_smollm2_hf(threads=threads)
  out = hf_reference.hf_generate_throughput(model, batch, prompt_len, new_tokens)
  out['peak_rss_gb'] = peak_rss_gb()
  return out


def main(argv):
  del argv
  f = FLAGS
  if f.part == 'hf':
    print('JSON' + json.dumps(hf(f.batch, f.prompt_len, f.new_tokens, f.threads)))
    return
  rows = {'ours (jax sampler)': ours(f.batch, f.prompt_len, f.new_tokens, f.train_rows, f.repeats)}
  if f.hf:
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
  print(f'{"":>24} {"sampled tok/s":>14} {"train tok/s":>12} {"peak RSS GB":>12}')
  for name, r in rows.items():
    print(f'{name:>24} {r["sample_tokens_per_s"]:>14.1f} '
          f'{r.get("train_tokens_per_s", float("nan")):>12.1f} {r["peak_rss_gb"]:>12.2f}')
  if len(rows) == 2:
    a, b = rows.values()
    print(f'ratio ours / transformers (sampling): {a["sample_tokens_per_s"] / b["sample_tokens_per_s"]:.2f}x')


if __name__ == '__main__':
  app.run(main)
