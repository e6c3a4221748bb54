"""Cascade decode (issue 41): the sampler's 'cascade' cache layout against the per-row one.

'cascade' keeps each prompt's keys and values once and each row's own tokens per row, and
merges the two softmax parts by their maxima and sums (`decoder.cascade_attention`,
Hydragen, arXiv 2402.05099); 'rows' is the sampler before it. In float32 the attention
agrees to ATTN_ATOL, teacher-forced decode logits to ATOL and the samplers' `Samples` have
identical tokens, masks, parents and forks and log-probs / entropies within ATOL (MHA, GQA,
GQA + LoRA, ragged prompts down to one token, EOS; i.i.d., fixed and entropy trees, step
forks; and on a data 2 x fsdp 2 x model 2 CPU mesh in a subprocess). A float tie can flip
an inverse-CDF draw, or an entropy fork's position (the tree test checks its key has no
near tie); at these sizes none does (`count_flips` counts draw flips over a large batch:
`python tests/test_cascade_decode.py flips`).
"""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.models import decoder
from experiments.rollouts import sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTN_ATOL = 1e-6  # attention outputs of scale ~1
ATOL = 1e-5       # logits, log-probs and entropies (scale ~1-5), float32
B, P, G, L = 3, 7, 4, 9
EOS, PAD = 1, 0
KEY = jax.random.PRNGKey(7)
TREE_KEY = jax.random.PRNGKey(2)


def tiny_cfgs(mha_len: int, gqa_len: int, **mha) -> dict:
  """The test policies: plain multi-head (with `mha` fields), and grouped-query heads (2
  per kv head) with biases and LoRA."""
  return {
      'mha': decoder.PolicyConfig(vocab_size=24, d_model=32, num_layers=2, num_heads=4,
                                  d_ff=48, max_len=mha_len, **mha),
      'gqa_lora': decoder.PolicyConfig(vocab_size=24, d_model=32, num_layers=2, num_heads=4,
                                       num_kv_heads=2, d_ff=48, max_len=gqa_len,
                                       attn_bias=True, lora_rank=4, tie_embeddings=True)}


@functools.lru_cache(maxsize=None)
def lora_params(cfg: decoder.PolicyConfig):
  """cfg's params with non-zero LoRA B adapters, so that the adapter path matters."""
  params = decoder.init_params(jax.random.PRNGKey(1), cfg)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.05 if decoder.is_lora(p) else x, params)


CFGS = tiny_cfgs(P + L + 4, P + L)
PROMPTS = np.random.default_rng(0).integers(2, 24, (B, P)).astype(np.int32)
PROMPT_LEN = np.array([P, 4, 1], np.int32)  # ragged, down to a prompt of one token
_params = lambda name: lora_params(CFGS[name])


def _close(a, b, atol=ATOL, what=''):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0, err_msg=what)


def check_same_samples(got, want, atol=ATOL):
  """The `Samples` the update and the estimators see: identical but for float rounding."""
  for f in ('tokens', 'mask', 'parent', 'fork'):
    np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), f)
  _close(got.logprobs, want.logprobs, atol, 'logprobs')
  _close(got.entropy, want.entropy, atol, 'entropy')


