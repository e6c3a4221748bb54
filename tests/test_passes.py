"""The trainer's declarations: every need has one provider, the sampler registry is the
configs' list, problems declare what they can do, a pass's checks fire before any work, and
the driver stays thin."""

import ast
import inspect

import pytest

import credit
from configs import tempo as tempo_config
from experiments.training import loop, passes, rl_step, samplers


def test_every_need_has_exactly_one_provider():
  got = passes.providers()
  assert set(got) == set(credit.NEEDS)
  assert {key: who for key, who in got.items() if len(who) != 1} == {}
  # every registered estimator's needs are in the vocabulary (register refuses others)
  assert {n for name in credit.names() for n in credit.needs(name)} <= set(credit.NEEDS)


def test_sampler_registry_is_the_configs_list():
  assert tuple(samplers.REGISTRY) == tempo_config.SAMPLERS
  assert loop.IID_SAMPLERS == tuple(n for n, s in samplers.REGISTRY.items() if not s.tree)
  for name, sampler in samplers.REGISTRY.items():
    assert sampler.problems <= {'jax', 'text', 'agent'}, name
    assert (sampler.fn is None) == (sampler.problems == {'agent'}), name  # their own sampler


def test_tasks_declare_what_they_define():
  import envs
  methods = dict(reasoning_steps='reasoning_steps', process_rewards='token_rewards',
                 interventions='interventions')
  for name in envs.names():
    task = envs.get(name)
    declared = {cap for cap, attr in methods.items() if hasattr(task, attr)}
    assert task.capabilities == declared, name


def test_problems_declare_capabilities():
  from experiments.rollouts import agent_rollouts, text_rollouts
  from experiments.training import problems
  cfg = tempo_config.get_config()
  cfg.task.name = 'scratch_add'
  assert problems.capabilities(cfg) == {'prompt_pool', 'reasoning_steps', 'process_rewards',
                                        'interventions'}
  cfg.task.name, cfg.task.kwargs = 'addition', {}
  assert problems.capabilities(cfg) == {'prompt_pool'}
  assert text_rollouts.TextProblem.capabilities == frozenset()
  assert agent_rollouts.AgentProblem.capabilities == {'own_sampler', 'turns', 'experience'}


@pytest.mark.parametrize('method, edit, message', [
    ('r3:iid', {}, 'set rl.prompt_pool'),
    ('pbsd:iid', {'task.name': 'addition'}, 'scores the responses with the gold answer'),
    ('hrpo:iid', {'task.name': 'addition'}, 'needs per-step process rewards'),
    ('distil:iid', {'task.name': 'addition'}, "imitates the expert"),
    ('gigpo:iid', {}, 'assigns credit to the turns'),
    ('grpo:knapsack', {}, 'allocates each step'),
])
def test_a_pass_refuses_before_any_work(method, edit, message, monkeypatch):
  """Checks that used to fire after the SFT warm start now fire in check_config."""
  monkeypatch.setattr(loop, 'sft', lambda *a, **k: pytest.fail('ran before refusing'))
  cfg = loop.with_method(tempo_config.get_config(), method)
  for path, value in edit.items():
    section, field = path.split('.')
    cfg[section][field] = value
    if field == 'name':
      cfg.task.kwargs = {}
  with pytest.raises(ValueError, match=message):
    loop.check_config(cfg)


def _lines(fn) -> int:
  node = ast.parse(inspect.getsource(fn).lstrip()).body[0]
  return node.end_lineno - node.lineno + 1


def test_the_driver_is_thin_and_names_no_feature():
  assert _lines(loop.train) <= 60 and _lines(rl_step.rl_step) <= 80
  features = ('critic', 'replay', 'lagged', 'knapsack', 'library', 'expert', 'hindsight',
              'probe', 'saliency', 'entropy', 'intervention', 'pool')
  for fn in (loop.train, rl_step.rl_step):
    body = inspect.getsource(fn).split('"""')[-1].lower()
    assert not [f for f in features if f in body], fn.__name__
