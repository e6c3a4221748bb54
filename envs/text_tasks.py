"""Text tasks: reasoning-gym generators with their own scorers, and our JAX tasks as text.

`make_text_task(name, **overrides)`; names in TEXT_TASKS.

ReasoningGymTask (reasoning-gym, a maintained library of procedural reasoning
generators): the question is the dataset's own; the reward is the dataset's own
`score_answer(answer, entry)` applied to the answer extracted from the response
(`extract_answer`). Note countdown's scorer gives partial credit: 0.01 for no
answer and 0.05 for a well-formed wrong expression; the arithmetic scorers are 0/1.
Defaults are sized for a 135M model: chain_sum / basic_arithmetic with 2-3 terms
of 1-2 digits, countdown with 3-4 numbers and targets 10-50.

JaxTaskAsText: a JAX task's prompt tokens rendered as a text question; the
response text is mapped back onto the task's vocabulary and scored by the JAX
task's own `reward` (so e.g. addition needs the exact fixed-width answer).

Train and eval examples come from disjoint generator streams: reasoning-gym seeds
example i with seed + i, so train uses seed * 10^6 and eval 10^9 + seed * 10^6
(disjoint for fewer than 10^6 examples), and training examples whose question
appears among the first `eval_guard` eval questions are dropped as well (identical
questions from different seeds). JAX tasks use keys PRNGKey(2 seed) / (2 seed + 1).
"""

import dataclasses
import functools
import re
from typing import Optional

import jax
import numpy as np

from envs import registry as jax_registry
from envs.text import TextExample, TextTask, check_split

_STRIDE, _EVAL_OFFSET = 10**6, 10**9
_TAG = re.compile(r'<answer>(.*?)</answer>', re.DOTALL)
_NUMBER = re.compile(r'-?\d+(?:\.\d+)?')
_ANSWER_IS = re.compile(r'(?:answer is|answer:|=)\s*(.+)$', re.IGNORECASE | re.DOTALL)

DEFAULT_OPTIONS = {
    'chain_sum': (('min_terms', 2), ('max_terms', 3), ('min_digits', 1), ('max_digits', 2)),
    'basic_arithmetic': (('min_terms', 2), ('max_terms', 3), ('min_digits', 1),
                         ('max_digits', 2)),
    'countdown': (('min_numbers', 3), ('max_numbers', 4), ('min_target', 10), ('max_target', 50)),
}
NUMERIC = ('chain_sum', 'basic_arithmetic')