def test_cascade_attention_equals_attention_over_concatenated_keys():
  """Prefix + own parts merged by log-sum-exp == one softmax over [prefix, own] keys, with
  GQA, several queries per row, rows that see no prefix slot, and masked stale slots."""
  cfg = decoder.PolicyConfig(vocab_size=8, d_model=48, num_heads=6, num_kv_heads=2)
  b, g, t, p, l, dh = 2, 3, 2, 5, 4, cfg.head_dim
  normal = lambda *shape: np.random.default_rng(len(shape)).normal(size=shape).astype(np.float32)
  q = normal(b * g, t, 6, dh)
  pk, pv = normal(b, p, 2, dh), normal(b, p, 2, dh) + 1
  ok, ov = normal(b * g, l, 2, dh), normal(b * g, l, 2, dh) - 1
  start = np.array([5, 5, 5, 0, 0, 0])  # group 1 sees no prefix slot
  slots = np.array([[0, 1], [1, 2], [2, 3]] * 2)
  got = jax.jit(decoder.cascade_attention, static_argnums=7)(q, pk, pv, ok, ov, start, slots,
                                                              cfg)

  @jax.jit
  def want(q, pk, pv, ok, ov, start, slots):
    keys = jnp.concatenate([jnp.repeat(pk, g, 0), ok], 1)
    values = jnp.concatenate([jnp.repeat(pv, g, 0), ov], 1)
    visible = jnp.concatenate([
        jnp.broadcast_to(jnp.arange(p) < start[:, None, None], (b * g, t, p)),
        jnp.arange(l)[None, None] <= slots[..., None]], -1)
    return decoder.attention(q, keys, values, visible, cfg)
  _close(got, want(q, pk, pv, ok, ov, start, slots), ATTN_ATOL)


def test_teacher_forced_decode_logits_equal():
  """Prefill + 1-token decode steps over the same tokens: the cascade cache's logits equal
  the per-row cache's at every step (G rows per prompt, ragged prompts; GQA, LoRA)."""
  name = 'gqa_lora'
  cfg, params = CFGS[name], _params(name)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (B * G, L)).astype(np.int32)
  plen = np.repeat(PROMPT_LEN, G)
  last = np.repeat(PROMPTS[np.arange(B), PROMPT_LEN - 1], G)

  @functools.partial(jax.jit, static_argnums=0)
  def run(layout):
    empty = (decoder.init_cascade_cache(cfg, B, P, B * G, L) if layout == 'cascade'
             else decoder.init_cache(cfg, B * G))
    _, cache = decoder.prefill(params, cfg, jnp.asarray(PROMPTS), empty)
    start = plen - 1 if layout == 'cascade' else None
    feed = jnp.concatenate([last[:, None], tokens[:, :-1]], 1)

    def step(cache, i):
      logits, cache = decoder.decode_step(params, cfg, cache, feed[:, i], plen - 1 + i, start)
      return cache, logits
    return jax.lax.scan(step, cache, jnp.arange(L))[1]

  want = run('rows')
  _close(run('cascade'), want, what=name)
  assert float(jnp.std(want)) > 0.1  # logits that can differ


@pytest.mark.parametrize('name', sorted(CFGS))
def test_iid_samples_equal(name):
  cfg, params = CFGS[name], _params(name)
  kw = dict(eos_id=EOS, pad_id=PAD, prompt_len=PROMPT_LEN)
  got, want = (sampling.sample_iid(params, cfg, KEY, PROMPTS, G, L, layout=lay, **kw)
               for lay in ('cascade', 'rows'))
  check_same_samples(got, want)
  assert 0 < int(got.mask.sum()) < got.mask.size  # some rows stop at EOS
  # top-k / nucleus and greedy draws too
  for knobs in (dict(temperature=0.7, top_k=5, top_p=0.9), dict(temperature=0.0)):
    got, want = (sampling.sample_iid(params, cfg, KEY, PROMPTS, G, L, layout=lay, **knobs, **kw)
                 for lay in ('cascade', 'rows'))
    check_same_samples(got, want)


def test_default_layout_is_cascade():
  cfg, params = CFGS['gqa_lora'], _params('gqa_lora')
  assert sampling.DEFAULT_LAYOUT == 'cascade'
  u = sampling.response_uniforms(KEY, np.arange(B), np.arange(G), L)
  state = sampling._start(params, jnp.asarray(PROMPTS), u, jnp.asarray(PROMPT_LEN), cfg=cfg,
                          pad_id=PAD)
  assert isinstance(state.cache, decoder.CascadeCache)
  assert state.cache.prefix_k.shape == (2, B, P, 2, cfg.head_dim)  # each prompt once
  assert state.cache.k.shape == (2, B * G, L, 2, cfg.head_dim)     # own tokens per row
  with pytest.raises(ValueError, match='layout'):
    sampling.sample_iid(params, cfg, KEY, PROMPTS, G, L, layout='paged')


