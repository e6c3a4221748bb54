"""Tests for experiments.models.tokenizer against the built-in SmolLM2 GGUF tokenizer."""

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from experiments.models import assets
from experiments.models.tokenizer import Tokenizer, build_bpe, from_gguf_metadata

SYSTEM = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face'
QUESTION = 'What is the capital of France?'
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

ROUND_TRIP = [
    '', 'a', 'Hello, world!', 'café naïve résumé Ångström', '日本語のテキスト 中文',
    '🙂👍🏽 family: 👨‍👩‍👧‍👦', 'שלום עולם مرحبا بالعالم', 'digits 12345 and 3.14159',
    '  leading and trailing  ', '\ttabs\tand\t\ttabs', 'lines\n\n\nmany\r\n',
    '   ', '\n', 'def f(x):\n    return {"a": [x ** 2, x // 3]}  # comment\n',
    "it's they're we've I'm you'll he'd", 'ALLCAPS MiXeD', 'Ĉ Ġ ĠParis',
]


@pytest.fixture(scope='module')
def reader():
  return gguf.GGUFReader(str(assets.smollm2_gguf_path()))  # Slow (seconds): open once.


@pytest.fixture(scope='module')
def tok(reader):
  return Tokenizer.from_gguf(reader)


@pytest.fixture(scope='module')
def gguf_meta(reader):
  keys = ('tokenizer.ggml.tokens', 'tokenizer.ggml.bos_token_id',
          'tokenizer.ggml.eos_token_id', 'tokenizer.ggml.padding_token_id')
  return {k: reader.fields[k].contents() for k in keys}


def test_ids(tok, gguf_meta):
  tokens = gguf_meta['tokenizer.ggml.tokens']
  assert tok.vocab_size == len(tokens) == 49152
  assert tok.bos_id == gguf_meta['tokenizer.ggml.bos_token_id'] == 1
  assert tok.eos_id == gguf_meta['tokenizer.ggml.eos_token_id'] == 2
  assert tokens[tok.eos_id] == '<|im_end|>'
  assert tok.pad_id == 2
  assert tok.stop_ids == (2, 0)
  assert tokens[0] == '<|endoftext|>'


@pytest.mark.parametrize('text', ROUND_TRIP)
def test_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(np.array(ids, np.int32)) == text


# SmolLM2's vocabulary lacks 21 of the 256 byte symbols: six ASCII control bytes,
# bytes that never occur in UTF-8, and lead bytes F1/F2 (the unassigned planes 4-11).
# Such characters are dropped on encode, as by Hugging Face's tokenizer for it.
UNENCODABLE_ASCII = '\x04\x06\x13\x14\x16\x1d'


@settings(max_examples=60)
@given(st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=('Cs',),
                             exclude_characters=UNENCODABLE_ASCII),
               max_size=60))
def test_round_trip_random(tok, text):
  assert tok.decode(tok.encode(text), skip_special=False) == text


def test_unencodable_bytes_are_dropped(tok):
  # U+40000 is F1 80 80 80: the lead byte has no token, the continuations ('Ģ') do.
  assert tok.encode('\U00040000') == [tok.token_to_id('Ģ')] * 3
  assert tok.decode(tok.encode('a\U00040000b')) == 'a\ufffd\ufffd\ufffdb'
  assert tok.decode(tok.encode('a\x04b')) == 'ab'


def test_digits_are_single_tokens(tok):
  assert len(tok.encode('12345')) == 5
  assert [tok.decode([i]) for i in tok.encode('2024')] == ['2', '0', '2', '4']


def test_known_encodings(tok):
  (paris,) = tok.encode(' Paris')
  assert tok.id_to_token(paris) == 'ĠParis'
  assert tok.token_to_id('ĠParis') == paris
  assert len(tok.encode(' the')) == 1
  assert tok.encode('\n') == [tok.token_to_id('Ċ')]
  assert tok.encode('Paris') != tok.encode(' Paris')  # No prefix space is added.


