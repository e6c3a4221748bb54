"""Text tasks (envs/text.py, envs/text_tasks.py): determinism, disjoint splits, verifiers."""

import numpy as np
import pytest

from envs import text, text_tasks


@pytest.mark.parametrize('name', text_tasks.TEXT_TASKS)
def test_examples_are_deterministic_disjoint_and_demonstrations_score_one(name):
  task = text_tasks.make_text_task(name)
  train = task.examples('train', 40, seed=0)
  assert train == task.examples('train', 40, seed=0)
  assert [e.id for e in train] == list(range(40))
  ev = task.examples('eval', 40, seed=0)
  if name.startswith('jax_'):  # tiny state spaces may repeat a question by chance
    assert sum(e.question in {t.question for t in train} for e in ev) < 10
  else:
    assert not {e.question for e in ev} & {e.question for e in train}
  for ex in train[:10]:
    assert task.score(ex, task.demonstration(ex)) == 1.0
    assert task.score(ex, 'no idea') < 0.1
  msgs = task.messages(train[0])
  assert msgs[-1]['role'] == 'user' and train[0].question in msgs[-1]['content']


def test_answer_extraction_accepts_formatting_and_rejects_wrong_answers():
  task = text_tasks.make_text_task('chain_sum')
  ex = task.examples('eval', 1)[0]
  a = ex.answer
  for ok in (a, f' {a}\n', f'The answer is {a}.', f'<answer>{a}</answer>', f'Sum:\n{a}'):
    assert task.score(ex, ok) == 1.0, ok
  wrong = str(int(a) + 1)
  for bad in (wrong, f'<answer>{wrong}</answer>', f'{a} is close, but {wrong}', ''):
    assert task.score(ex, bad) == 0.0, bad
  tags = text_tasks.make_text_task('chain_sum', answer_format='tags')
  assert tags.score(ex, a) == 0.0 and tags.score(ex, f'so <answer> {a} </answer>') == 1.0
  assert text_tasks.extract_answer('x = 12\n', 'plain', numeric=True) == '12'


def test_countdown_uses_reasoning_gym_partial_credit():
  task = text_tasks.make_text_task('countdown')
  ex = task.examples('eval', 1)[0]
  nums = ex.entry['metadata']['numbers']
  wrong = ' + '.join(str(n) for n in nums) + ' + 1000'
  assert 0.0 < task.score(ex, wrong) < 0.1  # reasoning-gym's scorer: formatted but wrong


def test_jax_task_as_text_agrees_with_the_jax_reward():
  task = text_tasks.make_text_task('jax_addition', task_kwargs={'num_digits': 2})
  for ex in task.examples('eval', 20):
    assert task.score(ex, ex.answer) == 1.0
    corrupted = ex.answer[:-1] + str((int(ex.answer[-1]) + 1) % 10)
    assert task.score(ex, corrupted) == 0.0
    assert task.score(ex, ex.answer[1:]) == 0.0  # the JAX task wants the fixed width
  cd = text_tasks.make_text_task('jax_countdown')
  ex = cd.examples('eval', 1)[0]
  assert cd.score(ex, ex.answer.replace(' ', '')) == 1.0  # spacing is free


def test_score_responses_truncation_and_errors():
  task = text_tasks.make_text_task('chain_sum')
  exs = task.examples('eval', 3)
  demos = [task.demonstration(e) for e in exs]
  cut = [False, True, False]
  np.testing.assert_array_equal(text.score_responses(task, exs, demos, cut), [1, 1, 1])
  np.testing.assert_array_equal(text.score_responses(task, exs, demos, cut, 'zero'), [1, 0, 1])
  with pytest.raises(ValueError, match='one of each'):
    text.score_responses(task, exs, demos[:2], cut)
  with pytest.raises(ValueError, match='truncation'):
    text.score_responses(task, exs, demos, cut, 'drop')

  class Broken(text_tasks.ReasoningGymTask):
    def score(self, example, response):
      return float('nan')

  with pytest.raises(ValueError, match='example 0'):
    text.score_responses(Broken(), exs, demos, cut)
  with pytest.raises(ValueError, match='unknown text task'):
    text_tasks.make_text_task('sudoku')
  with pytest.raises(ValueError, match='split'):
    task.examples('test', 3)