def test_compile_report_takes_the_layout_from_the_shape():
  """aot compiles the prefill with the RLShape's decode_layout (compile_tpu's
  --decode_layout), and counts its KV cache slots: B prompts of P and B * G rows of L
  ('cascade', the default) or B * G rows of P + L ('rows')."""
  from experiments.training import aot
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
  calls = {}

  def fake(name, piece, fn, args, static, takes=()):  # aot.Compiler's signature
    calls[name] = static
    return None

  for layout, want in ((None, 'cascade'), ('cascade', 'cascade'), ('rows', 'rows')):
    shape = aot.RLShape(rows=8, group_size=4, prompt_len=5, response_len=3,
                        decode_layout=layout)
    aot.compile_sampler(fake, None, CFGS['mha'], shape, mesh, None, None)
    assert calls['prefill (_start)']['layout'] == want
    assert aot.cache_slots(shape) == (((8, 5 + 3),) if want == 'rows' else ((2, 5), (8, 3)))
  with pytest.raises(ValueError, match='decode_layout'):
    aot.RLShape(decode_layout='paged')


def _entropy_margin(chains, num_forks):
  """Smallest gap, over chains, between the entropies of ranks k and k + 1 (k < num_forks)
  of their valid positions: what keeps float rounding from moving an entropy fork."""
  e = np.where(chains.mask, chains.entropy, -np.inf)
  top = -np.sort(-e, -1)[..., :num_forks + 1]
  gaps = top[..., :-1] - top[..., 1:]
  return float(np.min(np.where(np.isfinite(gaps), gaps, np.inf)))


def test_tree_samples_equal():
  """Trees fork rows of a cascade cache (their own slots copied, the prompts shared): a
  fixed tree (one program, repeated rows) and an entropy tree (forks of chosen rows)."""
  kw = dict(eos_id=EOS, pad_id=PAD, prompt_len=PROMPT_LEN)
  key = TREE_KEY  # a key without near-tied entropies (KEY has one with LoRA, gap 2e-7)
  cfg, params = CFGS['mha'], _params('mha')
  got, want = (sampling.sample_tree_fixed(params, cfg, key, PROMPTS, (2, 2), 3, L, layout=lay,
                                          **kw) for lay in ('cascade', 'rows'))
  check_same_samples(got, want)
  cfg, params = CFGS['gqa_lora'], _params('gqa_lora')
  got, want = (sampling.sample_tree_entropy(params, cfg, key, PROMPTS, 2, 2, 1, L, layout=lay,
                                            **kw) for lay in ('cascade', 'rows'))
  assert _entropy_margin(jax.tree.map(lambda x: x[:, :2], want), 2) > 10 * ATOL
  check_same_samples(got, want)
  assert int((got.parent >= 0).sum()) > 0


def test_step_tree_samples_equal(monkeypatch):
  """`step_forks.sample_step_tree` (forks of forks, rows concatenated) under either default."""
  from experiments.rollouts import step_forks
  cfg, params = CFGS['gqa_lora'], _params('gqa_lora')
  ends = lambda tokens, mask: (tokens % 3 == 0) & mask
  run = lambda: step_forks.sample_step_tree(params, cfg, KEY, PROMPTS, 2, 2, 1, L,
                                            ends_fn=ends, num_steps=3, eos_id=EOS, pad_id=PAD,
                                            prompt_len=PROMPT_LEN)
  got = run()
  monkeypatch.setattr(sampling, 'DEFAULT_LAYOUT', 'rows')
  check_same_samples(got, run())