def extract_answer(response: str, answer_format: str, numeric: bool) -> Optional[str]:
  """The final answer in a response: inside <answer> tags if any; else (plain) the text after
  the last 'answer is' / 'Answer:' / '=' or the last non-empty line; numeric tasks keep the
  last number in it. None if nothing is found ('tags' format without tags)."""
  tags = _TAG.findall(response)
  if tags:
    text = tags[-1]
  elif answer_format == 'tags':
    return None
  else:
    lines = [l for l in response.strip().splitlines() if l.strip()]
    if not lines:
      return None
    text = lines[-1]
    m = _ANSWER_IS.search(text)
    text = m.group(1) if m else text
  text = text.strip().rstrip('.').strip()
  if numeric:
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None
  return text or None


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask(TextTask):
  """A reasoning-gym dataset scored by its own `score_answer`."""
  dataset: str = 'chain_sum'
  options: tuple = ()  # (key, value) pairs for reasoning_gym.create_dataset; () = defaults
  answer_format: str = 'plain'  # 'plain' or 'tags' (<answer>...</answer>)
  system_prompt: Optional[str] = None
  eval_guard: int = 256  # training questions equal to one of the first eval_guard eval ones are dropped

  def __post_init__(self):
    if self.answer_format not in ('plain', 'tags'):
      raise ValueError(f"answer_format must be 'plain' or 'tags', got {self.answer_format!r}")
    if isinstance(self.eval_guard, bool) or not isinstance(self.eval_guard, int) or \
        self.eval_guard < 1:
      raise ValueError(f'{self.dataset}: eval_guard must be an int >= 1 (eval questions '
                       f'held out of training); got {self.eval_guard!r}')
    self.check_options()

  def check_options(self):
    """Raises ValueError naming the dataset and the option when reasoning-gym would refuse
    the options (an unknown key, a value its config's `validate` asserts against, e.g.
    min_terms > max_terms), without generating anything: the dataset's config is built
    and validated as `reasoning_gym.create_dataset` does."""
    from reasoning_gym.factory import DATASETS
    if self.dataset not in DATASETS:
      raise ValueError(f'unknown reasoning-gym dataset {self.dataset!r}')
    config_cls = DATASETS[self.dataset][1]
    try:
      given = dict(self.options)
    except (TypeError, ValueError):
      raise ValueError(f'{self.dataset}: options must be (key, value) pairs or a dict; got '
                       f'{self.options!r}') from None
    valid = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ('seed', 'size'))
    unknown = sorted(set(given) - set(valid))
    if unknown:
      raise ValueError(f'{self.dataset}: unknown reasoning-gym option(s) {", ".join(unknown)} '
                       f'(seed and size are set by the task); valid: {", ".join(valid)}')
    opts = {**dict(DEFAULT_OPTIONS.get(self.dataset, ())), **given}
    try:
      config = config_cls(seed=0, size=1, **opts)
      if hasattr(config, 'validate'):
        config.validate()
    except (AssertionError, TypeError, ValueError) as e:
      raise ValueError(f'{self.dataset}: reasoning-gym rejects the options {opts} (defaults '
                       f'included): {e or type(e).__name__}') from None

  @property
  def name(self):
    return self.dataset

  def _dataset(self, seed: int, size: int):
    import reasoning_gym
    opts = dict(DEFAULT_OPTIONS.get(self.dataset, ()))
    opts.update(dict(self.options))
    return reasoning_gym.create_dataset(self.dataset, seed=seed, size=size, **opts)

  def examples(self, split, n, seed=0):
    check_split(split, n)
    if split == 'eval':
      ds = self._dataset(_EVAL_OFFSET + seed * _STRIDE, n)
      return [TextExample(i, ds[i]['question'], str(ds[i]['answer']), ds[i]) for i in range(n)]
    held_out = self._eval_questions(seed)
    ds = self._dataset(seed * _STRIDE, 4 * n + 256)
    out = []
    for i in range(len(ds)):
      if ds[i]['question'] not in held_out:
        out.append(TextExample(len(out), ds[i]['question'], str(ds[i]['answer']), ds[i]))
        if len(out) == n:
          return out
    raise ValueError(f'{self.dataset}: could not draw {n} training examples disjoint from the first '
                     f'{self.eval_guard} eval questions (a small question space? lower eval_guard)')

  @functools.lru_cache(maxsize=8)
  def _eval_questions(self, seed: int) -> frozenset:
    guard = self._dataset(_EVAL_OFFSET + seed * _STRIDE, self.eval_guard)
    return frozenset(guard[i]['question'] for i in range(self.eval_guard))

  def user_content(self, example):
    hint = ('Put only the final answer inside <answer></answer>.' if self.answer_format == 'tags'
            else 'Reply with only the final answer.')
    return f'{example.question}\n{hint}'

  def score(self, example, response):
    import reasoning_gym
    answer = extract_answer(response, self.answer_format, self.dataset in NUMERIC)
    scorer = reasoning_gym.get_score_answer_fn(example.entry['metadata']['source_dataset'])
    return float(scorer(answer=answer, entry=example.entry))

  def demonstration(self, example):
    return f'<answer>{example.answer}</answer>' if self.answer_format == 'tags' else example.answer


