"""Host-side text tokenizer for pretrained models (GGUF or Hugging Face checkpoints).

Built on the Hugging Face `tokenizers` library (not `transformers`) and `jinja2`
for chat templates. A GGUF file's tokenizer metadata (llama.cpp's `tokenizer.ggml.*`
fields) is turned into the equivalent `tokenizers.Tokenizer`: byte-level BPE with
the pre-tokenizer named by `tokenizer.ggml.pre`, control tokens registered as
special added tokens. `save_hf_dir` / `from_hf_dir` use the Hugging Face file layout.

The primary end-of-sequence id (`eos_id`) is the special token the chat template
closes an assistant turn with (e.g. ChatML's `<|im_end|>`) when it has one, else
the declared eos; `stop_ids` adds every other id that ends a response.
"""

import datetime
import functools
import json
import os
import pathlib
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_PRE = ('default', 'gpt-2', 'gpt2')
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE = _GPT2_PRE + ('llama-bpe', 'smollm', 'qwen2')
# Tokens that end a response wherever a vocabulary has them.
_EXTRA_STOPS = ('<|im_end|>', '<|endoftext|>')
_TURN_MARK = 'Okay'  # Dummy assistant reply used to find a template's turn terminator.


class Tokenizer:
  """Text <-> token ids, chat rendering and batching for one pretrained model."""

  def __init__(self, tok: tokenizers.Tokenizer, *, vocab_size: int, eos_token: str,
               bos_token: str | None = None, pad_token: str | None = None,
               chat_template: str | None = None, extra_stop_ids: Iterable[int] = ()):
    tok.no_padding()
    tok.no_truncation()
    self._tok = tok
    self._special = frozenset(
        int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special)
    self.vocab_size = int(vocab_size)
    self.chat_template = chat_template
    self._eos_token, self._bos_token = eos_token, bos_token
    self._pad_token = pad_token if pad_token is not None else eos_token
    self._declared_eos = self._token_id(eos_token, 'eos')
    self.bos_id = None if bos_token is None else self._token_id(bos_token, 'bos')
    self.pad_id = self._token_id(self._pad_token, 'pad')
    turn_end = self._turn_end_id() if chat_template else None
    self.eos_id = self._declared_eos if turn_end is None else turn_end
    extra = [self._tok.token_to_id(t) for t in _EXTRA_STOPS]
    stops = [self.eos_id, self._declared_eos, *map(int, extra_stop_ids), *extra]
    self.stop_ids = tuple(dict.fromkeys(
        i for i in stops if i is not None and 0 <= i < self.vocab_size))

  def __repr__(self):
    return (f'Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, '
            f'eos_id={self.eos_id}, stop_ids={self.stop_ids}, pad_id={self.pad_id})')

  def _token_id(self, token: str, what: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f'{what} token {token!r} is not in the vocabulary')
    return i

  # -- text ---------------------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; adds no special tokens but parses special-token strings."""
    _check_text(text)
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids, skip_special: bool = True) -> str:
    """Text of `ids` (any int sequence or array); special tokens dropped if `skip_special`.

    Ids must lie in the model's id space [0, vocab_size), else ValueError naming them.
    Ids in it that the tokenizer has no string for (a model whose embedding has more
    rows than the tokenizer has tokens, e.g. Qwen2's padding rows) decode to nothing,
    as in Hugging Face's tokenizers.
    """
    ids = _as_id_list(ids)
    bad = sorted({i for i in ids if i >= self.vocab_size})
    if bad:
      shown = ', '.join(map(str, bad[:8])) + (f', ... ({len(bad)} distinct)' if len(bad) > 8
                                               else '')
      raise ValueError(f'ids outside the vocabulary (vocab_size={self.vocab_size}): {shown}')
    return self._tok.decode(ids, skip_special_tokens=skip_special)

  def token_to_id(self, token: str) -> int | None:
    """Id of a vocabulary string (e.g. 'ĠParis'), or None."""
    return self._tok.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    """Vocabulary string of an id, or None."""
    return self._tok.id_to_token(int(i))

  # -- chat ---------------------------------------------------------------------------

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                  **template_kwargs) -> str:
    """The chat template applied to `messages`, as Hugging Face's apply_chat_template."""
    if self.chat_template is None:
      raise ValueError('this tokenizer has no chat template')
    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, dict) and 'role' in m for m in messages):
      raise ValueError('messages must be a list of dicts with a "role" key')
    for i, m in enumerate(messages):
      if not isinstance(m.get('content'), str):
        got = 'no content' if 'content' not in m else type(m['content']).__name__
        raise ValueError(f'messages[{i}] (role {m["role"]!r}): content must be a str, got {got}')
    special = {'bos_token': self._bos_token, 'eos_token': self._eos_token,
               'pad_token': self._pad_token, 'tools': None, 'documents': None}
    return _compile(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        **{**special, **template_kwargs})

  def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the rendered chat."""
    return self.encode(self.render_chat(messages, add_generation_prompt))

  def _turn_end_id(self) -> int | None:
    """The special token the chat template closes an assistant turn with, if any."""
    chat = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': _TURN_MARK}]
    try:
      text = self.render_chat(chat, add_generation_prompt=False)
    except Exception:  # pylint: disable=broad-except  # Any template failure: no answer.
      return None
    at = text.rfind(_TURN_MARK)
    if at < 0:
      return None
    return next((i for i in self.encode(text[at + len(_TURN_MARK):]) if i in self._special),
                None)

  # -- batches ------------------------------------------------------------------------

  def encode_batch(self, texts: list[str],
                   length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int32 ids [B, P] (pad_id) and int32 lengths [B].

    P is the longest row, or `length` when given.
    """
    if isinstance(texts, str) or not texts:
      raise ValueError('encode_batch expects a non-empty list of str')
    for row, text in enumerate(texts):
      try:
        _check_text(text)
      except ValueError as e:
        raise ValueError(f'row {row}: {e}') from None
    rows = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
    lengths = np.array([len(r) for r in rows], np.int32)
    for row, n in enumerate(lengths):
      if n == 0:
        raise ValueError(f'row {row}: text encodes to no tokens')
      if length is not None and n > length:
        raise ValueError(f'row {row}: {n} tokens is longer than length={length}')
    width = int(lengths.max()) if length is None else int(length)
    out = np.full((len(rows), width), self.pad_id, np.int32)
    for row, r in enumerate(rows):
      out[row, :len(r)] = r
    return out, lengths

  def truncate_at_stop(self, ids) -> tuple[list[int], bool]:
    """`ids` up to and including the first stop id, and whether one was found."""
    ids = _as_id_list(ids)
    stops = set(self.stop_ids)
    for k, i in enumerate(ids):
      if i in stops:
        return ids[:k + 1], True
    return ids, False

  # -- files --------------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, path) -> 'Tokenizer':
    """Tokenizer from a GGUF file's `tokenizer.*` metadata.

    `path` may also be an open `gguf.GGUFReader` (opening one takes seconds; the
    weight loader can share it).
    """
    import gguf  # Only needed here.
    from experiments.models import gguf_loader
    reader = path if isinstance(path, gguf.GGUFReader) else gguf_loader.read(os.fspath(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith('tokenizer.')}
    return from_gguf_metadata(meta)

  @classmethod
  def from_hf_dir(cls, path) -> 'Tokenizer':
    """Tokenizer from a Hugging Face checkpoint folder.

    Reads tokenizer.json, tokenizer_config.json (chat_template, bos/eos/pad tokens;
    or chat_template.jinja / chat_template.json), generation_config.json
    (eos_token_id: an int or a list, all of them stop ids) and config.json's
    vocab_size when present (the model's id space may exceed the tokenizer's).
    """
    path = pathlib.Path(path)
    if not (path / 'tokenizer.json').is_file():
      raise FileNotFoundError(f'no tokenizer.json in {path}')
    try:
      tok = tokenizers.Tokenizer.from_file(str(path / 'tokenizer.json'))
    except Exception as e:  # pylint: disable=broad-except  # tokenizers raises bare Exception.
      raise ValueError(f'{path / "tokenizer.json"}: not a valid tokenizer.json '
                       f'(corrupt or truncated?): {e}') from e
    config = _read_json(path / 'tokenizer_config.json')
    gen = _read_json(path / 'generation_config.json')
    gen_eos = gen.get('eos_token_id')
    gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
    eos = _token_str(config.get('eos_token'))
    if eos is None:
      if not gen_eos:
        raise ValueError(f'{path}: no eos_token in tokenizer_config.json and no '
                         'eos_token_id in generation_config.json')
      eos = tok.id_to_token(int(gen_eos[0]))
    bos = _token_str(config.get('bos_token'))
    if bos is None and gen.get('bos_token_id') is not None:
      bos = tok.id_to_token(int(gen['bos_token_id']))
    pad = _token_str(config.get('pad_token'))
    if pad is None and gen.get('pad_token_id') is not None:
      pad = tok.id_to_token(int(gen['pad_token_id']))
    ids = list(tok.get_vocab(with_added_tokens=True).values())
    model = _read_json(path / 'config.json')
    model_vocab = model.get('vocab_size') or model.get('text_config', {}).get('vocab_size') or 0
    vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(ids) + 1, model_vocab)
    try:
      return cls(tok, vocab_size=vocab_size, eos_token=eos, bos_token=bos, pad_token=pad,
                 chat_template=_hf_chat_template(path, config), extra_stop_ids=gen_eos)
    except ValueError as e:
      raise ValueError(f'{path}: {e}') from e

  def save_hf_dir(self, path) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json.

    `from_hf_dir(path)` then reproduces this tokenizer. An existing
    generation_config.json keeps its other fields; eos_token_id becomes `stop_ids`.
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(path / 'tokenizer.json'))
    config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'add_bos_token': False,
              'bos_token': self._bos_token, 'eos_token': self._eos_token,
              'pad_token': self._pad_token, 'clean_up_tokenization_spaces': False}
    if self.chat_template is not None:
      config['chat_template'] = self.chat_template
    _write_json(path / 'tokenizer_config.json', config)
    gen = _read_json(path / 'generation_config.json')
    gen.update(eos_token_id=list(self.stop_ids), pad_token_id=self.pad_id)
    if self.bos_id is not None:
      gen['bos_token_id'] = self.bos_id
    _write_json(path / 'generation_config.json', gen)


