"""Writes tests/fixtures/hf/: tiny random transformers checkpoints and their logits.

    python -m experiments.make_hf_fixtures    # needs torch + transformers (>= 5) + this package
    python -c 'from experiments import make_hf_fixtures as m; m.write_edge_cases()'  # EDGE_CASES only

Not part of the test run (it needs torch), like `make_parity_fixture.py`. For each
architecture / RoPE variant in `MODELS` it builds a 2-layer, hidden-64 model with
transformers, sets its weights from N(0, 0.25^2) (norm weights 1 + N(0, 0.3^2),
biases N(0, 0.3^2), so a dropped bias or a wrong norm shows), and writes:
  tests/fixtures/hf/<name>/      save_pretrained (safetensors), the 5.x config layout
                                 (`rope_parameters`), a 320-token byte-level BPE
                                 trained here with `tokenizers`, a ChatML template;
  tests/fixtures/hf/<name>_v4/   the same weights with config.json in the 4.x layout
                                 (top-level rope_theta / rope_scaling; `linear` uses
                                 the old `type` key);
  tests/fixtures/hf/<name>.npz   transformers' float32 logits [N, T, V] on the four
                                 prompts, their ids, and 16 greedy tokens after the
                                 chat prompt.
It checks that transformers gives identical logits for both layouts, that RoPE
scaling changes the logits (so the fixture can fail a loader that ignores it) and
that no greedy step or prompt position is a near-tie. Then it checks export: our
loader's params written back with `hf_loader.save_hf_dir` (both layouts, and with
LoRA adapters merged) reload in transformers with our logits; it prints the
max |delta logit| of each comparison. tests/test_hf_parity.py reads the fixtures.
"""

import copy
import json
import pathlib
import shutil
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / 'tests' / 'fixtures' / 'hf'
VOCAB = 320
SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SENTENCES = [
    'The capital of France is Paris, and the capital of Japan is Tokyo.',
    'Reinforcement learning from verifiable rewards samples several responses to each prompt.',
    'Tree-structured rollouts share prefixes between responses.',
    'Compute 12 + 345 = 357. What is 7 times 8? It is 56.',
    'The value of each shared prefix can be estimated from the responses below it.',
    'A small model learns to add numbers, one digit at a time, on a laptop.',
    'user assistant system: answer briefly and explain your reasoning.',
    'What is the capital of France? Compute 12 + 345 = ? Café',
]
CHAT = [{'role': 'user', 'content': 'What is the capital of France?'}]
TEXTS = ['The capital of France is', None,  # None: CHAT rendered by transformers' template
         'Compute 12 + 345 = ?\n\tCafé ☕  ',
         'Tree-structured rollouts share the value of each prefix.']
GREEDY_TOKENS = 16
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=80, max_position_embeddings=128, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=2, pad_token_id=0)
LLAMA3 = dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16, rope_theta=500000.0)
# name -> (model_type, config kwargs beyond COMMON, 4.x file uses the old `type` key).
MODELS = {
    'llama_tied': ('llama', dict(tie_word_embeddings=True), False),
    'llama_untied': ('llama', dict(rope_parameters=dict(rope_type='default', rope_theta=1e5)),
                     False),
    'llama_linear': ('llama', dict(rope_parameters=dict(rope_type='linear', factor=4.0,
                                                        rope_theta=10000.0),
                                   tie_word_embeddings=True), True),
    'llama_llama3': ('llama', dict(rope_parameters=LLAMA3, tie_word_embeddings=True), False),
    'llama_attn_bias': ('llama', dict(attention_bias=True, tie_word_embeddings=True), False),
    'llama_mlp_bias': ('llama', dict(mlp_bias=True, tie_word_embeddings=True), False),
    'qwen2': ('qwen2', dict(rope_parameters=dict(rope_type='default', rope_theta=1e6)), False),
    'qwen3': ('qwen3', dict(head_dim=24, rope_parameters=dict(rope_type='default', rope_theta=1e6),
                            tie_word_embeddings=True), False),
}


