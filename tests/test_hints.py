"""Hinted sampling (experiments/training/hints.py) against the reference's steps and teacher
forcing, its schedules, and ADHint's split baselines (credit.replay.adhint) against a
plain-Python reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
from envs.scratchpad_addition import ScratchpadAddition
from experiments.models import decoder
from experiments.training import hints, loop

TASK = ScratchpadAddition(num_digits=3)
CFG = decoder.PolicyConfig(vocab_size=TASK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                           d_ff=32, max_len=TASK.prompt_len + TASK.response_len)

# The reference's pieces jitted, one program per shape for the module (op by op they
# compile a few hundred small programs per case).
sample = jax.jit(TASK.sample, static_argnums=1)
demonstrations = jax.jit(TASK.demonstrations)
difficulty = jax.jit(lambda params, prompts, info: hints.difficulty(params, CFG, TASK, prompts,
                                                                    info))
forward = jax.jit(lambda params, prompts, responses, plen: decoder.token_logprobs(
    params, CFG, prompts, responses, plen)[0])


@pytest.fixture(scope='module')
def params():
  return decoder.init_params(jax.random.PRNGKey(0), CFG)


def test_schedules():
  s = 3
  assert [int(hints.hint_steps('staged', s, progress=p)) for p in (0.0, 0.34, 0.5, 0.9, 1.0)] \
      == [3, 1, 1, 0, 0]
  got = hints.hint_steps('difficulty', s, hardness=jnp.array([0.0, 0.3, 0.5, 0.99, 1.0]))
  assert list(np.asarray(got)) == [0, 0, 1, 2, 3]


@pytest.mark.parametrize('schedule,progress', [('staged', 0.0), ('staged', 0.5),
                                               ('difficulty', 0.0)])
def test_hinted_rows_continue_the_references_first_steps(schedule, progress, params):
  b, g, rows = 3, 4, 2
  prompts, info = sample(jax.random.key(0), b)
  s = hints.sample_hinted(params, jax.random.key(1), prompts, info, progress, pcfg=CFG,
                          task=TASK, group_size=g, hint_rows=rows, schedule=schedule,
                          temperature=1.0, top_p=1.0, top_k=0)
  demo, dmask = (np.asarray(x) for x in demonstrations(prompts, info))
  tokens, mask, policy = (np.asarray(x) for x in (s.tokens, s.mask, s.policy_mask))
  hl = np.asarray(s.hint_len)
  if schedule == 'staged':
    k = int(hints.hint_steps('staged', TASK.reasoning_steps, progress=progress))
  else:
    hardness = difficulty(params, prompts, info)
    k_all = np.asarray(hints.hint_steps('difficulty', TASK.reasoning_steps, hardness=hardness))
  for i in range(b):
    kk = k if schedule == 'staged' else int(k_all[i])
    commas = [t for t in range(len(demo[i])) if demo[i, t] == TASK.token_id(',')]
    want = commas[kk - 1] + 1 if kk else 0  # through the k-th step's ','
    for j in range(g):
      h = hl[i, j]
      assert h == (want if j < rows else 0)
      np.testing.assert_array_equal(tokens[i, j, :h], demo[i, :h])
      assert not policy[i, j, :h].any() and np.all(policy[i, j, h:] == mask[i, j, h:])
      assert np.all(np.asarray(s.logprobs)[i, j, :h] == 0)
  # The continuation is sampled after prompt ⊕ hint: teacher forcing there gives its log-probs.
  wide, plen = hints.with_hint(jnp.repeat(prompts, g, 0), None, jnp.repeat(jnp.asarray(demo), g, 0),
                               jnp.asarray(hl.reshape(-1)), TASK.pad_id)
  cont = np.zeros((b * g, TASK.response_len), np.int32)
  for n, (i, j) in enumerate(np.ndindex(b, g)):
    c = tokens[i, j, hl[i, j]:][policy[i, j, hl[i, j]:]]
    cont[n, :len(c)] = c
  lp = np.asarray(forward(params, wide, jnp.asarray(cont), plen))
  for n, (i, j) in enumerate(np.ndindex(b, g)):
    got = np.asarray(s.logprobs)[i, j][policy[i, j]]
    np.testing.assert_allclose(got, lp[n, :len(got)], atol=2e-4)


def ref_adhint(rewards, hinted, scale=True):
  out = np.zeros(rewards.shape)
  for idx in np.ndindex(rewards.shape[:-1]):
    for flag in (False, True):
      sel = hinted[idx] == flag
      r = rewards[idx][sel]
      if len(r) > 1 and r.max() > r.min():
        out[idx][sel] = (r - r.mean()) / ((r.std(ddof=1) + 1e-6) if scale else 1.0)
  return out


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans())
def test_adhint_matches_reference_and_is_grpo_without_hints(seed, scale):
  rng = np.random.default_rng(seed)
  g, l = 6, 5
  mask = np.arange(l) < rng.integers(1, l + 1, (2, g))[..., None]
  hint = rng.integers(0, 3, (2, g)) * (rng.random((2, g)) < 0.5)
  policy = mask & (np.arange(l) >= hint[..., None])
  rewards = rng.integers(0, 2, (2, g)).astype(np.float32)
  r = credit.Rollouts(tokens=jnp.zeros((2, g, l), jnp.int32), mask=jnp.asarray(mask),
                      rewards=jnp.asarray(rewards), policy_mask=jnp.asarray(policy))
  want = ref_adhint(rewards, hint > 0, scale)
  got = np.asarray(credit.get('adhint')(r, scale_by_std=scale))
  np.testing.assert_allclose(got, np.where(policy, want[..., None], 0.0), atol=1e-5)
  plain = r.replace(policy_mask=None)
  np.testing.assert_allclose(credit.get('adhint')(plain, scale_by_std=scale),
                             credit.get('grpo')(plain, scale_by_std=scale), atol=1e-6)


def test_hinted_sampler_needs_a_chain_of_thought_task():
  from tests.test_loop import quick_cfg
  cfg = quick_cfg()  # addition: no reasoning steps
  cfg.sampler.name = 'hinted'
  with pytest.raises(ValueError, match="sampler 'hinted'"):
    loop.check_config(cfg)
  cfg = quick_cfg(default_task=True)
  cfg.sampler.name, cfg.sampler.hint_schedule = 'hinted', 'random'
  with pytest.raises(ValueError, match='hint_schedule'):
    loop.check_config(cfg)
