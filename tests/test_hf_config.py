"""Refusals of the checkpoint loaders: each names the file, the key and its value.

RoPE types and keys the decoder does not implement, conflicting config layouts,
missing fields, truncated config.json / safetensors / tokenizer.json / GGUF files,
tensors the config does not account for, max_len beyond the checkpoint's context
(max_position_embeddings, sliding window, GGUF context_length), Gemma, and the
tokenizer's out-of-vocabulary ids and non-string chat content. Uses the tiny
fixtures of tests/fixtures/hf/ (copied to tmp_path before being damaged).
"""

import copy
import json
import pathlib
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from experiments.models import assets, gguf_loader, hf_loader, pretrained
from experiments.models.tokenizer import Tokenizer

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
LLAMA = FIXTURES / 'llama_tied'
BASE = json.loads((LLAMA / 'config.json').read_text())  # transformers 5 layout


def cfg_of(**changes):
  hf = copy.deepcopy(BASE)
  for k, v in changes.items():
    if v is None:
      hf.pop(k, None)
    else:
      hf[k] = v
  return hf


def copy_dir(tmp_path, src=LLAMA, config=None):
  dst = tmp_path / src.name
  shutil.copytree(src, dst)
  if config is not None:
    (dst / 'config.json').write_text(json.dumps(config))
  return dst


