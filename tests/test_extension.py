"""Open for extension: from outside experiments/, a new need, a pass that provides it (with
loop state of its own) and an estimator that reads it train, are killed, resume and match an
uninterrupted run; a need nothing provides is refused before any work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import credit
from credit import vocabulary
from experiments.training import loop, passes, samplers
from test_resume import init_params, strip, tiny_cfg

KEY = 'toy_signal'


class ToySignal(passes.Pass):
  """Provides `Rollouts.extras['toy_signal']` [B, G]: the old log-prob sum of each row times
  the number of steps taken so far (its loop state, checkpointed under 'toy_steps')."""
  provides = (KEY,)
  state_key = 'toy_steps'

  def init_state(self, run, state):
    return jnp.zeros((), jnp.float32)

  def inputs(self, run, carry, s):
    s.extra.setdefault('extras', {})[KEY] = (
        jnp.sum(s.old_lp, -1) * (1.0 + carry.aux['toy_steps']))

  def update(self, run, carry, s):
    return carry.aux['toy_steps'] + 1.0, dict(toy_steps=carry.aux['toy_steps'] + 1.0)


def toy_estimator(rollouts):
  """GRPO's advantage plus a small bonus from the toy signal (so it changes the update)."""
  signal = rollouts.extras[KEY]
  bonus = 1e-3 * (signal - jnp.mean(signal, -1, keepdims=True))
  return credit.get('grpo')(rollouts) + bonus[..., None] * rollouts.mask


@pytest.fixture(scope='module')
def toy():
  vocabulary.declare(KEY, 'rollouts', 'a toy per-row signal (tests/test_extension.py)')
  credit.register('toy_credit', needs=(KEY,))(toy_estimator)
  passes.register(ToySignal, after=passes.Reference)
  yield
  passes.unregister(ToySignal)
  credit.registry.unregister('toy_credit')
  del vocabulary.NEEDS[KEY]


def test_a_pass_from_outside_trains_resumes_exactly(toy, tmp_path, monkeypatch):
  assert passes.providers()[KEY] == ['ToySignal']
  cfg = tiny_cfg(4)
  p0 = init_params(cfg)
  straight = loop.train(cfg, str(tmp_path / 'a'), p0, method='toy_credit:iid')
  rows = loop.read_metrics(str(tmp_path / 'a' / 'metrics.jsonl'))
  assert [r['toy_steps'] for r in rows[1:]] == [1.0, 2.0, 3.0, 4.0]
  plain = loop.train(cfg, str(tmp_path / 'g'), p0, method='grpo:iid')
  assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(plain['params']),
                                                      jax.tree.leaves(straight['params'])))
  calls, real = [0], samplers.sample

  def killed_at_step_3(*a, **k):  # Ctrl-C while sampling step index 2 (after checkpoint 2)
    calls[0] += 1
    if calls[0] == 3:
      raise KeyboardInterrupt
    return real(*a, **k)

  monkeypatch.setattr(samplers, 'sample', killed_at_step_3)
  with pytest.raises(KeyboardInterrupt):
    loop.train(cfg, str(tmp_path / 'b'), p0, method='toy_credit:iid')
  monkeypatch.setattr(samplers, 'sample', real)
  resumed = loop.train(cfg, str(tmp_path / 'b'), p0, method='toy_credit:iid')
  assert strip(loop.read_metrics(str(tmp_path / 'b' / 'metrics.jsonl'))) == strip(rows)
  for x, y in zip(jax.tree.leaves(straight['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(x, y)


def test_a_need_nothing_provides_is_refused_before_any_work(toy, monkeypatch):
  passes.unregister(ToySignal)
  try:
    monkeypatch.setattr(loop, 'sft', lambda *a, **k: pytest.fail('ran before refusing'))
    cfg = tiny_cfg(2)
    cfg.credit.name = 'toy_credit'
    with pytest.raises(ValueError, match=r"needs 'toy_signal' .*which nothing provides"):
      loop.check_config(cfg)
  finally:
    passes.register(ToySignal, after=passes.Reference)


def test_register_refuses_unknown_needs_and_taken_keys(toy):
  with pytest.raises(ValueError, match="'valeus', which is not a known need"):
    credit.register('misspelt', needs=('valeus',))
  with pytest.raises(ValueError, match="provides 'toy_signal', which ToySignal provides"):
    passes.register(type('Again', (ToySignal,), {'state_key': 'other'}))
  with pytest.raises(ValueError, match="loop state key 'critic' is taken"):
    passes.register(type('Clash', (passes.Pass,), {'state_key': 'critic'}))
