"""Train-step throughput and memory: tree-packed vs prompt-packed vs flat rows, in one run.

    python -m experiments.bench_train [--model toy|smollm2] [--groups 8] [--repeats 5]
        [--cases a,b,c,d] [--attention paths,auto] [--layouts prompt,tree]
    python -m experiments.bench_train --long    # responses of 512-4k tokens, small d

Each case times the jitted `train_step` (one Adam update, token-mean loss) on the
same batch in three layouts — `none` (flat B * G rows, the baseline), `prompt`
(PrefixGrouper-style: the prompt once per group) and `tree` (every prefix-tree
node once) — and prints response tokens per second, the ratio against flat, the
compiled program's temporary memory, the packed length and the share of leaf
tokens that the tree shares. The pack length is the loop's bucketed length
(`trees.packing.bucket_len`), not the exact one.

Cases (response length L, prompt length P):
  a  i.i.d. GRPO groups: independent random responses, G in {8, 16}, P:L = 1:1 and 4:1.
  b  fixed-branching sampled trees: branching (2, 2, 2) and (4, 4) with long first
     segments, 50-75 % of leaf tokens shared.
  c  worst case: nothing shared beyond the prompt, P:L = 1:4.
  d  multi-turn agents: K = 8 turns of 8 action + 24 observation tokens after a first
     observation (the prompt) of 64 or 256 tokens; 4 chains forked 4 ways at turn 2
     (`agent_sampling.fork_episodes`' layout, G = 16); the loss on action tokens only
     (`policy_mask`), the layout over every token, as the loop packs agents.
  e  long responses (`--long`: B = 1 group, d = 64, 2 heads, 2 layers): (2, 2, 2)
     trees with segments .5/.25/.25 of L in {512, 1024, 2048}, P = L / 4; a (2, 2) tree
     .5/.5 at L = 4096, P = 1024 (remat: flat rows' scores would not fit in RAM); i.i.d.
     G = 4 at L = 2048, P = 512; packed attention 'paths' against 'blocks'.

Each packed layout runs once per `--attention` mode (`trees.packing.ATTENTION`). The
`dense` column is flat rows' teacher-forced tokens over the packed row's slots (the
saving in dense-layer FLOPs, 1 - 1/dense), `kept` the share of that saving the step
keeps: (1 - t_packed / t_flat) / (1 - T_packed / T_flat); `pairs` the block size, the
block pairs computed and all lower-triangular pairs ('blocks'), or what 'auto' chose.
Absolute times depend on the machine; compare the ratios of one run.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.training import train_step as ts
from experiments.bench_credit import median_time
from experiments.models import decoder
from trees import packing


def iid_groups(rng, b, g, l, vocab):
  """Independent responses with distinct first tokens (nothing shared past the prompt)."""
  tok = rng.integers(0, vocab, (b, g, l)).astype(np.int32)
  tok[:, :, 0] = np.arange(g) % vocab
  return tok


def tree_groups(rng, b, branching, fractions, l, vocab):
  """Responses of a fixed-branching tree: level k's segment is fractions[k] * L tokens,
  shared by every leaf below its node. Distinct first tokens at each fork."""
  cuts = np.concatenate([[0], np.round(np.cumsum(fractions) * l).astype(int)])
  cuts[-1] = l
  g = int(np.prod(branching))
  tok = np.zeros((b, g, l), np.int32)
  for level, _ in enumerate(branching):
    width = int(np.prod(branching[level + 1:]))  # leaves below one node of this level
    nodes = g // width
    seg = rng.integers(0, vocab, (b, nodes, cuts[level + 1] - cuts[level]))
    seg[:, :, 0] = np.arange(nodes) % branching[level]
    tok[:, :, cuts[level]:cuts[level + 1]] = np.repeat(seg, width, axis=1)
  return tok


def agent_groups(rng, b, chains, forks, fork_turn, turns, action_len, obs_len, vocab):
  """Forked trajectories [B, G = chains * forks, K (A + O)] and their policy mask: the
  copies of a chain share its turns before `fork_turn`, then sample their own (a
  distinct first action token at the fork)."""
  slot = action_len + obs_len
  l = turns * slot
  g = chains * forks
  tok = rng.integers(0, vocab, (b, g, l)).astype(np.int32)
  cut = fork_turn * slot
  tok[:, :, :cut] = np.repeat(tok[:, ::forks, :cut], forks, axis=1)
  tok[:, :, cut] = np.arange(g) % forks
  policy = np.tile(np.arange(slot) < action_len, turns)
  return tok, np.broadcast_to(policy, tok.shape)


def cases(which):
  out = []
  if 'a' in which:
    for g in (8, 16):
      for p, l in ((32, 32), (128, 32)):
        out.append((f'a iid G={g} P:L={p}:{l}', 'iid', g, p, l))
  if 'b' in which:
    out.append(('b tree (2,2,2) seg .5/.25/.25', 'tree', ((2, 2, 2), (.5, .25, .25)), 32, 32))
    out.append(('b tree (4,4) seg .75/.25', 'tree', ((4, 4), (.75, .25)), 32, 32))
    out.append(('b tree (2,2,2) seg .75/.125/.125', 'tree', ((2, 2, 2), (.75, .125, .125)), 32, 64,))
  if 'c' in which:
    out.append(('c no sharing G=8 P:L=16:64', 'iid', 8, 16, 64))
  if 'd' in which:  # (chains, forks, fork turn, K, A, O)
    for p in (64, 256):
      out.append((f'd agent 4x4 fork@2 K=8 P={p}', 'agent', (4, 4, 2, 8, 8, 24), p, 8 * 32))
  if 'e' in which:
    for l in (512, 1024, 2048):
      out.append((f'e tree (2,2,2) .5/.25/.25 L={l}', 'tree', ((2, 2, 2), (.5, .25, .25)),
                  l // 4, l))
    out.append(('e tree (2,2) .5/.5 L=4096', 'tree', ((2, 2), (.5, .5)), 1024, 4096))
    out.append(('e iid G=4 L=2048', 'iid', 4, 512, 2048))
  return out


LONG_CFG = dict(d_model=64, num_heads=2, num_layers=2, d_ff=168)


def layouts(attention):
  """(packing mode, packed attention) per timed layout; flat rows first (the baseline)."""
  out = [('none', None)]
  for mode in ('prompt', 'tree'):
    out += [(mode, a) for a in attention]
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='toy', choices=('toy', 'smollm2'))
  parser.add_argument('--groups', type=int, default=None,
                      help='B, groups (prompts) per step (8; --long: 1)')
  parser.add_argument('--repeats', type=int, default=None, help='timed steps (5; --long: 3)')
  parser.add_argument('--cases', default=None, help='of a,b,c,d,e (a,b,c,d; --long: e)')
  parser.add_argument('--attention', default='paths,auto',
                      help=f'packed attention modes to time, of {",".join(packing.ATTENTION)}')
  parser.add_argument('--long', action='store_true',
                      help='responses of 512-4k tokens (case e), small d')
  parser.add_argument('--layouts', default=None, help='packed layouts (prompt,tree; --long: tree)')
  args = parser.parse_args(argv)
  attention = args.attention.split(',')
  bad = [a for a in attention if a not in packing.ATTENTION]
  if bad:
    parser.error(f'unknown --attention {bad}; valid: {", ".join(packing.ATTENTION)}')
  for key, short, long in (('cases', 'a,b,c,d', 'e'), ('groups', 8, 1), ('repeats', 5, 3),
                           ('layouts', 'prompt,tree', 'tree')):
    if getattr(args, key) is None:
      setattr(args, key, long if args.long else short)
  todo = [(m, a) for m, a in layouts(attention) if m == 'none' or m in args.layouts.split(',')]

  rng = np.random.default_rng(0)
  b = args.groups
  print(f'jax {jax.__version__} on {jax.devices()[0].platform}, model {args.model}, B={b}'
        + (f', {LONG_CFG}' if args.long else ''))
  print(f'{"case":34} {"layout":14} {"T":>5} {"shared":>7} {"tok/s":>9} {"x flat":>7} '
        f'{"dense":>6} {"kept":>6} {"pairs":>13} {"temp MiB":>9}')
  pretrained = None
  for name, kind, gspec, p, l in cases(args.cases):
    if args.model == 'toy':
      cfg = decoder.PolicyConfig(vocab_size=16, max_len=p + l, remat=p + l > 4096,
                                 **(LONG_CFG if args.long else {}))
      params = decoder.init_params(jax.random.PRNGKey(0), cfg)
      vocab = 16
    else:
      from experiments.models import pretrained as pretrained_lib
      if pretrained is None:
        pretrained = pretrained_lib.load('smollm2', max_len=p + l, remat=True)
      cfg = dataclasses.replace(pretrained.cfg, max_len=p + l)
      params, vocab = pretrained.params, pretrained.cfg.vocab_size
    mask = loss_mask = None
    if kind == 'iid':
      g = gspec
      tok = iid_groups(rng, b, g, l, vocab)
    elif kind == 'agent':
      tok, loss_mask = agent_groups(rng, b, *gspec, vocab)
      g = tok.shape[1]
    else:
      tok = tree_groups(rng, b, gspec[0], gspec[1], l, vocab)
      g = tok.shape[1]
    mask = np.ones(tok.shape, bool)
    loss_mask = mask if loss_mask is None else loss_mask
    prompts = rng.integers(0, vocab, (b, p)).astype(np.int32)
    adv = rng.normal(size=(b, g, 1)).astype(np.float32) * np.ones((1, 1, l), np.float32)
    old = np.full(tok.shape, -np.log(vocab), np.float32)
    need = packing.required_len(prompts, tok, mask, 'tree')
    shared = 1 - (need - p) / (g * l)
    base = None
    lc = ts.LossConfig(num_minibatches=1)
    tx = ts.make_optimizer(1e-4)
    flat_len = g * (p + l - 1)  # teacher-forced tokens of the flat rows, per group
    for layout, attn in todo:
      pk = None
      t_len = g * (p + l)  # flat: tokens per group
      pairs = ''
      if layout != 'none':
        node = packing.node_ids(jnp.asarray(tok), jnp.asarray(mask), layout)
        req = packing.required_len(prompts, tok, mask, layout, node=node)
        t_len = packing.bucket_len(req, p, g, l)
        pk = packing.pack(prompts, tok, mask, pack_len=t_len, mode=layout, node=node,
                          attention=attn)
        if pk.attention == 'blocks':  # block size: pairs used / all lower-triangular pairs
          pairs = f'{pk.block}:{pk.num_pairs}/{pk.num_blocks * (pk.num_blocks + 1) // 2}'
        elif attn == 'auto':
          pairs = pk.attention
      batch = ts.batch_from_samples(jnp.asarray(prompts), jnp.asarray(tok), jnp.asarray(loss_mask),
                                    jnp.asarray(adv), jnp.asarray(old), packing=pk)
      state = ts.init_state(jax.tree.map(jnp.copy, params), tx)
      step = jax.jit(ts.train_step, static_argnames=('cfg', 'loss_cfg'))
      compiled = step.lower(state, batch, cfg=cfg, loss_cfg=lc).compile()
      mem = compiled.memory_analysis()
      temp = getattr(mem, 'temp_size_in_bytes', float('nan')) / 2**20 if mem else float('nan')
      jax.block_until_ready(compiled(state, batch))
      sec = median_time(lambda: compiled(state, batch), args.repeats)
      tps = b * g * l / sec
      base = tps if layout == 'none' else base
      dense = flat_len / t_len if layout != 'none' else 1.0
      kept = (1 - base / tps) / (1 - 1 / dense) if dense > 1 else float('nan')
      label = layout if attn is None else f'{layout}/{attn}'
      print(f'{name:34} {label:14} {t_len:>5} {shared:>7.0%} {tps:>9.0f} {tps / base:>7.2f} '
            f'{dense:>6.2f} {kept:>6.2f} {pairs:>13} {temp:>9.1f}', flush=True)

if __name__ == '__main__':
  main()