def truncate(path, keep=0.5):
  data = path.read_bytes()
  path.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize('rope', [
    {'rope_parameters': {'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 1e4}},
    {'rope_parameters': {'rope_type': 'dynamic', 'factor': 2.0, 'rope_theta': 1e4}},
    {'rope_parameters': {'rope_type': 'longrope', 'rope_theta': 1e4, 'short_factor': [1.0],
                         'long_factor': [2.0]}},
    {'rope_parameters': None, 'rope_theta': 1e4, 'rope_scaling': {'type': 'dynamic', 'factor': 2.0}},
    {'rope_parameters': None, 'rope_theta': 1e4, 'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0}},
])
def test_unsupported_rope_types_are_refused_by_name(rope):
  kind = (rope['rope_parameters'] or rope.get('rope_scaling'))
  kind = kind.get('rope_type', kind.get('type'))
  with pytest.raises(hf_loader.ConfigError, match=f"where.json: rope_type '{kind}' not supported"):
    hf_loader.config_from_hf(cfg_of(**rope), max_len=16, where='where.json')


@pytest.mark.parametrize('rope, key', [
    ({'rope_parameters': {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e4,
                          'beta_fast': 32}}, 'beta_fast=32'),
    ({'rope_parameters': {'rope_type': 'default', 'rope_theta': 1e4, 'low_freq_factor': 1.0}},
     'low_freq_factor=1.0'),
    ({'rope_parameters': None, 'rope_theta': 1e4,
      'rope_scaling': {'type': 'linear', 'factor': 2.0, 'mscale': 0.7}}, 'mscale=0.7'),
])
def test_unknown_rope_keys_are_refused_with_their_values(rope, key):
  with pytest.raises(hf_loader.ConfigError, match=re.escape(key)):
    hf_loader.config_from_hf(cfg_of(**rope), max_len=16)


def test_rope_type_missing_fields_and_partial_rotary_are_refused():
  with pytest.raises(hf_loader.ConfigError, match='llama3 needs .*original_max_position_embeddings'):
    hf_loader.config_from_hf(cfg_of(rope_parameters={
        'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
        'rope_theta': 5e5}), max_len=16)
  with pytest.raises(hf_loader.ConfigError, match='linear needs factor'):
    hf_loader.config_from_hf(cfg_of(rope_parameters={'rope_type': 'linear', 'rope_theta': 1e4}),
                             max_len=16)
  with pytest.raises(hf_loader.ConfigError, match='partial_rotary_factor=0.5'):
    hf_loader.config_from_hf(cfg_of(partial_rotary_factor=0.5), max_len=16)


def test_conflicting_layouts_are_refused_and_agreeing_ones_accepted():
  hf = cfg_of(rope_theta=1e6)  # rope_parameters says 1e4
  with pytest.raises(hf_loader.ConfigError,
                     match=r"rope_theta is 10000.0 in rope_parameters but 1000000.0 in rope_theta"):
    hf_loader.config_from_hf(hf, max_len=16)
  hf = cfg_of(rope_parameters={'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e4},
              rope_scaling={'type': 'linear', 'factor': 4.0})
  with pytest.raises(hf_loader.ConfigError, match=r'factor is 2.0 in rope_parameters but 4.0 in '
                                                   r'rope_scaling'):
    hf_loader.config_from_hf(hf, max_len=16)
  hf = cfg_of(rope_parameters={'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e4},
              rope_scaling={'rope_type': 'linear', 'factor': 2.0}, rope_theta=1e4)
  cfg = hf_loader.config_from_hf(hf, max_len=16)
  assert (cfg.rope_type, cfg.rope_factor, cfg.rope_base) == ('linear', 2.0, 1e4)


@pytest.mark.parametrize('field', ['hidden_size', 'vocab_size', 'num_hidden_layers'])
def test_missing_config_field_names_field_and_file(tmp_path, field):
  d = copy_dir(tmp_path, config=cfg_of(**{field: None}))
  with pytest.raises(ValueError, match=f'{re.escape(str(d / "config.json"))}: required '
                                       f'field.* {field} missing'):
    hf_loader.load_hf_dir(d, max_len=16)


def test_bad_config_values_are_named():
  with pytest.raises(hf_loader.ConfigError, match="hidden_act 'gelu'"):
    hf_loader.config_from_hf(cfg_of(hidden_act='gelu'), max_len=16)
  with pytest.raises(hf_loader.ConfigError, match="hidden_size must be a positive integer, got "
                                                  "'64'"):
    hf_loader.config_from_hf(cfg_of(hidden_size='64'), max_len=16)
  with pytest.raises(hf_loader.ConfigError, match='attn_logit_softcapping=50.0'):
    hf_loader.config_from_hf(cfg_of(attn_logit_softcapping=50.0), max_len=16)


@pytest.mark.parametrize('model_type', ['gemma', 'gemma2', 'gemma3_text', 'mistral'])
def test_gemma_and_unknown_architectures_are_refused(model_type):
  with pytest.raises(NotImplementedError, match=f"model_type '{model_type}' not supported"):
    hf_loader.config_from_hf(cfg_of(model_type=model_type), max_len=16, where='c.json')


def test_truncated_config_json_names_the_file(tmp_path):
  d = copy_dir(tmp_path)
  truncate(d / 'config.json')
  with pytest.raises(ValueError, match=f'{re.escape(str(d / "config.json"))}: not valid JSON'):
    hf_loader.load_hf_dir(d, max_len=16)
  with pytest.raises(ValueError, match=re.escape(str(d / 'config.json'))):
    pretrained.load(str(d), max_len=16)


def test_truncated_safetensors_names_the_file(tmp_path):
  d = copy_dir(tmp_path)
  truncate(d / 'model.safetensors')
  with pytest.raises(ValueError, match=f'{re.escape(str(d / "model.safetensors"))}: not a '
                                       'readable safetensors file'):
    pretrained.load(str(d), max_len=16)


def test_truncated_tokenizer_json_names_the_file(tmp_path):
  d = copy_dir(tmp_path)
  truncate(d / 'tokenizer.json')
  with pytest.raises(ValueError, match=f'{re.escape(str(d / "tokenizer.json"))}: not a valid'):
    pretrained.load(str(d), max_len=16)


def test_truncated_gguf_names_the_file(tmp_path):
  path = tmp_path / 'short.gguf'
  with open(assets.smollm2_gguf_path(), 'rb') as f:
    path.write_bytes(f.read(3_000_000))  # header and metadata intact, tensor data cut
  with pytest.raises(ValueError, match=f'{re.escape(str(path))}: not a readable GGUF file'):
    gguf_loader.load_gguf(path, max_len=16)
  with pytest.raises(ValueError, match=re.escape(str(path))):
    pretrained.load(str(path), max_len=16)


def test_unread_tensors_are_listed(tmp_path):
  d = copy_dir(tmp_path)
  tensors = load_file(str(d / 'model.safetensors'))
  tensors['model.layers.0.self_attn.o_proj.bias'] = np.zeros(64, np.float32)
  tensors['model.extra_head.weight'] = np.zeros((2, 2), np.float32)
  tensors['model.rotary_emb.inv_freq'] = np.ones(8, np.float32)  # known non-weight: allowed
  save_file(tensors, str(d / 'model.safetensors'))
  with pytest.raises(ValueError, match=r"2 tensors the config does not use .*"
                                       r"'model.extra_head.weight', "
                                       r"'model.layers.0.self_attn.o_proj.bias'"):
    hf_loader.load_hf_dir(d, max_len=16)


def test_missing_tensor_is_named(tmp_path):
  d = copy_dir(tmp_path)
  tensors = load_file(str(d / 'model.safetensors'))
  del tensors['model.layers.1.mlp.up_proj.weight']
  save_file(tensors, str(d / 'model.safetensors'))
  with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['model.layers.1.mlp.up_proj"):
    hf_loader.load_hf_dir(d, max_len=16)


def test_max_len_beyond_max_position_embeddings_is_refused(tmp_path):
  where = re.escape(str(LLAMA / 'config.json'))
  with pytest.raises(ValueError, match=f'max_len=129 exceeds .*max_position_embeddings=128 in '
                                       f'{where}'):
    hf_loader.load_hf_dir(LLAMA, max_len=129)
  assert pretrained.load(str(LLAMA), max_len=128).cfg.max_len == 128
  # The cached first load used max_len=1; the limit is still applied to later calls.
  with pytest.raises(ValueError, match=f'max_len=129 exceeds .*max_position_embeddings=128'):
    pretrained.load(str(LLAMA), max_len=129)


def sliding_qwen2(**changes):
  hf = json.loads((FIXTURES / 'qwen2' / 'config.json').read_text())
  hf.update(changes)
  return hf


def test_sliding_window_shorter_than_max_len_is_refused(tmp_path):
  hf = sliding_qwen2(use_sliding_window=True, sliding_window=32, max_window_layers=1,
                     layer_types=None)
  with pytest.raises(ValueError, match=r'max_len=64 exceeds .*sliding_window=32 on layers \[1\]'):
    hf_loader.config_from_hf(hf, max_len=64)
  assert hf_loader.config_from_hf(hf, max_len=32).max_len == 32
  hf = sliding_qwen2(use_sliding_window=True, sliding_window=16,
                     layer_types=['sliding_attention', 'full_attention'])
  with pytest.raises(ValueError, match=r'sliding_window=16 on layers \[0\]'):
    hf_loader.config_from_hf(hf, max_len=17)
  with pytest.raises(hf_loader.ConfigError, match='layer_types must be 2 of'):
    hf_loader.config_from_hf(sliding_qwen2(layer_types=['full_attention']), max_len=8)
  d = copy_dir(tmp_path, FIXTURES / 'qwen2',
               config=sliding_qwen2(use_sliding_window=True, sliding_window=24,
                                    layer_types=['full_attention', 'sliding_attention']))
  assert pretrained.load(str(d), max_len=24).cfg.max_len == 24
  with pytest.raises(ValueError, match=r'max_len=25 exceeds .*sliding_window=24 on layers \[1\]'):
    pretrained.load(str(d), max_len=25)


def test_smollm2_max_len_beyond_gguf_context_is_refused():
  with pytest.raises(ValueError, match=r'max_len=32768 exceeds .*llama.context_length=8192'):
    pretrained.load('smollm2', max_len=32768)
  assert pretrained.load('smollm2', max_len=8192).cfg.max_len == 8192


def test_decode_refuses_out_of_vocabulary_ids():
  tok = Tokenizer.from_hf_dir(LLAMA)
  assert tok.vocab_size == 320
  assert tok.decode([40, 41]) == tok.decode(np.array([40, 41]))
  with pytest.raises(ValueError, match=r'ids outside the vocabulary \(vocab_size=320\).*320'):
    tok.decode([40, 320])
  with pytest.raises(ValueError, match='non-negative'):
    tok.decode([-1])


@pytest.mark.parametrize('content', [None, ['a list'], 3, {'text': 'x'}])
def test_render_chat_refuses_non_string_content(content):
  tok = Tokenizer.from_hf_dir(LLAMA)
  msgs = [{'role': 'system', 'content': 'ok'}, {'role': 'user', 'content': content}]
  with pytest.raises(ValueError, match=r"messages\[1\] \(role 'user'\): content must be a str"):
    tok.render_chat(msgs)
