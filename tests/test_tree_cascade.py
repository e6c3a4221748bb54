"""Tree segment sharing: `sample_tree_fixed`'s 'cascade_tree' cache layout.

'cascade_tree' (`decoder.TreeCache`) keeps each prompt once per group, each tree node's
response segment once (one shared cache level per tree level) and each leaf's own slots
only after its last fork; `decoder.tree_attention` merges all parts by log-sum-exp
(Hydragen, arXiv 2402.05099, its prefix split applied at every level). In float32 the
attention agrees with one softmax over the concatenated keys to ATTN_ATOL and the sampler's
`Samples` with the 'rows' and 'cascade' layouts': identical tokens, masks, parents, forks
and lengths, log-probs and entropies within ATOL (max |diff| seen: 2.2e-6), at temperature
1 and greedy, with rows that stop at EOS before a fork, in decode phases (MHA) and without.
MHA against 'rows' in the suite; MHA against 'cascade', and GQA with biases and LoRA against
both, in a slow test. The cache shapes show the sharing, XLA's bytes accessed the reads.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.models import decoder
from experiments.rollouts import sampling
from test_cascade_decode import lora_params, tiny_cfgs  # tests/ is on sys.path

ATTN_ATOL = 1e-6
ATOL = 1e-5
B, P, L = 3, 7, 12
BRANCHING, SEG = (2, 2, 2), 3  # leaves fork at 3 and 6; the last level runs 6 -> 12
EOS, PAD = 2, 0  # with KEY some rows end before a fork: their children are copies
KEY = jax.random.PRNGKey(2)
# Decode phases of 4 own slots for MHA: the last level's 6 own slots decode in two (4, 6).
CFGS = tiny_cfgs(P + L, P + L, decode_window=4)
PROMPTS = np.random.default_rng(0).integers(3, 24, (B, P)).astype(np.int32)
PROMPT_LEN = np.array([P, 4, 1], np.int32)  # ragged, down to a prompt of one token
_params = lambda name: lora_params(CFGS[name])


def _normal(seed, *shape):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_tree_attention_equals_attention_over_concatenated_keys():
  """Prompt + two segment levels + own slots merged by log-sum-exp == one softmax over all
  keys, with GQA, several queries per row, a row that sees no prompt slot, stale own slots."""
  cfg = decoder.PolicyConfig(vocab_size=8, d_model=48, num_heads=6, num_kv_heads=2)
  b, t, p, w, dh, kh = 2, 2, 5, 4, cfg.head_dim, 2
  nodes, lens = (2 * b, 4 * b), (3, 2)  # level j: nodes[j] segments of lens[j] slots
  r = 8 * b
  q = _normal(0, r, t, 6, dh)
  pk, pv = _normal(1, b, p, kh, dh), _normal(2, b, p, kh, dh) + 1
  sk = tuple(_normal(3 + j, n, s, kh, dh) for j, (n, s) in enumerate(zip(nodes, lens)))
  sv = tuple(_normal(5 + j, n, s, kh, dh) - j for j, (n, s) in enumerate(zip(nodes, lens)))
  ok, ov = _normal(7, r, w, kh, dh), _normal(8, r, w, kh, dh) - 1
  start = np.repeat(np.array([5, 0]), r // b)  # group 1 sees no prompt slot
  slots = np.tile(np.array([[0, 1], [1, 2], [2, 3], [0, 1]]), (r // 4, 1))
  got = jax.jit(decoder.tree_attention, static_argnums=9)(q, pk, pv, sk, sv, ok, ov, start,
                                                          slots, cfg)

  @jax.jit
  def want(q, pk, pv, sk, sv, ok, ov, start, slots):
    up = lambda x: jnp.repeat(x, r // x.shape[0], 0)  # each row's ancestor at that level
    keys = jnp.concatenate([up(pk), *map(up, sk), ok], 1)
    values = jnp.concatenate([up(pv), *map(up, sv), ov], 1)
    visible = jnp.concatenate([
        jnp.broadcast_to(jnp.arange(p) < start[:, None, None], (r, t, p)),
        jnp.ones((r, t, sum(lens)), bool),
        jnp.arange(w)[None, None] <= slots[..., None]], -1)
    return decoder.attention(q, keys, values, visible, cfg)
  np.testing.assert_allclose(got, want(q, pk, pv, sk, sv, ok, ov, start, slots),
                             atol=ATTN_ATOL, rtol=0)


def _check_same(got, want, what):
  for f in ('tokens', 'mask', 'parent', 'fork', 'lengths'):
    np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)),
                                  f'{what}: {f}')
  for f in ('logprobs', 'entropy'):
    diff = float(np.max(np.abs(np.asarray(getattr(got, f)) - np.asarray(getattr(want, f)))))
    assert diff <= ATOL, (what, f, diff)


def _check_tree_samples(name, references):
  cfg, params = CFGS[name], _params(name)
  kw = dict(eos_id=EOS, pad_id=PAD, prompt_len=PROMPT_LEN)
  _, fork_pos, _ = sampling.fixed_tree(BRANCHING, SEG)
  for temperature in (1.0, 0.0):  # traced: one program per layout
    run = lambda layout: sampling.sample_tree_fixed(
        params, cfg, KEY, PROMPTS, BRANCHING, SEG, L, temperature=temperature, layout=layout,
        **kw)
    got = run('cascade_tree')
    for layout in references:
      _check_same(got, run(layout), f'{name} T={temperature} vs {layout}')
    if temperature:  # rows that end before a fork: copied children, clipped forks
      assert int(np.sum(np.asarray(got.fork) < fork_pos)) > 0
      assert 0 < int(got.mask.sum()) < got.mask.size


def test_tree_fixed_samples_equal():
  """MHA against 'rows' (the suite has 'cascade' == 'rows' for trees:
  tests/test_cascade_decode.py); each layout's program compiles in ~4-6 s."""
  _check_tree_samples('mha', ('rows',))