def train_tokenizer():
  """A byte-level BPE of VOCAB tokens trained on SENTENCES (ids 0-2 = SPECIAL)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES * 4, trainer)
  assert [tok.token_to_id(s) for s in SPECIAL] == [0, 1, 2]
  return tok


def hf_tokenizer(tok):
  from transformers import PreTrainedTokenizerFast
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|im_end|>',
                                 pad_token='<|endoftext|>')
  fast.chat_template = CHATML
  return fast


def build(model_type, kwargs, vocab, seed):
  """A transformers model with large random weights (float32, eval mode)."""
  import torch
  import transformers
  cls = {'llama': transformers.LlamaConfig, 'qwen2': transformers.Qwen2Config,
         'qwen3': transformers.Qwen3Config}[model_type]
  config = cls(vocab_size=vocab, **COMMON, **kwargs)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if name.endswith('norm.weight'):
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith('.bias'):
        p.copy_(0.3 * noise)
      else:
        p.copy_(0.25 * noise)
  return model.eval()


def v4_config(config: dict, old_type_key: bool) -> dict:
  """A transformers-5 config.json rewritten in the 4.x layout (rope_theta + rope_scaling)."""
  c = copy.deepcopy(config)
  rope = dict(c.pop('rope_parameters'))
  c['rope_theta'] = rope.pop('rope_theta')
  kind = rope.pop('rope_type')
  c['rope_scaling'] = None if kind == 'default' else {('type' if old_type_key else 'rope_type'):
                                                      kind, **rope}
  if 'dtype' in c:  # transformers 4 called it torch_dtype
    c['torch_dtype'] = c.pop('dtype')
  return c


def logits_of(model, ids):
  """[T, V] float32 logits of each id list, one unpadded forward per prompt."""
  import torch
  with torch.inference_mode():
    return [model(torch.tensor([row])).logits[0].float().numpy() for row in ids]


def greedy(model, ids, n):
  """n greedy tokens (full forward each step, no EOS stop) and each step's top-2 margin."""
  import torch
  seq, margins = list(ids), []
  with torch.inference_mode():
    for _ in range(n):
      lg = model(torch.tensor([seq])).logits[0, -1].float().numpy()
      top = np.sort(lg)[-2:]
      margins.append(float(top[1] - top[0]))
      seq.append(int(lg.argmax()))
  return seq[len(ids):], min(margins)