def test_fork_refuses_rows_that_do_not_split_over_the_prompts():
  cfg, params = CFGS['mha'], _params('mha')
  u = jax.ShapeDtypeStruct((B, 2, L), jnp.float32)
  state = jax.eval_shape(lambda u: sampling.start(params, cfg, jnp.asarray(PROMPTS), u), u)
  with pytest.raises(ValueError, match='split evenly'):
    jax.eval_shape(lambda s: sampling.fork(s, jnp.arange(4), jnp.zeros((4,), jnp.int32),
                                           jnp.zeros((4, L))), state)


def test_decode_in_phases_equals_the_rows_layout():
  """Decode phases (`sampling.decode_windows`, `cfg.decode_window`): a step of the phase
  ending at w attends over own slots [0, w) only. Windows of 4 over L = 9 (phases ending
  at 4, 8, 9) give the 'rows' layout's samples, i.i.d. and an entropy tree whose forks start
  in every phase (GQA with biases and LoRA); one phase where there is no cascade cache or
  w >= L."""
  kw = dict(eos_id=EOS, pad_id=PAD, prompt_len=PROMPT_LEN)
  cfg, params = CFGS['gqa_lora'], _params('gqa_lora')
  phased = dataclasses.replace(cfg, decode_window=4)
  assert sampling.decode_windows(phased, L) == (4, 8, 9)
  got, want = (sampling.sample_iid(params, c, KEY, PROMPTS, G, L, layout=lay, **kw)
               for c, lay in ((phased, 'cascade'), (cfg, 'rows')))
  check_same_samples(got, want)
  got, want = (sampling.sample_tree_entropy(params, c, TREE_KEY, PROMPTS, 2, 2, 1, L,
                                            layout=lay, **kw)
               for c, lay in ((phased, 'cascade'), (cfg, 'rows')))
  check_same_samples(got, want)
  forks = np.asarray(got.fork)[np.asarray(got.parent) >= 0]
  assert forks.min() < 4 and forks.max() >= 4  # children start before and after a window end
  assert sampling.decode_windows(phased, L, cascade=False) == (L,)
  assert sampling.decode_windows(dataclasses.replace(cfg, decode_window=L), L) == (L,)
  assert sampling.decode_windows(dataclasses.replace(cfg, decode_window=0), L) == (L,)
  with pytest.raises(ValueError, match='decode_window'):
    dataclasses.replace(cfg, decode_window=-1)


def test_decode_phases_read_fewer_bytes():
  """The phases' point: XLA's bytes accessed per decode step (the program's total over its
  phase bodies, each counted once, divided by the phases) fall below one phase's, and
  `aot.decode_hbm_bytes` counts the rows' own slots as the mean window: 0.625 L for four
  equal phases."""
  from experiments.training import aot
  cfg = decoder.PolicyConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2, d_ff=32,
                             max_len=4 + 64)
  params = decoder.init_params(jax.random.PRNGKey(0), cfg)
  b, g, l = 2, 4, 64
  u = sampling.response_uniforms(KEY, np.arange(b), np.arange(g), l)
  knobs = dict(temperature=jnp.float32(1), top_k=jnp.int32(0), top_p=jnp.float32(1))
  per_step = {}
  for w in (0, 16):
    c = dataclasses.replace(cfg, decode_window=w)
    state = sampling._start(params, jnp.ones((b, 4), jnp.int32), u, jnp.full((b,), 4), cfg=c,
                            pad_id=PAD, layout='cascade')
    cost = sampling._decode.lower(params, state, l, knobs, cfg=c, eos_id=EOS).compile()
    cost = cost.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    per_step[w] = cost['bytes accessed'] / len(sampling.decode_windows(c, l))
  assert per_step[16] < 0.8 * per_step[0], per_step
  assert aot.mean_own_slots(dataclasses.replace(cfg, decode_window=256), 1024,
                            'cascade') == 640
  assert aot.mean_own_slots(cfg, 1024, 'rows') == 1024

# ----------------------------------------------------------------------------
# Tensor parallelism: 8 CPU devices in a subprocess (as tests/test_tensor_parallel.py).