@pytest.mark.slow  # ~20 s: 'cascade' too, and grouped-query heads with biases and LoRA
@pytest.mark.parametrize('name,references', [('mha', ('cascade',)),
                                             ('gqa_lora', ('rows', 'cascade'))])
def test_tree_fixed_samples_equal_slow(name, references):
  _check_tree_samples(name, references)


def _tree_caches(cfg, b, p, branching, seg, length):
  """The 'cascade_tree' cache at each level of `sample_tree_fixed` (eval_shape)."""
  own = sampling.tree_own_lens(len(branching), seg, length)
  g = int(np.prod(branching))
  u = jax.ShapeDtypeStruct((b, branching[0], length), jnp.float32)
  params = jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), cfg))
  state = jax.eval_shape(lambda params, u: sampling.start(
      params, cfg, jnp.ones((b, p), jnp.int32), u, layout='cascade_tree', own_len=own[0]),
      params, u)
  caches = [state.cache]
  for level in range(1, len(branching)):
    rows = state.tokens.shape[0] * branching[level]
    state = jax.eval_shape(functools.partial(sampling.fork_tree, n=branching[level],
                                             own_len=own[level]),
                           state, uniforms=jax.ShapeDtypeStruct((rows, length), jnp.float32))
    caches.append(state.cache)
  assert state.tokens.shape == (b * g, length)
  return caches


def test_tree_cache_is_shared():
  """One prompt per group, one segment per tree node (node-major), and the leaves' own slots
  only after the last fork: [B * G, L - (depth - 1) * S]."""
  cfg = CFGS['gqa_lora']
  kh, dh, layers = cfg.kv_heads, cfg.head_dim, cfg.num_layers
  caches = _tree_caches(cfg, B, P, BRANCHING, SEG, L)
  last = caches[-1]
  assert isinstance(last, decoder.TreeCache) and last.offset == 2 * SEG
  assert last.prefix_k.shape == (layers, B, P, kh, dh)
  nodes = np.cumprod(BRANCHING)[:-1]  # 2 and 4 nodes per prompt at levels 0 and 1
  assert [x.shape for x in last.seg_k] == [(layers, B * n, SEG, kh, dh) for n in nodes]
  assert last.k.shape == last.v.shape == (layers, B * 8, L - 2 * SEG, kh, dh)
  assert [c.k.shape[1:3] for c in caches] == [(B * 2, SEG), (B * 4, SEG), (B * 8, L - 2 * SEG)]