def test_special_tokens(tok, gguf_meta):
  tokens = gguf_meta['tokenizer.ggml.tokens']
  assert tok.encode('<|im_start|>') == [tokens.index('<|im_start|>')] == [1]
  assert tok.encode('<|im_end|>') == [2]
  ids = tok.encode('<|im_start|>user\nhi<|im_end|>')
  assert ids[0] == 1 and ids[-1] == 2
  assert tok.decode(ids) == 'user\nhi'
  assert tok.decode(ids, skip_special=False) == '<|im_start|>user\nhi<|im_end|>'


def test_chat_template(tok):
  text = tok.render_chat([{'role': 'user', 'content': QUESTION}])
  assert text == (f'<|im_start|>system\n{SYSTEM}<|im_end|>\n'
                  f'<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n')
  no_prompt = tok.render_chat([{'role': 'user', 'content': QUESTION}], add_generation_prompt=False)
  assert no_prompt == text[:-len('<|im_start|>assistant\n')]
  custom = tok.render_chat([{'role': 'system', 'content': 'Be brief.'},
                            {'role': 'user', 'content': QUESTION}])
  assert custom == ('<|im_start|>system\nBe brief.<|im_end|>\n'
                    f'<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n')
  ids = tok.encode_chat([{'role': 'user', 'content': QUESTION}])
  assert ids == tok.encode(text)
  assert ids[0] == 1 and ids[-4:] == [1] + tok.encode('assistant\n')
  assert ids.count(tok.eos_id) == 2  # Each finished turn ends with eos_id.


def test_chat_template_bad_input(tok):
  with pytest.raises(ValueError, match='role'):
    tok.render_chat([{'content': 'no role'}])
  with pytest.raises(ValueError, match='chat template'):
    _toy(chat_template=None).render_chat([{'role': 'user', 'content': 'x'}])


def test_jinja_helpers():
  template = ("{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
              "{{ bos_token }}{{ messages[0] | tojson }}{{ strftime_now('%Y')|length }}"
              "{% for m in messages %}{% if true %}{% break %}{% endif %}{% endfor %}"
              "{% generation %}!{% endgeneration %}")
  t = _toy(chat_template=template, bos='<|im_start|>')
  assert t.render_chat([{'role': 'user', 'content': 'é'}]) == (
      '<|im_start|>{"role": "user", "content": "é"}4!')
  with pytest.raises(Exception, match='only one message'):
    t.render_chat([{'role': 'user', 'content': 'a'}, {'role': 'user', 'content': 'b'}])


def test_encode_batch(tok):
  texts = ['Hello there, friend.', 'Hi', ' Paris']
  ids, lengths = tok.encode_batch(texts)
  assert ids.dtype == np.int32 and lengths.dtype == np.int32
  assert ids.shape == (3, max(lengths))
  for row, text in enumerate(texts):
    want = tok.encode(text)
    assert lengths[row] == len(want)
    assert ids[row, :len(want)].tolist() == want
    assert (ids[row, len(want):] == tok.pad_id).all()
  fixed, _ = tok.encode_batch(texts, length=12)
  assert fixed.shape == (3, 12) and (fixed[:, :ids.shape[1]] == ids).all()


def test_encode_batch_bad_input(tok):
  with pytest.raises(ValueError, match='row 1.*longer than length=3'):
    tok.encode_batch(['a', 'a much longer piece of text'], length=3)
  with pytest.raises(ValueError, match='row 2.*no tokens'):
    tok.encode_batch(['a', 'b', ''])
  with pytest.raises(ValueError, match='non-empty list'):
    tok.encode_batch([])
  with pytest.raises(ValueError, match='non-empty list'):
    tok.encode_batch('a string')


def test_truncate_at_stop(tok):
  body = tok.encode('The answer is Paris.')
  assert tok.truncate_at_stop(body + [2] + body) == (body + [2], True)
  assert tok.truncate_at_stop(np.array(body + [0, 5], np.int64)) == (body + [0], True)
  assert tok.truncate_at_stop(body) == (body, False)
  assert tok.truncate_at_stop([]) == ([], False)