# -- GGUF -----------------------------------------------------------------------------


def from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
  """Tokenizer from GGUF `tokenizer.*` metadata (as `field.contents()` gives it)."""
  model = meta.get('tokenizer.ggml.model')
  if model != 'gpt2':
    raise NotImplementedError(
        f'GGUF tokenizer model {model!r} not supported; only byte-level BPE (\'gpt2\') is '
        "(sentencepiece 'llama' and other models need their own implementation)")
  tokens = list(meta['tokenizer.ggml.tokens'])
  types = list(meta.get('tokenizer.ggml.token_type') or [_NORMAL] * len(tokens))
  if len(types) != len(tokens):
    raise ValueError(f'{len(tokens)} tokens but {len(types)} token types')
  tok = build_bpe(tokens, types, list(meta.get('tokenizer.ggml.merges') or []),
                  meta.get('tokenizer.ggml.pre', 'default'))
  name = lambda key: (None if meta.get(key) is None else tokens[int(meta[key])])
  eos = name('tokenizer.ggml.eos_token_id')
  if eos is None:
    raise ValueError('GGUF metadata has no tokenizer.ggml.eos_token_id')
  extra = [int(meta[k]) for k in ('tokenizer.ggml.eot_token_id', 'tokenizer.ggml.eom_token_id')
           if meta.get(k) is not None]
  return Tokenizer(tok, vocab_size=len(tokens), eos_token=eos,
                   bos_token=name('tokenizer.ggml.bos_token_id'),
                   pad_token=name('tokenizer.ggml.padding_token_id'),
                   chat_template=meta.get('tokenizer.chat_template'), extra_stop_ids=extra)