@dataclasses.dataclass(frozen=True)
class JaxTaskAsText(TextTask):
  """One of our JAX tasks (envs.registry) as a text task, scored by its own `reward`."""
  task_name: str = 'addition'
  task_kwargs: tuple = ()
  system_prompt: Optional[str] = None

  def __post_init__(self):
    self.jax_task  # unknown task names and arguments raise ValueError here, up front

  @property
  def jax_task(self):
    return jax_registry.get(self.task_name, **dict(self.task_kwargs))

  @property
  def name(self):
    return f'jax_{self.task_name}'

  def examples(self, split, n, seed=0):
    check_split(split, n)
    t = self.jax_task
    key = jax.random.PRNGKey(2 * seed + (split == 'eval'))
    prompts, info = t.sample(key, n)
    demos, _ = t.demonstrations(prompts, info)
    prompts, demos = np.asarray(prompts), np.asarray(demos)
    info = jax.tree.map(np.asarray, info)
    out = []
    for i in range(n):
      answer = t.detokenize(demos[i][demos[i] != t.eos_id])
      entry = (prompts[i], jax.tree.map(lambda x: x[i], info))
      out.append(TextExample(i, t.detokenize(prompts[i]), answer, entry))
    return out

  def user_content(self, example):
    return (f'Continue this {self.task_name} problem with its answer, in the same notation, '
            f'and nothing else:\n{example.question}')

  def to_tokens(self, response: str) -> Optional[list[int]]:
    """Greedy longest match of the response onto the task vocabulary (spaces skipped)."""
    t, symbols = self.jax_task, _symbols(self.jax_task)
    text, ids, i = response.strip(), [], 0
    while i < len(text):
      if text[i].isspace():
        i += 1
        continue
      match = next((s for s in symbols if text.startswith(s, i)), None)
      if match is None:
        return None
      ids.append(t.token_id(match))
      i += len(match)
    return ids

  def score(self, example, response):
    t = self.jax_task
    ids = self.to_tokens(response)
    r = t.response_len
    if ids is None or len(ids) + 1 > r:
      return 0.0
    ids = ids + [t.eos_id]
    tokens = np.full((1, r), t.pad_id, np.int32)
    tokens[0, :len(ids)] = ids
    mask = np.arange(r)[None] < len(ids)
    prompts, info = example.entry
    info = jax.tree.map(lambda x: x[None], info)
    return float(_jit_reward(t)(prompts[None], tokens, mask, info)[0])

  def demonstration(self, example):
    return example.answer


@functools.lru_cache(maxsize=None)
def _symbols(task) -> tuple[str, ...]:
  """The task's answer symbols (all but EOS / PAD), longest first."""
  keep = [s for s in task.vocab if task.token_id(s) not in (task.eos_id, task.pad_id)]
  return tuple(sorted(keep, key=len, reverse=True))


@functools.lru_cache(maxsize=None)
def _jit_reward(task):
  """The JAX task's reward, compiled once per task (scoring runs once per response)."""
  return jax.jit(task.reward)


def _check_overrides(name: str, cls, overrides: dict, fixed: str):
  """A ValueError naming the task and the keys that are not fields of `cls`."""
  valid = sorted(f.name for f in dataclasses.fields(cls) if f.init and f.name != fixed)
  unknown = sorted(set(overrides) - set(valid))
  if unknown:
    raise ValueError(f'text task {name!r}: unknown option(s) {", ".join(unknown)}; valid: '
                     f'{", ".join(valid)}')


def make_text_task(name: str, **overrides) -> TextTask:
  """A text task by name; overrides are the task's dataclass fields
  (`options` / `task_kwargs` may be dicts). Unknown fields, and reasoning-gym options
  its dataset would refuse, raise ValueError here (`ReasoningGymTask.check_options`)."""
  if name in ('chain_sum', 'basic_arithmetic', 'countdown'):
    _check_overrides(name, ReasoningGymTask, overrides, 'dataset')
    if hasattr(overrides.get('options'), 'items'):  # a dict or ConfigDict
      overrides['options'] = tuple(sorted(overrides['options'].items()))
    return ReasoningGymTask(dataset=name, **overrides)
  if name in ('jax_addition', 'jax_countdown'):
    _check_overrides(name, JaxTaskAsText, overrides, 'task_name')
    if hasattr(overrides.get('task_kwargs'), 'items'):
      overrides['task_kwargs'] = tuple(sorted(overrides['task_kwargs'].items()))
    return JaxTaskAsText(task_name=name[len('jax_'):], **overrides)
  raise ValueError(f'unknown text task {name!r}; valid: {", ".join(TEXT_TASKS)}')


TEXT_TASKS = ('chain_sum', 'basic_arithmetic', 'countdown', 'jax_addition', 'jax_countdown')