def test_encode_bad_input(tok):
  with pytest.raises(ValueError, match='surrogate'):
    tok.encode('a\ud800')
  with pytest.raises(ValueError, match='row 1.*surrogate'):
    tok.encode_batch(['a', '\udfff'])
  with pytest.raises(ValueError, match='expects a str'):
    tok.encode(b'bytes')


def test_decode_bad_input(tok):
  with pytest.raises(ValueError, match='non-negative'):
    tok.decode([1, -1])
  with pytest.raises(ValueError, match='1-D'):
    tok.decode([[1, 2]])


def test_decode_refuses_ids_outside_vocab(tok):
  with pytest.raises(ValueError, match=r'outside the vocabulary \(vocab_size=49152\): 49152, 70000'):
    tok.decode([5, 49152, 70000, 49152])
  with pytest.raises(ValueError, match=r'49152, .*\(12 distinct\)'):
    tok.decode(np.arange(49152, 49164))
  # Pad / eos / bos and the last id stay decodable.
  assert tok.decode([tok.pad_id, tok.eos_id, tok.bos_id]) == ''
  assert tok.decode([tok.vocab_size - 1]) == tok.decode(np.array([tok.vocab_size - 1], np.int64))


def test_chat_content_must_be_str(tok):
  ok = {'role': 'user', 'content': 'hi'}
  with pytest.raises(ValueError, match=r"messages\[1\] \(role 'assistant'\).*got NoneType"):
    tok.render_chat([ok, {'role': 'assistant', 'content': None}])
  with pytest.raises(ValueError, match=r'messages\[0\].*got list'):
    tok.render_chat([{'role': 'user', 'content': [{'type': 'text', 'text': 'hi'}]}, ok])
  with pytest.raises(ValueError, match=r'messages\[2\].*got no content'):
    tok.encode_chat([ok, ok, {'role': 'user'}])


def _truncate(path, keep=0.5):
  data = path.read_bytes()
  path.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize('name', ['tokenizer.json', 'tokenizer_config.json',
                                  'generation_config.json', 'config.json'])
def test_corrupt_hf_files_are_named(name, tmp_path):
  t = _toy()
  t.save_hf_dir(tmp_path)
  (tmp_path / 'config.json').write_text('{"vocab_size": 300}')
  assert Tokenizer.from_hf_dir(tmp_path).vocab_size == 300
  _truncate(tmp_path / name)
  with pytest.raises(ValueError, match=f'{name}: not (a )?valid'):
    Tokenizer.from_hf_dir(tmp_path)


def test_bad_hf_files_are_named(tmp_path):
  t = _toy()
  t.save_hf_dir(tmp_path)
  (tmp_path / 'generation_config.json').write_text('[1, 2]')
  with pytest.raises(ValueError, match='generation_config.json: expected a JSON object, got list'):
    Tokenizer.from_hf_dir(tmp_path)
  t.save_hf_dir(tmp_path / 'b')
  config = tmp_path / 'b' / 'tokenizer_config.json'
  config.write_text(config.read_text().replace('"<|endoftext|>"', '"<nope>"'))
  with pytest.raises(ValueError, match=r"b: eos token '<nope>' is not in the vocabulary"):
    Tokenizer.from_hf_dir(tmp_path / 'b')


def test_truncated_gguf_is_named(tmp_path):
  path = tmp_path / 'tok.gguf'
  writer = gguf.GGUFWriter(str(path), 'llama')
  writer.add_tokenizer_model('gpt2')
  writer.add_token_list(['<|endoftext|>'] + sorted(pre_tokenizers.ByteLevel.alphabet()))
  writer.add_eos_token_id(0)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  assert Tokenizer.from_gguf(path).vocab_size == 257
  _truncate(path, 0.6)
  with pytest.raises(ValueError, match='tok.gguf: not a readable GGUF file'):
    Tokenizer.from_gguf(path)