def _mesh_check():
  from jax.sharding import NamedSharding, PartitionSpec as Spec
  from experiments.training import train_step as ts
  assert jax.device_count() == 8, jax.devices()
  mesh = ts.make_mesh(2, model=2)
  for name in ('gqa_lora',):
    cfg, params = CFGS[name], _params(name)
    b = 8
    prompts = np.random.default_rng(2).integers(2, 24, (b, P)).astype(np.int32)
    kw = dict(eos_id=EOS, pad_id=PAD)
    want = sampling.sample_iid(params, cfg, KEY, prompts, 2, L, layout='rows', **kw)
    placed = jax.device_put(params, ts.param_sharding(params, mesh))
    rows = ts.batch_sharding(mesh)
    with jax.set_mesh(mesh):
      got = sampling.sample_iid(placed, cfg, KEY, jax.device_put(prompts, rows), 2, L, **kw)
      u = sampling._uniforms_jit(KEY, jnp.arange(b), jnp.arange(2), length=L)
      state = sampling._start(placed, jax.device_put(prompts, rows), u,
                              jnp.full((b,), P, jnp.int32), cfg=cfg, pad_id=PAD)
    check_same_samples(got, want, 2e-5)
    # The tree layout's segment levels ([B * nodes, S]) and rebased own slots on the mesh.
    tree = lambda p, x, layout: sampling.sample_tree_fixed(p, cfg, KEY, x, (2, 2), 3, L,
                                                           layout=layout, **kw)
    want_tree = tree(params, prompts, 'rows')
    with jax.set_mesh(mesh):
      got_tree = tree(placed, jax.device_put(prompts, rows), 'cascade_tree')
    check_same_samples(got_tree, want_tree, 2e-5)
    spec = NamedSharding(mesh, Spec(None, ('data', 'fsdp'), None, 'model', None))
    for x in jax.tree.leaves(state.cache):  # prefixes and own rows: over the mesh
      assert x.sharding.is_equivalent_to(spec, 5), (name, x.shape, x.sharding)
  print('OK mesh')


@pytest.mark.slow  # ~30 s; tests/test_tensor_parallel.py samples on this mesh in the suite
def test_model_axis_on_eight_devices():
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  env.pop('JAX_COORDINATOR_ADDRESS', None)
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), 'mesh'], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert 'OK mesh' in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------
# Tie flips over a large batch (a script, not part of the suite).


def count_flips(num_prompts=256, group=16, length=32, prompt=64, vocab=512, seed=0):
  """(rows whose tokens differ between layouts, rows, draws): a float tie flipping an
  inverse-CDF draw makes a row differ from that token on. Logits of rows that agree are
  compared too (max |Δ log-prob|)."""
  cfg = decoder.PolicyConfig(vocab_size=vocab, d_model=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, d_ff=128, max_len=prompt + length)
  params = decoder.init_params(jax.random.PRNGKey(seed), cfg)
  prompts = jax.random.randint(jax.random.PRNGKey(seed + 1), (num_prompts, prompt), 0, vocab)
  got, want = (sampling.sample_iid(params, cfg, jax.random.PRNGKey(seed + 2), prompts, group,
                                   length, layout=lay) for lay in ('cascade', 'rows'))
  differ = np.any(np.asarray(got.tokens != want.tokens), -1)
  same = ~differ[..., None]
  lp = float(np.max(np.abs(np.where(same, got.logprobs - want.logprobs, 0.0))))
  return int(differ.sum()), differ.size, differ.size * length, lp


if __name__ == '__main__':
  if sys.argv[1:] == ['mesh']:
    _mesh_check()
  elif sys.argv[1:2] == ['flips']:
    for seed in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
      flips, rows, draws, lp = count_flips(seed=seed)
      print(f'seed {seed}: {flips} of {rows} rows differ ({draws} draws); '
            f'max |d logprob| on equal rows {lp:.2e}', flush=True)
