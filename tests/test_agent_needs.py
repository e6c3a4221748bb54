"""Every `Turns` need of `credit.NEEDS` from the multi-turn problem (`AgentProblem.turns`),
checked against the sampling module's functions called here on the same episodes, and read
by the estimators that declare it. The agent family scripts run the same wiring end to end
(slow-marked: test_agent_loop, test_tool_credit, test_turn_norm)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import credit
from configs import agents as agents_config
from credit.vocabulary import NEEDS
from experiments.models import decoder
from experiments.rollouts import agent_rollouts
from experiments.rollouts import agent_sampling as ags
from experiments.training import forward

TURN_NEEDS = tuple(k for k, v in NEEDS.items() if v.kind == 'turns')
# household has no retries: 'attempts' is household_retry's (test_turn_norm's loop run).
HOUSEHOLD_NEEDS = tuple(k for k in TURN_NEEDS if k != 'attempts')
B, G = 2, 4
# A field an estimator reads only under other hyperparameters than its defaults.
READ_WITH = {('cast', 'values_star'): {'signal': 'values'}}


@pytest.fixture(scope='module')
def batch():
  cfg = agents_config.shrink(agents_config.get_config())
  problem = agent_rollouts.AgentProblem(cfg)
  params = decoder.init_params(jax.random.PRNGKey(0), problem.pcfg)
  draw = problem.draw(jax.random.key(0), 0, B)
  scfg = cfg.sampler.copy_and_resolve_references()
  scfg.update(name='iid', group_size=G)
  samples = problem.sample(params, scfg, jax.random.key(1), draw)
  return problem, params, draw, samples


def expected(field, problem, params, draw, samples):
  """The field as the sampling module computes it from the episodes (the gold answer from the
  group's start state, the expert's trace from the same start)."""
  env, e, k = problem.env, samples.episodes, problem.num_turns
  if field == 'values_star':
    return ags.solver_values(e, env, problem.gamma)
  if field == 'solver_steps':
    return ags.solver_steps(e, env)
  if field == 'milestones':
    return ags.milestone_turns(e, env)
  if field == 'info_gains':
    gains = ags.info_gains(params, problem.pcfg, env, e.tokens, e.policy_mask, env.pad_id,
                           num_turns=k)
    return jnp.where(e.turn_mask, gains, 0.0)
  if field == 'feedback_logprobs':
    return ags.feedback_logprobs(params, problem.pcfg, env, e.tokens, e.turn_mask, env.pad_id,
                                 num_turns=k)
  if field == 'expert_matches':
    expert = ags.expert_episodes(env, jax.random.key(0), B, num_turns=k, start=draw.handle)
    return ags.expert_matches(e, expert, env, k)
  answer, amask = env.answer(draw.handle[0])
  answer, amask = (jnp.repeat(x[:, None], G, 1) for x in (answer, amask))
  if field == 'answer_logprobs':
    return ags.answer_logprobs(params, problem.pcfg, env, e.tokens, answer, amask, num_turns=k)
  at = {'tool_probes': 'next', 'evidence_probes': 'last'}[field]
  return ags.masked_answer_logprobs(params, problem.pcfg, env, e.tokens, answer, amask,
                                    e.turn_mask, env.pad_id, at=at, num_turns=k)


def test_turns_compute_exactly_the_fields_asked_for(batch):
  problem, params, draw, samples = batch
  assert set(TURN_NEEDS) == set(problem.TURN_FIELDS)
  bare = problem.turns(params, draw, samples, needs=('turns',))
  assert all(getattr(bare, f) is None for f in TURN_NEEDS)
  for field in HOUSEHOLD_NEEDS:
    turns = problem.turns(params, draw, samples, needs=('turns', field))
    credit.validate_turns(turns, samples)
    # a masked probe comes with the plain one (TACO and ICA compare the two)
    also = {'answer_logprobs'} if field in ('tool_probes', 'evidence_probes') else set()
    assert {f for f in TURN_NEEDS if getattr(turns, f) is not None} == {field} | also
    got, want = np.asarray(getattr(turns, field)), np.asarray(expected(field, problem, params,
                                                                        draw, samples))
    assert got.shape[:2] == (B, G) and np.all(np.isfinite(got)), field
    np.testing.assert_array_equal(got, want, err_msg=field)
  with pytest.raises(ValueError, match='household_retry'):
    problem.turns(params, draw, samples, needs=('turns', 'attempts'))


def test_each_estimator_reads_the_turn_fields_it_declares(batch):
  """Another value of a declared field changes the estimator's advantages on this batch
  (random values: the untrained policy reaches no milestone and matches no expert move here;
  and every other episode is made a success on its last turn, as it succeeds nowhere; a
  critic's values and the entropies are other passes')."""
  problem, params, draw, samples = batch
  turns = problem.turns(params, draw, samples, needs=('turns',) + HOUSEHOLD_NEEDS)
  success = jnp.tile(jnp.arange(G) % 2 == 0, (B, 1))
  last = jnp.sum(turns.turn_mask, -1, keepdims=True) - 1
  k = turns.turn_mask.shape[-1]
  rewards = success.astype(jnp.float32)
  turns = turns.replace(success=success, rewards=jnp.where(
      success[..., None] & (jnp.arange(k) == last), 1.0, 0.0).astype(jnp.float32))
  names = [n for n in credit.names()
           if set(credit.needs(n)) & set(HOUSEHOLD_NEEDS)
           and set(credit.needs(n)) <= {'turns', *HOUSEHOLD_NEEDS}]
  assert {'cast', 'beacon', 'rebel', 'igpo', 'ica', 'pica', 'taco_tools', 'infopo',
          'matchtir'} <= set(names)
  s, rng = samples, np.random.default_rng(0)
  for name in names:
    for field in sorted(set(credit.needs(name)) & set(HOUSEHOLD_NEEDS)):
      fn = forward.credit_fn(name, json.dumps(READ_WITH.get((name, field), {})), False)
      adv = lambda t: np.asarray(fn(s.tokens, s.mask, rewards, s.parent, s.fork, s.logprobs,
                                    None, policy_mask=s.policy_mask, turns=t)[0])
      full = adv(turns)
      assert full.shape == s.tokens.shape and np.all(np.isfinite(full)), name
      value = np.asarray(getattr(turns, field))
      other = (rng.integers(0, 2, value.shape) if value.dtype.kind in 'biu'
               else value + rng.normal(size=value.shape)).astype(value.dtype)
      assert not np.array_equal(full, adv(turns.replace(**{field: jnp.asarray(other)}))), (
          name, field)