def test_hf_dir_round_trip(tok, tmp_path):
  tok.save_hf_dir(tmp_path)
  again = Tokenizer.from_hf_dir(tmp_path)
  for text in ROUND_TRIP + ['<|im_start|>user\nhi<|im_end|>', '<jupyter_code>x = 1']:
    assert again.encode(text) == tok.encode(text)
  ids = tok.encode('<|im_start|>assistant\nParis 2024 🙂<|im_end|>')
  assert again.decode(ids) == tok.decode(ids)
  assert again.decode(ids, skip_special=False) == tok.decode(ids, skip_special=False)
  chat = [{'role': 'user', 'content': QUESTION}]
  assert again.render_chat(chat) == tok.render_chat(chat)
  assert again.chat_template == tok.chat_template
  for attr in ('vocab_size', 'bos_id', 'eos_id', 'stop_ids', 'pad_id'):
    assert getattr(again, attr) == getattr(tok, attr), attr


def test_hf_dir_generation_config(tok, tmp_path):
  """eos_token_id in generation_config.json may be an int or a list; all are stops."""
  tok.save_hf_dir(tmp_path)
  (tmp_path / 'generation_config.json').write_text('{"eos_token_id": 5}')
  assert Tokenizer.from_hf_dir(tmp_path).stop_ids == (2, 5, 0)
  (tmp_path / 'generation_config.json').write_text('{"eos_token_id": [7, 2]}')
  assert Tokenizer.from_hf_dir(tmp_path).stop_ids == (2, 7, 0)
  with pytest.raises(FileNotFoundError, match='tokenizer.json'):
    Tokenizer.from_hf_dir(tmp_path / 'missing')


# -- fake metadata: other pre-tokenizers, eos choice, unsupported models ----------------


def _toy(pre='qwen2', chat_template=CHATML, eos='<|endoftext|>', bos=None, merges=()):
  """Tiny byte-level BPE tokenizer: the 256 byte symbols, a few merges, two controls."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  merged = [m.replace(' ', '') for m in merges]
  tokens = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', *alphabet, *merged]
  meta = {'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.pre': pre,
          'tokenizer.ggml.tokens': tokens,
          'tokenizer.ggml.token_type': [3, 3, 3] + [1] * (len(tokens) - 3),
          'tokenizer.ggml.merges': list(merges),
          'tokenizer.ggml.eos_token_id': tokens.index(eos)}
  if bos is not None:
    meta['tokenizer.ggml.bos_token_id'] = tokens.index(bos)
  if chat_template is not None:
    meta['tokenizer.chat_template'] = chat_template
  return from_gguf_metadata(meta)


@pytest.mark.parametrize('pre', ['qwen2', 'llama-bpe', 'default', 'gpt-2', 'smollm'])
def test_other_pre_tokenizers(pre):
  t = _toy(pre, merges=['Ġ t', 'Ġt h', '1 2'])
  for text in ROUND_TRIP:
    assert t.decode(t.encode(text)) == text
  assert t.encode(' th') == [t.token_to_id('Ġth')]
  # qwen2 / smollm split digits one by one, so the '12' merge never applies.
  assert len(t.encode('12345')) == (5 if pre in ('qwen2', 'smollm') else 4)
  assert t.encode('<|im_end|>') == [2]


def test_eos_is_chat_turn_end():
  """A base model declaring <|endoftext|> still stops chat turns at <|im_end|>."""
  t = _toy(eos='<|endoftext|>')
  assert (t.eos_id, t.stop_ids, t.pad_id) == (2, (2, 0), 0)
  plain = _toy(eos='<|endoftext|>', chat_template=None)
  assert (plain.eos_id, plain.stop_ids) == (0, (0, 2))


def test_unsupported_models(tmp_path):
  with pytest.raises(NotImplementedError, match="pre-tokenizer 'deepseek-llm'"):
    _toy('deepseek-llm')
  with pytest.raises(NotImplementedError, match="pre-tokenizer 'x'"):
    build_bpe(['a'], [1], [], 'x')
  path = tmp_path / 'spm.gguf'
  writer = gguf.GGUFWriter(str(path), 'llama')
  writer.add_tokenizer_model('llama')
  writer.add_token_list(['<unk>', '<s>', '</s>', '▁a'])
  writer.add_token_types([2, 3, 3, 1])
  writer.add_eos_token_id(2)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(NotImplementedError, match="tokenizer model 'llama' not supported"):
    Tokenizer.from_gguf(path)