def test_other_samplers_refuse_the_tree_layout():
  cfg, params = CFGS['mha'], _params('mha')
  kw = dict(layout='cascade_tree')
  for sampler, call in (
      ('sample_iid', lambda: sampling.sample_iid(params, cfg, KEY, PROMPTS, 2, L, **kw)),
      ('sample_tree_forks', lambda: sampling.sample_tree_forks(
          params, cfg, KEY, PROMPTS, 2, L, sampling.EntropyForks(1, 1), **kw)),
      ('sample_tree_entropy', lambda: sampling.sample_tree_entropy(
          params, cfg, KEY, PROMPTS, 2, 1, 1, L, **kw))):
    with pytest.raises(ValueError, match=f"'cascade_tree' is sample_tree_fixed's only; "
                                         f"{sampler} takes"):
      call()
  u = jax.ShapeDtypeStruct((B, 2, L), jnp.float32)
  with pytest.raises(ValueError, match="own_len 3: a cascade layout's own slots"):
    jax.eval_shape(lambda u: sampling.start(params, cfg, PROMPTS, u, own_len=3,
                                            layout='rows'), u)
  state = jax.eval_shape(lambda u: sampling.start(params, cfg, PROMPTS, u, **kw), u)
  with pytest.raises(ValueError, match='fork_tree'):  # and no fork at arbitrary positions
    jax.eval_shape(lambda s: sampling.fork(s, 2, jnp.zeros((B * 4,), jnp.int32),
                                           jnp.zeros((B * 4, L))), state)
  with pytest.raises(ValueError, match='pass L'):
    jax.eval_shape(lambda s: sampling.fork_tree(s, 2, 1, jnp.zeros((B * 4, L))), state)


def _bytes(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)['bytes accessed']


def test_tree_attention_reads_each_segment_once():
  """XLA's bytes accessed by a last-level decode step's attention: 'cascade_tree' reads the
  two 128-slot segment levels once per node (2 + 4 per prompt), 'cascade' once per leaf (8
  per prompt), the same keys. The ratio of key / value slots read, (P + 2 * 128 + 4 * 128 +
  8 * 32) / (P + 8 * (2 * 128 + 32)) = 0.448, is XLA's ratio (0.472; its counts add the
  scores, which are small here: K * Dh = 128 floats per slot) up to 0.1."""
  cfg = decoder.PolicyConfig(vocab_size=8, d_model=128, num_heads=2)
  b, p, seg, w, g = 2, 16, 128, 32, 8
  r, kh, dh = b * g, cfg.kv_heads, cfg.head_dim
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  q, pre = f32(r, 1, cfg.num_heads, dh), f32(b, p, kh, dh)
  segs = (f32(b * 2, seg, kh, dh), f32(b * 4, seg, kh, dh))
  tree = _bytes(lambda q, pk, pv, sk, sv, k, v, s, t: decoder.tree_attention(
      q, pk, pv, sk, sv, k, v, s, t, cfg), q, pre, pre, segs, segs, f32(r, w, kh, dh),
      f32(r, w, kh, dh), i32(r), i32(r, 1))
  own = f32(r, 2 * seg + w, kh, dh)  # 'cascade': the leaf's whole response per row
  cascade = _bytes(lambda q, pk, pv, k, v, s, t: decoder.cascade_attention(
      q, pk, pv, k, v, s, t, cfg), q, pre, pre, own, own, i32(r), i32(r, 1))
  analytic = (p + 2 * seg + 4 * seg + g * w) / (p + g * (2 * seg + w))
  assert tree / cascade < analytic + 0.1, (tree, cascade, analytic)


@pytest.mark.parametrize('window,want', [(0, (200, 144, 112)), (2, (200, 112, 96))])
def test_tree_slots_read_counted_by_hand(window, want):
  """`aot.tree_slots_read` (compile_tpu's tree_fixed figures) on one prompt of 4 tokens,
  branching (2, 2), forks at 2, L 6, counted by hand per step: 'rows' reads P + L a row;
  'cascade' the prompt once and each row's own slots up to its phase's end (over L);
  'cascade_tree' also the 2 level-0 segments once, and its own slots' phases start at the
  level's fork. Window 0: cascade 2 x (4 + 2 x 6) + 4 x (4 + 4 x 6); tree 2 x (4 + 2 x 2) +
  4 x (4 + 2 x 2 + 4 x 4). Window 2: cascade 2 x 8 + 2 x 20 + 2 x 28; tree 2 x 8 + 2 x 16 +
  2 x 24."""
  import dataclasses
  from experiments.training import aot
  cfg = dataclasses.replace(CFGS['mha'], decode_window=window)
  shape = aot.RLShape(rows=4, group_size=4, prompt_len=4, response_len=6, sampler='tree_fixed',
                      branching=(2, 2), segment_len=2)
  assert aot.decode_layout(shape) == 'cascade_tree'  # the sampler's default, as it samples
  got = tuple(aot.tree_slots_read(cfg, shape, x) for x in ('rows', 'cascade', 'cascade_tree'))
  assert got == want
  assert aot.cache_slots(shape) == ((1, 4), (2, 2), (4, 4))  # prompt, level-0 nodes, leaves
  with pytest.raises(ValueError, match='G = 4'):
    aot.RLShape(rows=6, group_size=6, sampler='tree_fixed', branching=(2, 2))
