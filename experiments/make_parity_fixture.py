"""Writes tests/fixtures/smollm2_hf_reference.npz: transformers' logits on SmolLM2.

    pip install torch transformers && python -m experiments.make_parity_fixture

Not part of the test run (it needs torch). For four prompts (plain text, the chat
rendering by transformers' own template, digits/unicode/whitespace, a paragraph)
it stores transformers' token ids, float32 logits on a fixed vocabulary subset
(400 random ids plus every position's top 20), the full-vocab argmax and
logsumexp per position, and the greedy continuation of the chat prompt.
tests/test_smollm2.py compares our implementation with it.
"""

import pathlib

import numpy as np

from experiments import hf_reference
from experiments.models import assets

OUT = pathlib.Path(__file__).resolve().parent.parent / 'tests' / 'fixtures' / 'smollm2_hf_reference.npz'
PARAGRAPH = ('Reinforcement learning from verifiable rewards samples several responses to each '
             'prompt, scores them with a program, and pushes up the likelihood of the better '
             'ones. Tree-structured rollouts share prefixes between responses, so the value of '
             'each shared prefix can be estimated from the responses below it.')


def main():
  import torch
  import transformers
  model, tok = hf_reference.load_smollm2_hf()
  chat = tok.apply_chat_template([{'role': 'user', 'content': 'What is the capital of France?'}],
                                 add_generation_prompt=True, tokenize=False)
  texts = ['The capital of France is', chat, 'Compute 12 + 345 = ?\n\tCafé ☕ 東京  ', PARAGRAPH]
  ids = [tok(t, add_special_tokens=False)['input_ids'] for t in texts]
  logits = hf_reference.hf_logits(model, ids)
  t_max = max(map(len, ids))
  top = set()
  for lg in logits:
    top |= set(np.argsort(-lg, axis=-1)[:, :20].ravel().tolist())
  vocab_ids = np.array(sorted(top | set(np.random.default_rng(0).choice(
      lg.shape[-1], 400, replace=False).tolist())), np.int32)
  sub = np.zeros((len(texts), t_max, len(vocab_ids)), np.float32)
  argmax = np.zeros((len(texts), t_max), np.int32)
  lse = np.zeros((len(texts), t_max), np.float32)
  padded = np.zeros((len(texts), t_max), np.int32)
  for i, (row, lg) in enumerate(zip(ids, logits)):
    n = len(row)
    padded[i, :n] = row
    sub[i, :n] = lg[:, vocab_ids]
    argmax[i, :n] = lg.argmax(-1)
    m = lg.max(-1, keepdims=True)
    lse[i, :n] = (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[:, 0]
  greedy = hf_reference.hf_greedy(model, ids[1], 24)
  greedy_text = tok.decode(greedy, skip_special_tokens=True)
  OUT.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(
      OUT, ids=padded, lengths=np.array([len(r) for r in ids], np.int32), texts=np.array(texts),
      vocab_ids=vocab_ids, logits=sub, argmax=argmax, lse=lse,
      greedy_ids=np.array(greedy, np.int32), greedy_text=np.array(greedy_text),
      versions=np.array(f'transformers {transformers.__version__}, torch {torch.__version__}, '
                        f'{assets.SMOLLM2_FILE}'))
  print(f'wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB); greedy: {greedy_text!r}')


if __name__ == '__main__':
  main()
