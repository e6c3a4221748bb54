"""The pretrained-LM path of the loop: host-side rewards of text tasks and the quick
`python -m experiments.lm` run (SmolLM2, reasoning-gym chain_sum, GRPO vs TEMPO)."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm as lm_config
from experiments.rollouts import sampling
from experiments.training import compare, loop


def quick_cfg():
  cfg = lm_config.shrink(lm_config.get_config())
  cfg.progress = False
  return cfg


@pytest.fixture(scope='module')
def problem():
  return loop.build_problem(quick_cfg())


def _samples(problem, texts, stop):
  """Samples [1, G, L] holding the token ids of `texts` (+ a stop token where stop[g])."""
  tok, l = problem.tokenizer, problem.response_len
  rows, mask = [], []
  for text, s in zip(texts, stop):
    ids = (tok.encode(text) + ([tok.eos_id] if s else []))[:l]
    rows.append(ids + [tok.pad_id] * (l - len(ids)))
    mask.append([True] * len(ids) + [False] * (l - len(ids)))
  g = len(texts)
  zeros = jnp.zeros((1, g, l))
  return sampling.Samples(tokens=jnp.asarray([rows], jnp.int32), logprobs=zeros, entropy=zeros,
                          mask=jnp.asarray([mask]), parent=-jnp.ones((1, g), jnp.int32),
                          fork=jnp.zeros((1, g), jnp.int32))


def test_text_rewards_use_the_verifier_and_the_truncation_rule(problem):
  draw = problem.draw(None, 0, 1)
  ex = draw.handle[0]
  assert draw.prompts.shape == (1, problem.max_prompt_len)
  assert int(draw.prompt_len[0]) == len(problem.tokenizer.encode_chat(problem.task.messages(ex)))
  good = problem.task.demonstration(ex)
  s = _samples(problem, [good, 'I do not know.', good], [True, True, False])
  r, m = problem.rewards(draw, s)
  assert r.shape == (1, 3)
  assert float(r[0, 0]) == 1.0 and float(r[0, 1]) < 1.0
  assert float(r[0, 2]) == 1.0  # truncated, scored as it is ('score')
  assert math.isclose(m['truncated_frac'], 1 / 3)
  problem.truncation = 'zero'
  try:
    r0, _ = problem.rewards(draw, s)
  finally:
    problem.truncation = 'score'
  np.testing.assert_array_equal(np.asarray(r0), [[1.0, float(r[0, 1]), 0.0]])


@pytest.mark.slow  # ~2 minutes: 2 RL steps of SmolLM2 for 2 methods (tests/test_smollm2.py covers the model)
def test_quick_lm_experiment(tmp_path):
  cfg = quick_cfg()
  cfg.quick = False  # already shrunk
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert set(summary['methods']) == {'grpo:iid', 'tempo:tree_entropy'}
  assert 0.0 <= summary['sft']['greedy_acc'] <= 1.0
  for method in summary['methods']:
    rows = loop.read_metrics(tmp_path / method.replace(':', '_') / 'seed0' / 'metrics.jsonl')
    train = [r for r in rows if 'reward' in r]
    assert [r['step'] for r in train] == [1, 2]
    for r in train:
      assert 0.0 <= r['reward'] <= 1.0 and 0.0 <= r['truncated_frac'] <= 1.0
      assert all(math.isfinite(r[k]) for k in ('loss', 'grad_norm', 'approx_kl', 'entropy'))
      assert 0 < r['response_len'] <= cfg.lm.max_new_tokens
  json.loads((tmp_path / 'summary.json').read_text())


@pytest.mark.slow  # ~3 minutes: 2 RL steps of SmolLM2 with PPO's critic (a second SmolLM2)
def test_quick_lm_ppo_trains_its_critic(tmp_path):
  """PPO end to end on SmolLM2 (issue 24): the critic (a copy of the policy with a value
  head) gives values to `ppo` and is updated every step."""
  cfg = quick_cfg()
  cfg.quick = False
  cfg.methods = 'ppo:iid'
  compare.run_experiment(cfg, str(tmp_path))
  rows = loop.read_metrics(tmp_path / 'ppo_iid' / 'seed0' / 'metrics.jsonl')
  train = [r for r in rows if 'reward' in r]
  assert [r['step'] for r in train] == [1, 2]
  for r in train:
    assert all(math.isfinite(r[k]) for k in ('loss', 'critic/vf_loss', 'critic/grad_norm'))
    assert r['critic_s'] > 0

