"""InT (#131): scratch_add's single-step interventions against hand-built responses, the
`intervention` estimator's GRPO credit, and the intervention phase through the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import credit
from envs.scratchpad_addition import ScratchpadAddition
from groups import grpo_ref, outcome_rollouts

TASK = ScratchpadAddition(num_digits=3)


def _split(tokens, mask):
  """The steps of a response as token lists (each through its ','), then the rest."""
  out, cur = [], []
  for t, m in zip(tokens, mask):
    if not m:
      break
    cur.append(int(t))
    if t == TASK.token_id(','):
      out.append(cur)
      cur = []
  return out, cur


def test_interventions_replace_the_first_wrong_step_with_the_demonstrations():
  n = 8
  prompts, info = TASK.sample(jax.random.key(0), n)
  gold, gmask = (np.asarray(x) for x in TASK.demonstrations(prompts, info))
  other_style = TASK.sample(jax.random.key(1), n)[1]['style']
  resp, rmask = (np.asarray(x) for x in TASK.demonstrations(prompts, {**info,
                                                                      'style': other_style}))
  rows, masks, wrong = [], [], []
  for i in range(n):  # response i: the other style's valid path, broken at step i % (D + 1)
    k = i % (TASK.num_digits + 1)
    steps, rest = _split(resp[i], rmask[i])
    if k < TASK.num_digits:
      steps[k] = list(steps[k])
      eq = steps[k].index(TASK.token_id('='))
      steps[k][eq + 1] = (steps[k][eq + 1] + 1) % 10  # a wrong total digit
    else:
      rest = [(rest[0] + 1) % 10] + rest[1:]  # a wrong answer digit
    toks = sum(steps, []) + rest
    rows.append(toks + [TASK.pad_id] * (TASK.response_len - len(toks)))
    masks.append([True] * len(toks) + [False] * (TASK.response_len - len(toks)))
    wrong.append(k)
  rows, masks = np.asarray(rows, np.int32), np.asarray(masks)
  # Row n-1 stays right: nothing to fix.
  rows[-1], masks[-1] = resp[-1], rmask[-1]
  tokens, loss_mask, ok = (np.asarray(x) for x in TASK.interventions(
      prompts, jnp.asarray(rows), jnp.asarray(masks), info))
  assert not ok[-1] and not loss_mask[-1].any()
  for i in range(n - 1):
    k = wrong[i]
    steps, _ = _split(rows[i], masks[i])
    gsteps, grest = _split(gold[i], gmask[i])
    fix = gsteps[k] if k < TASK.num_digits else grest  # the answer and EOS
    prefix = sum(steps[:k], [])
    want = prefix + fix
    assert ok[i]
    assert list(tokens[i, :len(want)]) == want, i
    assert all(t == TASK.pad_id for t in tokens[i, len(want):])
    assert list(np.nonzero(loss_mask[i])[0]) == list(range(len(prefix), len(want)))


@pytest.mark.parametrize('name', ['intervention', 'distil'])
def test_credit_is_grpo(name):
  mask, rewards, r = outcome_rollouts(0)
  want = np.where(mask, grpo_ref(rewards)[..., None], 0.0)
  np.testing.assert_allclose(credit.get(name)(r), want, atol=1e-6)
  np.testing.assert_allclose(credit.get(name)(r), credit.get('grpo')(r), atol=1e-6)


@pytest.mark.slow  # ~25 s: two loop runs (the rows are tested quickly above; DistIL's loop
def test_the_phase_runs_before_rl_and_counts_its_tokens(tmp_path):  # path below is quick)
  from experiments.training import loop
  from tests.test_loop import init_params, quick_cfg
  cfg = quick_cfg(default_task=True)
  cfg.task.kwargs = {'num_digits': 2}
  cfg.rl.steps, cfg.rl.ckpt_every = 1, 1
  cfg.credit.hparams = {'intervention_steps': 2}
  init = init_params(cfg)
  loop.train(cfg, str(tmp_path / 'int'), init, method='intervention:iid', progress=False)
  rows = loop.read_metrics(str(tmp_path / 'int' / 'metrics.jsonl'))
  first = rows[0]
  assert first['intervention_rows'] > 0 and first['intervention_s'] > 0
  assert np.isfinite(first['intervention_loss'])
  phase_tokens = first['intervention_generated_tokens']
  assert phase_tokens > 0
  np.testing.assert_allclose(rows[1]['generated_tokens_total'],
                             phase_tokens + rows[1]['generated_tokens'], rtol=1e-6)
  cfg.task.name, cfg.task.kwargs = 'addition', {'num_digits': 3}  # no step verifier
  with pytest.raises(ValueError, match='single-step interventions'):
    loop.train(cfg, str(tmp_path / 'add'), init_params(cfg), method='intervention:iid',
               progress=False)


@pytest.mark.slow  # ~28 s; this path exactly: test_golden's distil_iid; its loop state's resume: test_extension
def test_distil_imitates_after_each_update_and_resumes_exactly(tmp_path):
  from experiments.training import loop
  from tests.test_loop import init_params, quick_cfg, strip
  cfg = quick_cfg(default_task=True)
  cfg.task.kwargs = {'num_digits': 2}
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 2, 1, 1
  init = init_params(cfg)
  loop.train(cfg, str(tmp_path / 'whole'), init, method='distil:iid', progress=False)
  whole = loop.read_metrics(str(tmp_path / 'whole' / 'metrics.jsonl'))
  assert all(r['expert_rows'] > 0 and np.isfinite(r['expert_loss']) for r in whole[1:])
  cfg.rl.steps = 1  # the same run cut after step 1, then resumed (DistIL's Adam restored)
  loop.train(cfg, str(tmp_path / 'cut'), init, method='distil:iid', progress=False)
  cfg.rl.steps = 2
  loop.train(cfg, str(tmp_path / 'cut'), init, method='distil:iid', progress=False)
  cut = loop.read_metrics(str(tmp_path / 'cut' / 'metrics.jsonl'))
  assert strip(cut) == strip(whole)
