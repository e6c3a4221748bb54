"""Wall-clock saving of `sample_tree_fixed` against `sample_iid` at equal G, vs the ideal;
(--case layouts) the i.i.d. sampler's cache layouts, 'cascade' against 'rows'; and
(--case tree_layouts) `sample_tree_fixed`'s, 'cascade' against 'cascade_tree'.

Run: python -m experiments.bench_sampling [--batches 64,256] [--repeats 11]
     python -m experiments.bench_sampling --case layouts [--models smollm2,toy]
         [--prompt_lens 512] [--groups 4,8,16] [--num_prompts 2] [--length 16] [--repeats 3]
     python -m experiments.bench_sampling --case tree_layouts [--models smollm2,toy]
         [--prompt_lens 512] [--branching 2,2,2] [--segment_len 32] [--length 96]

Layouts (issue 41; `sampling.LAYOUTS`): 'rows' repeats each prompt's KV cache for its G
responses (each decode step reads the prompt G times), 'cascade' keeps it once
(`decoder.cascade_attention`, Hydragen). Both samplers run with the same key, random
params, no EOS (every row decodes L tokens); their stages are timed apart (prefill
`_start`, decode `_decode`) after a first compiling call, each repeat running both layouts
back to back, order alternating. Printed: median stage times, sampled tokens/s of the
whole sampler (B * G * L / (prefill + decode)) and of the decode alone, the ratios
cascade / rows of both (> 1: cascade is faster; medians of per-repeat ratios) and the rows
whose tokens differ (a float tie flipped a draw; random weights give flat distributions
over the vocabulary, where ties are common).
'smollm2' is SmolLM2-135M's shape (`aot.MODELS`, float32), 'toy' the decoder's default.

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
import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.rollouts import sampling
from experiments.models import decoder
from experiments.training import aot


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


def layout_config(model: str, max_len: int):
  """The PolicyConfig of a benchmark model: 'smollm2' (SmolLM2-135M's shape) or 'toy'."""
  if model == 'toy':
    return decoder.PolicyConfig(vocab_size=16, max_len=max_len)
  from experiments.training import aot
  return aot.model_config({'smollm2': 'smollm2-135m'}.get(model, model), max_len=max_len)[0]


def bench_layouts(model='smollm2', prompt_len=512, group=8, num_prompts=2, length=16,
                  repeats=3, seed=0):
  """Times `sample_iid`'s stages with layout 'rows' and 'cascade' -> dict of medians, ratios."""
  cfg = layout_config(model, prompt_len + length)
  params = jax.jit(decoder.init_params, static_argnums=1)(jax.random.PRNGKey(seed), cfg)
  prompts = jax.random.randint(jax.random.PRNGKey(seed + 1), (num_prompts, prompt_len), 0,
                               cfg.vocab_size)
  plen = jnp.full((num_prompts,), prompt_len, jnp.int32)
  u = sampling._uniforms_jit(jax.random.PRNGKey(seed + 2), jnp.arange(num_prompts),
                             jnp.arange(group), length=length)
  knobs = dict(temperature=jnp.float32(1.0), top_k=jnp.int32(0), top_p=jnp.float32(1.0))

  def run(layout):
    t0 = time.perf_counter()
    state = jax.block_until_ready(sampling._start(params, prompts, u, plen, cfg=cfg, pad_id=0,
                                                  layout=layout))
    t1 = time.perf_counter()
    out = jax.block_until_ready(sampling._decode(params, state, length, knobs, cfg=cfg,
                                                 eos_id=None))
    return out, (t1 - t0, time.perf_counter() - t1)

  layouts = ('rows', 'cascade')
  first = {lay: run(lay)[0] for lay in layouts}  # compiles
  # Rows whose tokens differ: a float tie flipped a draw (frequent with random weights'
  # flat distributions over a large vocabulary); the timings do not depend on the tokens.
  flips = int(np.any(first['rows'].tokens != first['cascade'].tokens, axis=-1).sum())
  times = {lay: [] for lay in layouts}
  for i in range(repeats):
    for lay in layouts[::1 if i % 2 else -1]:
      times[lay].append(run(lay)[1])
  t = {lay: np.array(ts) for lay, ts in times.items()}  # [repeats, (prefill, decode)]
  tokens = num_prompts * group * length
  whole = t['rows'].sum(1) / t['cascade'].sum(1)
  return dict(prefill={lay: np.median(x[:, 0]) for lay, x in t.items()},
              decode={lay: np.median(x[:, 1]) for lay, x in t.items()},
              tok_s={lay: tokens / np.median(x.sum(1)) for lay, x in t.items()},
              decode_tok_s={lay: tokens / np.median(x[:, 1]) for lay, x in t.items()},
              ratio=np.median(whole), decode_ratio=np.median(t['rows'][:, 1] / t['cascade'][:, 1]),
              flips=flips)


def main_layouts(a):
  print(f'layouts rows vs cascade: B={a.num_prompts} L={a.length} repeats={a.repeats} '
        f'backend={jax.default_backend()} devices={jax.device_count()}')
  print(f'{"model":>8} {"P":>5} {"G":>3} | {"prefill s":>9} | {"decode s rows":>13} '
        f'{"cascade":>8} | {"tok/s rows":>10} {"cascade":>8} {"ratio":>6} | '
        f'{"decode tok/s rows":>17} {"cascade":>8} {"ratio":>6} | flipped rows')
  for model in a.models.split(','):
    for p in (int(x) for x in a.prompt_lens.split(',')):
      for g in (int(x) for x in a.groups.split(',')):
        r = bench_layouts(model, p, g, a.num_prompts, a.length, a.repeats)
        print(f'{model:>8} {p:>5} {g:>3} | {r["prefill"]["cascade"]:>9.2f} | '
              f'{r["decode"]["rows"]:>13.2f} {r["decode"]["cascade"]:>8.2f} | '
              f'{r["tok_s"]["rows"]:>10.1f} {r["tok_s"]["cascade"]:>8.1f} {r["ratio"]:>6.2f} | '
              f'{r["decode_tok_s"]["rows"]:>17.1f} {r["decode_tok_s"]["cascade"]:>8.1f} '
              f'{r["decode_ratio"]:>6.2f} | {r["flips"]}/{a.num_prompts * g}', flush=True)


def bench_tree_layouts(model='smollm2', prompt_len=512, branching=(2, 2, 2), segment_len=32,
                       length=96, num_prompts=2, repeats=3, seed=0):
  """Times `sample_tree_fixed` (one program) with layouts 'cascade' and 'cascade_tree'."""
  cfg = dataclasses.replace(layout_config(model, prompt_len + length), decode_window=0)
  params = jax.jit(decoder.init_params, static_argnums=1)(jax.random.PRNGKey(seed), cfg)
  prompts = jax.random.randint(jax.random.PRNGKey(seed + 1), (num_prompts, prompt_len), 0,
                               cfg.vocab_size)
  run = lambda layout: jax.block_until_ready(sampling.sample_tree_fixed(
      params, cfg, jax.random.PRNGKey(seed + 2), prompts, branching, segment_len, length,
      layout=layout))
  layouts = ('cascade', 'cascade_tree')
  first = {lay: run(lay) for lay in layouts}  # compiles
  flips = int(np.any(first['cascade'].tokens != first['cascade_tree'].tokens, axis=-1).sum())
  times = {lay: [] for lay in layouts}
  for i in range(repeats):
    for lay in layouts[::1 if i % 2 else -1]:
      t0 = time.perf_counter()
      run(lay)
      times[lay].append(time.perf_counter() - t0)
  t = {lay: np.array(x) for lay, x in times.items()}
  shape = aot.RLShape(rows=num_prompts * math.prod(branching), group_size=math.prod(branching),
                      prompt_len=prompt_len, response_len=length, sampler='tree_fixed',
                      branching=branching, segment_len=segment_len)
  slots = {lay: aot.tree_slots_read(cfg, shape, lay) for lay in layouts}
  return dict(t={lay: np.median(x) for lay, x in t.items()},
              ratio=np.median(t['cascade'] / t['cascade_tree']),
              slots_ratio=slots['cascade_tree'] / slots['cascade'], flips=flips,
              rows=num_prompts * math.prod(branching))


def main_tree_layouts(a):
  branching = tuple(int(x) for x in a.branching.split(','))
  print(f'sample_tree_fixed, cascade vs cascade_tree: B={a.num_prompts} branching={branching} '
        f'S={a.segment_len} L={a.length} repeats={a.repeats} backend={jax.default_backend()} '
        f'devices={jax.device_count()}')
  print(f'{"model":>8} {"P":>5} | {"s cascade":>9} {"cascade_tree":>12} {"ratio":>6} | '
        f'{"KV slots read, tree / cascade":>29} | flipped rows')
  for model in a.models.split(','):
    for p in (int(x) for x in a.prompt_lens.split(',')):
      r = bench_tree_layouts(model, p, branching, a.segment_len, a.length, a.num_prompts,
                             a.repeats)
      print(f'{model:>8} {p:>5} | {r["t"]["cascade"]:>9.2f} {r["t"]["cascade_tree"]:>12.2f} '
            f'{r["ratio"]:>6.2f} | {r["slots_ratio"]:>29.3f} | {r["flips"]}/{r["rows"]}',
            flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--case', default='tree', choices=('tree', 'layouts', 'tree_layouts'),
                  help="'tree': tree vs iid (the flags below); 'layouts': cascade vs rows; "
                       "'tree_layouts': sample_tree_fixed's cascade vs cascade_tree")
  ap.add_argument('--models', default='smollm2,toy', help='layouts: smollm2, toy')
  ap.add_argument('--prompt_lens', default='512', help='layouts: prompt lengths')
  ap.add_argument('--groups', default='4,8,16', help='layouts: G values')
  ap.add_argument('--num_prompts', type=int, default=2, help='layouts: B')
  ap.add_argument('--batches', default='64,256')
  ap.add_argument('--branching', default='2,2,2')
  ap.add_argument('--segment_len', type=int, default=None, help='default 8; tree_layouts 32')
  ap.add_argument('--length', type=int, default=None, help='L (default 24; layouts 16)')
  ap.add_argument('--prompt_len', type=int, default=8)
  ap.add_argument('--repeats', type=int, default=None, help='default 11; layouts 3')
  a = ap.parse_args()
  layouts = a.case == 'layouts'
  tree_layouts = a.case == 'tree_layouts'
  a.length = a.length or (16 if layouts else 96 if tree_layouts else 24)
  a.segment_len = a.segment_len or (32 if tree_layouts else 8)
  a.repeats = a.repeats or (3 if layouts else 11)
  if layouts:
    return main_layouts(a)
  if a.case == 'tree_layouts':
    return main_tree_layouts(a)
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