def build_bpe(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
              pre: str) -> tokenizers.Tokenizer:
  """Byte-level BPE `tokenizers.Tokenizer` matching llama.cpp's for pre-tokenizer `pre`."""
  if pre not in SUPPORTED_PRE:
    raise NotImplementedError(f'GGUF pre-tokenizer {pre!r} not supported; '
                              f'supported: {SUPPORTED_PRE}')
  vocab = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t, i)  # Duplicate strings keep their first id.
  pairs = []
  for m in merges:
    cut = m.find(' ', 1)  # As llama.cpp: the left part may start with a space.
    if cut < 0:
      raise ValueError(f'bad merge {m!r}: expected "left right"')
    pairs.append((m[:cut], m[cut + 1:]))
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=False,
                                        ignore_merges=pre == 'llama-bpe'))
  if pre in _GPT2_PRE:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  elif pre == 'smollm':
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  else:
    regex = _QWEN2_REGEX if pre == 'qwen2' else _LLAMA3_REGEX
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(regex), behavior='isolated', invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == 'qwen2':
      tok.normalizer = normalizers.NFC()  # As Qwen2's own tokenizer.json.
  tok.decoder = decoders.ByteLevel()
  special = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == _CONTROL]
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
  if special:
    tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)
  return tok


# -- chat templates -------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (HF's assistant-mask tag) rendered as-is."""
  tags = {'generation'}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  """A chat template compiled as transformers does (sandboxed, trim/lstrip blocks)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = _strftime_now
  return env.from_string(template)


# -- helpers --------------------------------------------------------------------------


def _check_text(text) -> None:
  if not isinstance(text, str):
    raise ValueError(f'encode expects a str, got {type(text).__name__}')
  try:
    text.encode('utf-8')
  except UnicodeEncodeError as e:
    raise ValueError(f'text is not valid Unicode (lone surrogate at {e.start})') from None


def _as_id_list(ids) -> list[int]:
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise ValueError(f'expected a 1-D sequence of ids, got shape {ids.shape}')
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f'ids must be integers, got dtype {ids.dtype}')
  if ids.size and ids.min() < 0:
    raise ValueError(f'ids must be non-negative, got {int(ids.min())}')
  return [int(i) for i in ids]


def _token_str(tok) -> str | None:
  """A token from tokenizer_config.json: a string or an AddedToken dict."""
  return tok.get('content') if isinstance(tok, dict) else tok


def _hf_chat_template(path: pathlib.Path, config: dict) -> str | None:
  template = config.get('chat_template')
  if template is None and (path / 'chat_template.jinja').is_file():
    try:
      template = (path / 'chat_template.jinja').read_text(encoding='utf-8')
    except UnicodeDecodeError as e:
      raise ValueError(f'{path / "chat_template.jinja"}: not valid UTF-8 ({e})') from e
  if template is None:
    template = _read_json(path / 'chat_template.json').get('chat_template')
  if isinstance(template, list):  # Named templates: [{'name': ..., 'template': ...}].
    named = {t['name']: t['template'] for t in template}
    template = named.get('default', next(iter(named.values()), None))
  return template


def _read_json(path: pathlib.Path) -> dict:
  """A JSON object file, {} if absent; ValueError naming the file if corrupt."""
  if not path.is_file():
    return {}
  try:
    obj = json.loads(path.read_text(encoding='utf-8'))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: not valid JSON (corrupt or truncated?): {e}') from e
  if not isinstance(obj, dict):
    raise ValueError(f'{path}: expected a JSON object, got {type(obj).__name__}')
  return obj


def _write_json(path: pathlib.Path, obj: dict) -> None:
  path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + '\n', encoding='utf-8')
