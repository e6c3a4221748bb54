"""Text tasks: string prompts, host-side verifiers (the interface beside the JAX `Task`).

A pretrained model reads chat messages and writes text; its reward comes from a
Python verifier run on the host after decoding, outside jit, as in every RL
framework for LLMs (`experiments/rollouts/text_rollouts.py` wires this into the loop).

    task.examples(split, n, seed) -> [TextExample]   deterministic; train/eval disjoint
    task.messages(example)        -> chat messages [{'role', 'content'}] (subclasses
                                     word the user turn in `user_content`)
    task.score(example, response) -> float in [0, 1]
    task.demonstration(example)   -> a response that scores 1
"""

import dataclasses
import math
from typing import Any, Optional, Sequence

import numpy as np

TRUNCATION_MODES = ('score', 'zero')


@dataclasses.dataclass(frozen=True)
class TextExample:
  """One prompt. `id` is stable within (task, split, seed) and seeds the sampler's stream."""
  id: int
  question: str
  answer: str
  entry: Any = dataclasses.field(default=None, compare=False, hash=False)


class TextTask:
  """Base class; subclasses are frozen dataclasses of static hyper-parameters."""
  name: str = 'text'
  system_prompt: Optional[str] = None  # None: the chat template's default

  def examples(self, split: str, n: int, seed: int = 0) -> list[TextExample]:
    raise NotImplementedError

  def messages(self, example: TextExample) -> list[dict]:
    """The optional system prompt, then the user turn `user_content(example)`."""
    msgs = [] if self.system_prompt is None else [{'role': 'system', 'content': self.system_prompt}]
    return msgs + [{'role': 'user', 'content': self.user_content(example)}]

  def user_content(self, example: TextExample) -> str:
    return example.question

  def score(self, example: TextExample, response: str) -> float:
    raise NotImplementedError

  def demonstration(self, example: TextExample) -> str:
    raise NotImplementedError


def check_split(split: str, n: int):
  if split not in ('train', 'eval'):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  if n < 1:
    raise ValueError(f'need n >= 1 examples, got {n}')


def score_responses(task: TextTask, examples: Sequence[TextExample], responses: Sequence[str],
                    truncated, truncation: str = 'score') -> np.ndarray:
  """float32 [N] rewards of decoded responses.

  truncated [N] bool: the response hit max_new_tokens without a stop token.
  truncation='score' scores it as it is; 'zero' gives it reward 0.
  """
  if truncation not in TRUNCATION_MODES:
    raise ValueError(f'truncation must be one of {TRUNCATION_MODES}, got {truncation!r}')
  truncated = np.asarray(truncated, bool).reshape(-1)
  if not len(examples) == len(responses) == len(truncated):
    raise ValueError(f'{len(examples)} examples, {len(responses)} responses and '
                     f'{len(truncated)} truncation flags: need one of each per response')
  out = np.zeros(len(responses), np.float32)
  for i, (ex, text, cut) in enumerate(zip(examples, responses, truncated)):
    if cut and truncation == 'zero':
      continue
    r = float(task.score(ex, text))
    if not math.isfinite(r) or not 0.0 <= r <= 1.0:
      raise ValueError(f'task {task.name!r} scored example {ex.id} as {r}; rewards must be '
                       'finite and in [0, 1]')
    out[i] = r
  return out
