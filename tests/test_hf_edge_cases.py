"""Checkpoint directories a loader can misread without a word (issue 44), each in both
config layouts, plain (`hf_loader.load_hf_dir`) and onto a mesh (`sharded_load`),
against transformers' numbers (tests/fixtures/hf/, `make_hf_fixtures.write_edge_cases`):

- llama_tied_head: tie_word_embeddings with a different stored lm_head.weight:
  transformers >= 5 loads the stored head untied, and so do we (with a warning);
  an equal stored copy is dropped and the model stays tied.
- qwen3_index_and_single: model.safetensors beside model.safetensors.index.json whose
  shards hold other weights: refused, naming both files.
- qwen2_stale_layer_types: layer_types marks a sliding layer but use_sliding_window is
  false: no window (transformers' configs set sliding_window to None), full attention.
"""

import pathlib
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from experiments.models import decoder, hf_loader, sharded_load
from experiments.training import train_step as ts

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
LAYOUTS = ['', '_v4']
MAX_LEN = 64  # longer than qwen2_stale_layer_types' stale window of 4
_forward = jax.jit(decoder.forward, static_argnums=1)


def load(path, sharded):
  if sharded:
    return sharded_load.load_hf_dir_sharded(path, ts.make_mesh(1, jax.devices()[:1]),
                                            max_len=MAX_LEN)
  return hf_loader.load_hf_dir(path, max_len=MAX_LEN)


def assert_transformers_logits(params, cfg, name):
  ref = np.load(FIXTURES / f'{name}.npz')
  logits = np.asarray(_forward(params, cfg, jnp.asarray(ref['ids'])))
  scale = float(np.abs(ref['logits']).max())
  for i, n in enumerate(ref['lengths']):
    want = ref['logits'][i, :n]
    assert np.abs(logits[i, :n] - want).max() < 1e-4 * scale, (name, i)
    np.testing.assert_array_equal(logits[i, :n].argmax(-1), want.argmax(-1))


@pytest.mark.parametrize('sharded', [False, True], ids=['plain', 'mesh'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_tied_config_with_a_different_stored_head_loads_it_untied(layout, sharded):
  with pytest.warns(UserWarning, match='lm_head.weight differs from model.embed_tokens'):
    params, cfg, hf = load(FIXTURES / f'llama_tied_head{layout}', sharded)
  assert hf['tie_word_embeddings'] and not cfg.tie_embeddings
  stored = load_file(str(FIXTURES / f'llama_tied_head{layout}' / 'model.safetensors'))
  np.testing.assert_array_equal(np.asarray(params['head']['kernel']).T, stored['lm_head.weight'])
  assert_transformers_logits(params, cfg, 'llama_tied_head')


@pytest.mark.parametrize('sharded', [False, True], ids=['plain', 'mesh'])
def test_tied_config_with_an_equal_stored_head_stays_tied(tmp_path, sharded):
  d = tmp_path / 'tied_copy'
  shutil.copytree(FIXTURES / 'llama_tied', d)
  t = load_file(str(d / 'model.safetensors'))
  t['lm_head.weight'] = t['model.embed_tokens.weight'].copy()
  save_file(t, str(d / 'model.safetensors'), metadata={'format': 'pt'})
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    params, cfg, _ = load(d, sharded)
  assert cfg.tie_embeddings and 'head' not in params
  assert_transformers_logits(params, cfg, 'llama_tied')
  # One element off is a different head.
  t['lm_head.weight'][3, 5] += 1.0
  save_file(t, str(d / 'model.safetensors'), metadata={'format': 'pt'})
  with pytest.warns(UserWarning, match='loading the stored head untied'):
    assert not load(d, sharded)[1].tie_embeddings


@pytest.mark.parametrize('sharded', [False, True], ids=['plain', 'mesh'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_single_file_beside_a_shard_index_is_refused(layout, sharded):
  d = FIXTURES / f'qwen3_index_and_single{layout}'
  assert sorted(p.name for p in d.glob('model*'))[-2:] == ['model.safetensors',
                                                           'model.safetensors.index.json']
  with pytest.raises(ValueError, match=r'both model\.safetensors and '
                                       r'model\.safetensors\.index\.json'):
    load(d, sharded)


def test_shards_alone_and_stray_files_still_load(tmp_path):
  """Without model.safetensors the index's shards load; a stray *.safetensors the index does
  not name is ignored, as transformers ignores it."""
  d = tmp_path / 'shards'
  shutil.copytree(FIXTURES / 'qwen3_index_and_single', d)
  (d / 'model.safetensors').rename(d / 'old-copy.safetensors')
  params, cfg, _ = load(d, sharded=False)
  ref, _, _ = hf_loader.load_hf_dir(FIXTURES / 'qwen3', max_len=MAX_LEN)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.float32(0.5) * b), params, ref)


@pytest.mark.parametrize('sharded', [False, True], ids=['plain', 'mesh'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_stale_sliding_layer_types_without_use_sliding_window_is_full_attention(layout, sharded):
  d = FIXTURES / f'qwen2_stale_layer_types{layout}'
  params, cfg, hf = load(d, sharded)
  assert 'sliding_attention' in hf['layer_types'] and hf['sliding_window'] < MAX_LEN
  assert hf_loader.sliding_layers(hf) == ([], 4)
  assert_transformers_logits(params, cfg, 'qwen2_stale_layer_types')
  # With use_sliding_window the same layer_types is a window, refused beyond it.
  with pytest.raises(ValueError, match=r'sliding_window=4 on layers \[1\]'):
    hf_loader.config_from_hf(dict(hf, use_sliding_window=True), max_len=MAX_LEN)


def test_llama_ignores_layer_types():
  hf = hf_loader.read_config(FIXTURES / 'llama_tied' / 'config.json')
  hf.update(layer_types=['sliding_attention'] * 2, sliding_window=4, use_sliding_window=True)
  assert hf_loader.sliding_layers(hf) == ([], 4)