def load(path):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def max_delta(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def scale_of(logits):
  return max(float(np.abs(x).max()) for x in logits)


def write_fixtures():
  import torch
  import transformers
  torch.set_num_threads(2)
  if OUT.exists():
    shutil.rmtree(OUT)
  OUT.mkdir(parents=True)
  tok = train_tokenizer()
  fast = hf_tokenizer(tok)
  texts = [t if t is not None else fast.apply_chat_template(CHAT, add_generation_prompt=True,
                                                            tokenize=False) for t in TEXTS]
  ids = [fast(t, add_special_tokens=False)['input_ids'] for t in texts]
  assert all(tok.decode(r, skip_special_tokens=False) == t for r, t in zip(ids, texts))
  print(f'vocab {tok.get_vocab_size()}, prompt lengths {[len(r) for r in ids]}')
  for index, (name, (model_type, kwargs, old_type)) in enumerate(MODELS.items()):
    for seed in range(100 * index, 100 * index + 50):  # the first seed without near-ties
      model = build(model_type, kwargs, tok.get_vocab_size(), seed)
      ref = logits_of(model, ids)
      scale = scale_of(ref)
      margin = min(float(np.diff(np.sort(x, -1)[:, -2:], axis=-1).min()) for x in ref)
      gen, gen_margin = greedy(model, ids[1], GREEDY_TOKENS)
      # A logit error below 1e-4 * scale cannot flip an argmax with a larger margin than 2x that.
      if min(margin, gen_margin) > 3e-4 * scale:
        break
    else:
      raise RuntimeError(f'{name}: every seed has a near-tie')
    d5 = OUT / name
    model.save_pretrained(str(d5))
    fast.save_pretrained(str(d5))
    config = json.loads((d5 / 'config.json').read_text())
    assert 'rope_parameters' in config and 'rope_theta' not in config, config
    d4 = with_v4(d5, old_type)
    for d in (d5, d4):
      again = logits_of(load(d), ids)
      assert max_delta(again, ref) == 0.0, (d, max_delta(again, ref))
    rope = config['rope_parameters']
    if rope['rope_type'] != 'default':  # scaling must matter, or the fixture tests nothing
      plain = json.loads(json.dumps(config))
      plain['rope_parameters'] = dict(rope_type='default', rope_theta=rope['rope_theta'])
      with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(d5, tmp, dirs_exist_ok=True)
        (pathlib.Path(tmp) / 'config.json').write_text(json.dumps(plain))
        unscaled = max_delta(logits_of(load(tmp), ids), ref)
      assert unscaled > 0.1 * scale, (name, unscaled, scale)
      print(f'  {name}: unscaled RoPE would move logits by {unscaled:.2f} (scale {scale:.1f})')
    save_npz(name, ids, texts, ref, gen)
    size = sum(f.stat().st_size for f in d5.rglob('*') if f.is_file())
    print(f'{name}: {model_type}, seed {seed}, logit scale {scale:.1f}, min top-2 margin '
          f'{min(margin, gen_margin):.3f}, dir {size / 1e3:.0f} kB, greedy {gen}')
  total = sum(f.stat().st_size for f in OUT.rglob('*') if f.is_file())
  print(f'wrote {OUT} ({total / 1e6:.2f} MB)')
  return ids


def check_export(ids):
  """Our loader -> save_hf_dir (4.x / 5.x layout, LoRA merged) -> transformers: same logits."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from experiments.models import decoder, hf_loader, pretrained
  t_max = max(map(len, ids))
  padded = np.zeros((len(ids), t_max), np.int32)
  for i, row in enumerate(ids):
    padded[i, :len(row)] = row

  def ours(params, cfg):
    out = np.asarray(decoder.forward(params, cfg, jnp.asarray(padded)))
    return [out[i, :len(row)] for i, row in enumerate(ids)]

  print('export: max |delta logit| (relative to the logit scale)')
  for seed, name in enumerate(MODELS):
    lm = pretrained.load(str(OUT / name), max_len=64)
    params, cfg, tok = lm.params, lm.cfg, lm.tokenizer
    mine = ours(params, cfg)
    ref = np.load(OUT / f'{name}.npz')
    hf_ref = [ref['logits'][i, :n] for i, n in enumerate(ref['lengths'])]
    scale = scale_of(hf_ref)
    row = [f'load {max_delta(mine, hf_ref):.2e}']
    lora_cfg = dataclasses.replace(cfg, lora_rank=4, lora_alpha=8.0)
    lora = decoder.add_lora(jax.random.PRNGKey(seed), params, lora_cfg)
    keys = iter(jax.random.split(jax.random.PRNGKey(100 + seed), 64))
    lora = jax.tree_util.tree_map_with_path(
        lambda p, x: 0.2 * jax.random.normal(next(keys), x.shape) if decoder.is_lora(p) else x,
        lora)
    mine_lora = ours(lora, lora_cfg)
    moved = max_delta(mine_lora, mine)
    assert moved > 0.05 * scale, (name, moved)  # the adapters matter
    with tempfile.TemporaryDirectory() as tmp:
      for label, p, c, want, layout in (('5.x', params, cfg, mine, '5'),
                                         ('4.x', params, cfg, mine, '4'),
                                         ('lora', lora, lora_cfg, mine_lora, '5')):
        out = pathlib.Path(tmp) / label
        hf_loader.save_hf_dir(out, p, c, tokenizer=tok, layout=layout,
                              max_position_embeddings=128)
        delta = max_delta(logits_of(load(out), ids), want)
        assert delta < 1e-4 * scale, (name, label, delta, scale)
        row.append(f'{label} {delta:.2e}')
    print(f'  {name}: scale {scale:.1f}; ' + ', '.join(row) + f' (LoRA moved logits {moved:.1f})')


# Checkpoint directories a loader can misread (issue 44): name -> (base fixture, how it is
# changed). Each also gets a _v4 copy and an .npz of transformers' numbers (as above).
EDGE_CASES = ('llama_tied_head', 'qwen3_index_and_single', 'qwen2_stale_layer_types')


def save_npz(name, ids, texts, ref, gen, note=None):
  """OUT/<name>.npz: the prompts' ids, transformers' logits [N, T, V], the greedy tokens."""
  import torch
  import transformers
  t_max = max(map(len, ids))
  padded = np.zeros((len(ids), t_max), np.int32)
  logits = np.zeros((len(ids), t_max, ref[0].shape[-1]), np.float32)
  for i, (row, lg) in enumerate(zip(ids, ref)):
    padded[i, :len(row)] = row
    logits[i, :len(row)] = lg
  np.savez_compressed(
      OUT / f'{name}.npz', ids=padded, lengths=np.array([len(r) for r in ids], np.int32),
      texts=np.array(texts), chat=np.array(json.dumps(CHAT)), logits=logits,
      greedy_prompt=np.int32(1), greedy_ids=np.array(gen, np.int32),
      versions=np.array(f'transformers {transformers.__version__}, torch {torch.__version__}'),
      **({} if note is None else {'note': np.array(note)}))


def _edit_safetensors(d, fn):
  from safetensors.numpy import load_file, save_file
  t = load_file(str(d / 'model.safetensors'))
  save_file(fn(t), str(d / 'model.safetensors'), metadata={'format': 'pt'})


def with_v4(d, old_type=False):
  """A copy of HF dir d as d_v4, its config.json in the 4.x layout (`v4_config`)."""
  d4 = d.parent / f'{d.name}_v4'
  if d4.exists():
    shutil.rmtree(d4)
  shutil.copytree(d, d4)
  config = json.loads((d / 'config.json').read_text())
  (d4 / 'config.json').write_text(json.dumps(v4_config(config, old_type), indent=2) + '\n')
  return d4


def write_edge_cases():
  """The EDGE_CASES fixtures, from the base fixtures on disk (run `write_fixtures` first)."""
  import jax

  from experiments.models import hf_loader
  tok_ids = np.load(OUT / 'llama_tied.npz')
  ids = [tok_ids['ids'][i, :n].tolist() for i, n in enumerate(tok_ids['lengths'])]
  texts = [str(t) for t in tok_ids['texts']]
  rng = np.random.default_rng(44)

  # 1. A tied config whose file also stores a different lm_head.weight: transformers >= 5
  #    warns, does not tie, and uses the stored head.
  d = OUT / 'llama_tied_head'
  shutil.rmtree(d, ignore_errors=True)
  shutil.copytree(OUT / 'llama_tied', d)
  _edit_safetensors(d, lambda t: dict(t, **{'lm_head.weight': rng.normal(
      0, 0.25, t['model.embed_tokens.weight'].shape).astype(np.float32)}))
  model = load(d)
  assert model.config.tie_word_embeddings
  assert not np.array_equal(model.lm_head.weight.detach().numpy(),
                            model.model.embed_tokens.weight.detach().numpy()), 'transformers tied'
  ref = logits_of(model, ids)
  tied = [r[:n] for r, n in zip(np.load(OUT / 'llama_tied.npz')['logits'], map(len, ids))]
  print(f'llama_tied_head: the stored head moves logits by {max_delta(ref, tied):.2f} '
        f'(scale {scale_of(ref):.1f})')
  gen, _ = greedy(model, ids[1], GREEDY_TOKENS)
  save_npz('llama_tied_head', ids, texts, ref, gen, 'transformers: stored head, untied')
  d4 = with_v4(d)
  assert max_delta(logits_of(load(d4), ids), ref) == 0.0

  # 2. model.safetensors beside a shard index whose shards hold other weights (halved):
  #    transformers loads model.safetensors; the loader refuses the directory.
  d = OUT / 'qwen3_index_and_single'
  shutil.rmtree(d, ignore_errors=True)
  shutil.copytree(OUT / 'qwen3', d)
  params, cfg, _ = hf_loader.load_hf_dir(OUT / 'qwen3', max_len=32)
  with tempfile.TemporaryDirectory() as tmp:
    hf_loader.save_hf_dir(tmp, jax.tree.map(lambda x: np.asarray(x) * 0.5, params), cfg,
                          shard_size=100_000)
    for f in pathlib.Path(tmp).iterdir():
      if f.name.startswith('model-') or f.name == 'model.safetensors.index.json':
        shutil.copy(f, d / f.name)
  ref = logits_of(load(d), ids)
  assert max_delta(ref, logits_of(load(OUT / 'qwen3'), ids)) == 0.0, 'read the shards'
  gen, _ = greedy(load(d), ids[1], GREEDY_TOKENS)
  save_npz('qwen3_index_and_single', ids, texts, ref, gen, 'transformers: model.safetensors')
  with_v4(d)

  # 3. layer_types marking a sliding layer while use_sliding_window is false: transformers'
  #    Qwen configs then set sliding_window to None (no window), but 5.25's forward fails
  #    building a sliding mask without a window; the numbers are full attention's, what the
  #    config resolves to (the window, 4, is shorter than the prompts, so it would matter).
  d = OUT / 'qwen2_stale_layer_types'
  shutil.rmtree(d, ignore_errors=True)
  shutil.copytree(OUT / 'qwen2', d)
  config = json.loads((d / 'config.json').read_text())
  config.update(use_sliding_window=False, sliding_window=4,
                layer_types=['full_attention', 'sliding_attention'])
  (d / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  try:
    logits_of(load(d), ids)
    print('qwen2_stale_layer_types: transformers runs it')
  except (ValueError, TypeError) as e:
    print(f'qwen2_stale_layer_types: transformers fails in forward: {type(e).__name__}: {e}')
  ref = logits_of(load(OUT / 'qwen2'), ids)
  windowed = dict(config, use_sliding_window=True)
  with tempfile.TemporaryDirectory() as tmp:
    shutil.copytree(d, tmp, dirs_exist_ok=True)
    (pathlib.Path(tmp) / 'config.json').write_text(json.dumps(windowed))
    moved = max_delta(logits_of(load(tmp), ids), ref)
  assert moved > 0.05 * scale_of(ref), moved
  print(f'  a window of 4 would move logits by {moved:.2f} (scale {scale_of(ref):.1f})')
  gen, _ = greedy(load(OUT / 'qwen2'), ids[1], GREEDY_TOKENS)
  save_npz('qwen2_stale_layer_types', ids, texts, ref, gen,
            'transformers 5.25 fails in forward; full attention (sliding_window resolves to None)')
  with_v4(d)


def main():
  ids = write_fixtures()
  check_export(ids)
  write_edge_cases()


if __name__ == '__main__':
  main()
