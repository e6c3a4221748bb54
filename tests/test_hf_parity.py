"""Parity with transformers on tiny random checkpoints (tests/fixtures/hf/, written by
experiments/make_hf_fixtures.py with transformers 5): Llama with default / linear /
llama3 RoPE, tied and untied, attention_bias, mlp_bias; Qwen2; Qwen3 (head_dim 24 !=
hidden / heads). Each in the 5.x config layout (`rope_parameters`) and the 4.x one
(top-level rope_theta / rope_scaling, `type` key on llama_linear_v4).

Per directory: max |delta logit| < 1e-4 x the logit scale on four prompts, the same
argmax everywhere, and the same 16 greedy tokens (teacher-forced: our argmax after
each prefix of transformers' greedy sequence is its next token, which by induction is
the same greedy continuation; the cached sampler is run on one model per architecture).
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.models import decoder, hf_loader, pretrained
from experiments.rollouts import sampling

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
NAMES = ('llama_tied', 'llama_untied', 'llama_linear', 'llama_llama3', 'llama_attn_bias',
         'llama_mlp_bias', 'qwen2', 'qwen3')
MAX_LEN = 64
T = 48  # one padded length for every fixture (prompts + greedy row), so shapes are shared

_forward = jax.jit(decoder.forward, static_argnums=1)


def _batch(ref):
  """[5, T] ids: the four prompts, then greedy prompt + transformers' greedy tokens."""
  g = int(ref['greedy_prompt'])
  prompt = ref['ids'][g, :ref['lengths'][g]]
  seq = np.concatenate([prompt, ref['greedy_ids']])
  rows = np.zeros((len(ref['lengths']) + 1, T), np.int32)
  rows[:-1, :ref['ids'].shape[1]] = ref['ids']
  rows[-1, :len(seq)] = seq
  return rows, len(prompt)


@pytest.mark.parametrize('layout', ['', '_v4'])
@pytest.mark.parametrize('name', NAMES)
def test_logits_argmax_and_greedy_match_transformers(name, layout):
  ref = np.load(FIXTURES / f'{name}.npz')
  lm = pretrained.load(str(FIXTURES / (name + layout)), max_len=MAX_LEN)
  tok = lm.tokenizer
  for i, text in enumerate(ref['texts']):  # same tokenizer and chat template
    assert tok.encode(str(text)) == ref['ids'][i, :ref['lengths'][i]].tolist()
  assert tok.render_chat(json.loads(str(ref['chat']))) == str(ref['texts'][1])
  rows, p = _batch(ref)
  logits = np.asarray(_forward(lm.params, lm.cfg, jnp.asarray(rows)))
  scale = float(np.abs(ref['logits']).max())
  for i, n in enumerate(ref['lengths']):
    want = ref['logits'][i, :n]
    assert np.abs(logits[i, :n] - want).max() < 1e-4 * scale, (i, scale)
    np.testing.assert_array_equal(logits[i, :n].argmax(-1), want.argmax(-1))
  greedy = ref['greedy_ids']
  np.testing.assert_array_equal(logits[-1, p - 1:p - 1 + len(greedy)].argmax(-1), greedy)


@pytest.mark.parametrize('name', NAMES)
def test_both_config_layouts_give_the_same_model(name):
  p5, c5, _ = hf_loader.load_hf_dir(FIXTURES / name, max_len=MAX_LEN)
  p4, c4, _ = hf_loader.load_hf_dir(FIXTURES / f'{name}_v4', max_len=MAX_LEN)
  assert c4 == c5
  jax.tree.map(np.testing.assert_array_equal, p4, p5)


def test_fixture_configs_exercise_what_they_are_named_for():
  cfg = lambda n: hf_loader.load_hf_dir(FIXTURES / n, max_len=MAX_LEN)[1]
  assert cfg('llama_tied').tie_embeddings and not cfg('llama_untied').tie_embeddings
  assert cfg('llama_untied').rope_base == 1e5 and cfg('qwen2').rope_base == 1e6
  assert cfg('llama_linear').rope_type == 'linear' and cfg('llama_linear').rope_factor == 4.0
  c = cfg('llama_llama3')
  assert (c.rope_type, c.rope_factor, c.rope_original_max_len) == ('llama3', 8.0, 16)
  c = cfg('llama_attn_bias')
  assert c.attn_bias and c.o_bias and not c.mlp_bias
  assert cfg('llama_mlp_bias').mlp_bias and not cfg('llama_mlp_bias').attn_bias
  c = cfg('qwen2')
  assert c.attn_bias and not c.o_bias and not c.qk_norm
  c = cfg('qwen3')
  assert c.qk_norm and c.head_dim == 24 and c.d_model == 64 and c.num_heads == 4


@pytest.mark.parametrize('name', ['llama_tied', 'llama_llama3', 'qwen2', 'qwen3'])
def test_cached_greedy_sampler_reproduces_transformers(name):
  """The KV-cache sampler (prefill + decode steps), temperature 0, no EOS stop."""
  ref = np.load(FIXTURES / f'{name}.npz')
  lm = pretrained.load(str(FIXTURES / name), max_len=MAX_LEN)
  g = int(ref['greedy_prompt'])
  prompt = ref['ids'][g, :ref['lengths'][g]]
  n = len(ref['greedy_ids'])
  s = sampling.sample_iid(lm.params, lm.cfg, jax.random.PRNGKey(0), jnp.asarray([prompt]), 1, n,
                          temperature=0.0, eos_id=None, pad_id=lm.tokenizer.pad_id)
  np.testing.assert_array_equal(np.asarray(s.tokens[0, 0]), ref['greedy_ids'])
