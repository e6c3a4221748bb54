"""Wall-clock saving of `sample_tree_fixed` against `sample_iid` at equal G, vs the ideal.

Run: python -m experiments.bench_sampling [--batches 64,256] [--repeats 11]

Both samplers produce G = prod(branching) responses of L = response_len tokens
per prompt on the toy policy (`decoder.PolicyConfig` defaults, random params,
max_len = P + L as in `loop.policy_config`), with no EOS so that every row
decodes to L and the step counts below are exact.

Definitions
  * row-step: one row (response in flight) decoded by one position (one
    1-token `decode_step` of one row).
  * iid row-steps = G * L per prompt.
  * tree row-steps = sum over levels l of (#nodes at level l) * (tokens level l
    decodes) = sum_l prod(branching[:l+1]) * seg_l, seg_l = segment_len except
    the last level's L - (K - 1) * segment_len. (Copied prefixes cost nothing.)
  * ideal saving = 1 - tree row-steps / iid row-steps (the saving if wall-clock
    were proportional to row-steps; prefill, identical in both, is ignored).
  * measured saving = 1 - median over repeats of t_tree / t_iid, t the jitted
    sampler's wall-clock (compiled beforehand). Each repeat times iid and tree
    back to back (order alternating between repeats), so the ratio of a pair
    sees one machine load; the t columns are medians of the times.
  * ratio = measured / ideal. "Within 15 % of the ideal" reads ratio >= 0.85.
  * Control: `sample_iid` runs as two jitted stages (start, decode); the
    "iid1" columns time the same computation as one jitted program
    (`_iid_one_program`, outputs checked equal), i.e. against an i.i.d.
    baseline without any stage-boundary overhead.
"""

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.rollouts import sampling
from experiments.models import decoder


def row_steps(branching, segment_len, length):
  """(tree, iid) row-steps per prompt."""
  k = len(branching)
  segs = [segment_len] * (k - 1) + [length - (k - 1) * segment_len]
  tree = sum(math.prod(branching[:l + 1]) * s for l, s in enumerate(segs))
  return tree, math.prod(branching) * length


@functools.partial(jax.jit, static_argnames=('cfg', 'num_samples', 'length'))
def _iid_one_program(params, key, prompts, *, cfg, num_samples, length):
  """`sample_iid` (eos_id None, pad 0, temperature 1) as a single jitted program."""
  b = prompts.shape[0]
  u = sampling.response_uniforms(key, jnp.arange(b), jnp.arange(num_samples), length)
  state = sampling.start(params, cfg, prompts, u)
  return sampling.to_samples(sampling.decode(params, cfg, state, length), b)


def bench(batch, branching=(2, 2, 2), segment_len=8, length=24, prompt_len=8, repeats=11,
          vocab_size=14, seed=0):
  """Times iid, iid1 and tree for `batch` prompts -> dict of savings, ratios, times."""
  cfg = decoder.PolicyConfig(vocab_size=vocab_size, max_len=prompt_len + length)
  params = decoder.init_params(jax.random.PRNGKey(seed), cfg)
  prompts = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, prompt_len), 0, vocab_size)
  g = math.prod(branching)
  key = jax.random.PRNGKey(seed + 2)
  kw = dict(temperature=1.0, eos_id=None, pad_id=0)
  iid = lambda: sampling.sample_iid(params, cfg, key, prompts, g, length, **kw)
  tree = lambda: sampling.sample_tree_fixed(params, cfg, key, prompts, branching, segment_len,
                                            length, **kw)
  iid1 = lambda: _iid_one_program(params, key, prompts, cfg=cfg, num_samples=g, length=length)
  fns = (('iid', iid), ('iid1', iid1), ('tree', tree))
  for _, fn in fns:  # Compile and warm up.
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
  np.testing.assert_array_equal(iid().tokens, iid1().tokens)
  times = {name: [] for name, _ in fns}
  for i in range(repeats):
    for name, fn in fns[::1 if i % 2 else -1]:
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
  t = {name: np.median(ts) for name, ts in times.items()}
  tree_steps, iid_steps = row_steps(branching, segment_len, length)
  ideal = 1 - tree_steps / iid_steps
  tree = np.array(times['tree'])
  measured = 1 - np.median(tree / np.array(times['iid']))
  measured1 = 1 - np.median(tree / np.array(times['iid1']))
  return dict(ideal=ideal, measured=measured, ratio=measured / ideal, measured1=measured1,
              ratio1=measured1 / ideal, t_iid=t['iid'], t_iid1=t['iid1'], t_tree=t['tree'])


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--batches', default='64,256')
  ap.add_argument('--branching', default='2,2,2')
  ap.add_argument('--segment_len', type=int, default=8)
  ap.add_argument('--length', type=int, default=24)
  ap.add_argument('--prompt_len', type=int, default=8)
  ap.add_argument('--repeats', type=int, default=11)
  a = ap.parse_args()
  branching = tuple(int(x) for x in a.branching.split(','))
  print(f'branching={branching} segment_len={a.segment_len} L={a.length} P={a.prompt_len} '
        f'G={math.prod(branching)} repeats={a.repeats} backend={jax.default_backend()}')
  print(f'{"B":>5} {"t_iid ms":>9} {"t_tree ms":>9} {"ideal":>7} {"measured":>8} {"ratio":>6}'
        f' | {"t_iid1 ms":>9} {"measured1":>9} {"ratio1":>6}')
  for b in (int(x) for x in a.batches.split(',')):
    r = bench(b, branching, a.segment_len, a.length, a.prompt_len, a.repeats)
    print(f'{b:>5} {1e3 * r["t_iid"]:>9.1f} {1e3 * r["t_tree"]:>9.1f} {r["ideal"]:>7.1%} '
          f'{r["measured"]:>8.1%} {r["ratio"]:>6.2f} | {1e3 * r["t_iid1"]:>9.1f} '
          f'{r["measured1"]:>9.1%} {r["ratio1"]:>6.2f}', flush=True)


if __name__ == '__main__':
  main()
