"""Tool-call and evidence credit (issue 23): the masked answer probes
(experiments/rollouts/agent_sampling.py) against teacher forcing of hand-built contexts, and TACO's
tool credit and ICA (credit/tool_credit.py) against plain-Python references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import credit
from credit import tool_credit as tc
from credit.turns import Turns, validate_turns
from envs.household import Household
from experiments.rollouts import agent_sampling as ags
from test_step_graph import turn_groups  # noqa: E402 (tests/ is on sys.path)

G, K = 4, 5


@pytest.mark.parametrize('at', ['next', 'last'])
def test_masked_answer_probes_equal_teacher_forcing_of_the_masked_context(at):
  from experiments.models import decoder
  env, nt = Household(max_turns=6), 4  # probed over the first 4 turns
  pcfg = decoder.PolicyConfig(vocab_size=env.vocab_size, d_model=16, num_layers=1, num_heads=2,
                              d_ff=32, max_len=ags.sequence_length(env, nt))
  params = decoder.init_params(jax.random.PRNGKey(2), pcfg)
  ep = ags.sample_episodes(params, pcfg, env, jax.random.key(4), 2, 2, num_turns=nt)
  tokens = np.asarray(ep.tokens)
  n = np.array([[4, 3], [1, 2]])  # lengths of our own choosing: the probe reads only the mask
  turn_mask = np.arange(4) < n[..., None]
  rng = np.random.default_rng(0)
  answer = rng.integers(0, env.vocab_size - 2, (2, 2, env.action_len)).astype(np.int32)
  amask = np.arange(env.action_len) < np.array([[2, 1], [2, 2]])[..., None]
  got = np.asarray(ags.masked_answer_logprobs(params, pcfg, env, ep.tokens, answer, amask,
                                              turn_mask, env.pad_id, at=at, num_turns=nt))
  action_pos, obs_pos, _ = ags.slot_layout(env, nt)
  lp = jax.jit(lambda x: decoder.token_logprobs(params, pcfg, x[:, :1], x[:, 1:])[0])
  for b in range(2):
    for g in range(2):
      for k in range(4):
        if k >= n[b, g] - 1:
          assert got[b, g, k] == 0.0
          continue
        x = tokens[b, g].copy()
        x[obs_pos[k]] = env.pad_id
        pos = action_pos[k + 1 if at == 'next' else n[b, g] - 1]
        x[pos] = answer[b, g]
        want = np.asarray(lp(jnp.asarray(x[None])))[0][pos - 1][amask[b, g]].mean()
        np.testing.assert_allclose(got[b, g, k], want, rtol=1e-4, atol=1e-5)
  assert np.any(got != 0)
  # A view that is already padding changes nothing: "without" equals IGPO's probe after it.
  if at == 'next':
    blank = tokens.copy()
    blank[..., obs_pos[0]] = env.pad_id
    without = ags.masked_answer_logprobs(params, pcfg, env, blank, answer, amask, turn_mask,
                                         env.pad_id, at=at, num_turns=nt)
    with_ = ags.answer_logprobs(params, pcfg, env, blank, answer, amask, num_turns=nt)
    np.testing.assert_allclose(np.asarray(without)[0, :, 0], np.asarray(with_)[0, :, 1],
                               rtol=1e-5, atol=1e-6)


def _grpo(x):
  x = np.asarray(x, np.float64)
  return np.zeros_like(x) if x.max() == x.min() else (x - x.mean()) / (x.std(ddof=1) + 1e-6)


def ref_tool_credit(name, rewards, mask, alp, probes, beta, route=True):
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    n = mask[b].sum(-1)
    a = _grpo([np.sum(rewards[b, i, :n[i]]) for i in range(G)])
    p = np.exp(alp[b].astype(np.float64))
    contrib = {}
    for i in range(G):
      for k in range(n[i] - 1):  # the calls
        last = k + 1 if name == 'taco_tools' else n[i] - 1
        contrib[i, k] = p[i, last] - np.exp(np.float64(probes[b, i, k]))
    if name == 'ica':
      vals = list(contrib.values())
      for key, v in contrib.items():
        contrib[key] = (0.0 if len(vals) < 2 or max(vals) == min(vals)
                        else (v - np.mean(vals)) / (np.std(vals, ddof=1) + 1e-6))
    for i in range(G):
      for k in range(n[i]):
        if k == n[i] - 1:
          out[b, i, k] = a[i]
        elif name == 'ica':
          out[b, i, k] = a[i] + beta * contrib[i, k]
        else:
          d = contrib[i, k]
          routed = a[i] if (not route or np.sign(d) == np.sign(a[i])) else 0.0
          out[b, i, k] = routed + beta * d
  return out


@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([('taco_tools', 1.0, True), ('taco_tools', 0.5, False),
                        ('ica', 1.0, True), ('ica', 0.3, True)]))
def test_tool_credit_matches_reference(group, seed, hp):
  name, beta, route = hp
  ids, rewards, mask, success = group
  rng = np.random.default_rng(seed)
  alp = np.log(rng.uniform(0.01, 1.0, ids.shape)).astype(np.float32)
  probes = np.log(rng.uniform(0.01, 1.0, mask.shape)).astype(np.float32)
  field = 'tool_probes' if name == 'taco_tools' else 'evidence_probes'
  turns = validate_turns(Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success,
                               answer_logprobs=alp, **{field: probes}))
  kw = dict(route=route) if name == 'taco_tools' else {}
  got = np.asarray(tc.TOOL_CREDIT_ESTIMATORS[name](turns, beta=beta, **kw))
  want = ref_tool_credit(name, np.where(mask, rewards, 0.0), mask, alp, probes, beta, route)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def _turns(n, probes_value=-1.0):
  mask = np.arange(K) < np.asarray(n)[:, None]
  last = mask & ~np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], -1)
  rewards = np.where(last, np.array([1.0, 0.0, 1.0, 0.0])[:, None], 0.0).astype(np.float32)
  rng = np.random.default_rng(1)
  return Turns(state_ids=np.zeros((G, K + 1), np.int32), rewards=rewards, turn_mask=mask,
               answer_logprobs=np.log(rng.uniform(0.1, 1, (G, K + 1))).astype(np.float32),
               tool_probes=np.full((G, K), probes_value, np.float32),
               evidence_probes=np.full((G, K), probes_value, np.float32))


def test_outcome_reductions_are_grpo():
  grpo = _grpo([1.0, 0.0, 1.0, 0.0])
  one = _turns([1, 1, 1, 1])  # one-turn trajectories: no calls
  for name in ('taco_tools', 'ica'):
    np.testing.assert_allclose(np.asarray(tc.TOOL_CREDIT_ESTIMATORS[name](one))[:, 0], grpo,
                               rtol=1e-5)
  many = _turns([5, 3, 2, 4])
  every = np.where(np.asarray(many.turn_mask), grpo[:, None], 0.0)
  np.testing.assert_allclose(np.asarray(tc.taco_tools(many, beta=0.0, route=False)), every,
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(tc.ica(many, beta=0.0)), every, rtol=1e-5, atol=1e-7)
  # OGAR: with beta = 0 a call gets the outcome only where its DAPR has the outcome's sign.
  routed = np.asarray(tc.taco_tools(many, beta=0.0))
  d = np.exp(np.asarray(many.answer_logprobs))[:, 1:] - np.exp(-1.0)
  calls = np.asarray(many.turn_mask) & (np.arange(K) < np.array([4, 2, 1, 3])[:, None])
  want = np.where(calls & (np.sign(d) != np.sign(grpo[:, None])), 0.0, every)
  np.testing.assert_allclose(routed, want, rtol=1e-5, atol=1e-7)
  assert np.any(routed != every)


def test_tool_credit_needs_its_probes_and_checks_them():
  turns = _turns([5, 3, 2, 4])
  with pytest.raises(ValueError, match='tool_probes'):
    tc.taco_tools(turns.replace(tool_probes=None))
  with pytest.raises(ValueError, match='evidence_probes'):
    tc.ica(turns.replace(evidence_probes=None))
  with pytest.raises(ValueError, match='answer_logprobs'):
    tc.ica(turns.replace(answer_logprobs=None))
  bad = np.asarray(turns.tool_probes).copy()
  bad[1, 1] = np.nan  # a call (trajectory 1 takes 3 turns)
  with pytest.raises(ValueError, match=r'tool_probes\[1, 1\]'):
    tc.taco_tools(turns.replace(tool_probes=bad))
  bad[1, 1], bad[1, 2] = -1.0, np.nan  # its answer turn: not read
  assert np.all(np.isfinite(np.asarray(tc.taco_tools(turns.replace(tool_probes=bad)))))
  with pytest.raises(ValueError, match='evidence_probes must be floats'):
    tc.ica(turns.replace(evidence_probes=np.zeros((G, K - 1), np.float32)))
  assert credit.needs('taco_tools') == ('turns', 'answer_logprobs', 'tool_probes')
  assert credit.needs('ica') == ('turns', 'answer_logprobs', 'evidence_probes')


# ~31 s: the answer probes reaching TACO, ICA and PiCA: test_agent_needs; the agent loop's
# turns pass: test_golden's agents_experience.
@pytest.mark.slow
def test_tool_credit_family_script_runs_quick(tmp_path):
  from configs import agents as agents_config
  from configs import tool_credit as tool_config
  from experiments.training import compare, loop
  cfg = agents_config.shrink(tool_config.get_config(), tool_config.get_config())
  cfg.progress = False
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 1, 1, 1  # one update each
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['grpo:iid', 'ica:iid', 'pica:iid', 'taco_tools:iid']
  train = {m: [r for r in loop.read_metrics(tmp_path / m.replace(':', '_') / 'seed0' /
                                            'metrics.jsonl') if 'reward' in r]
           for m in summary['methods']}
  for m in ('taco_tools:iid', 'ica:iid', 'pica:iid'):
    assert len(train[m]) == cfg.rl.steps and all(np.isfinite(r['loss']) for r in train[m]), m
    # Same samples at the first step (same start and key), other credit: another loss, but
    # for PiCA in a batch without a success (no pivots: its documented reduction to GRPO).
    first, base = train[m][0], train['grpo:iid'][0]
    assert first['reward'] == base['reward']
    if m == 'pica:iid' and first['success'] == 0:
      assert first['loss'] == base['loss']
    else:
      assert first['loss'] != base['loss'], m


def ref_pica(ids, rewards, mask, success, alp, beta, gamma):
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    n = mask[b].sum(-1)
    a = _grpo([np.sum(rewards[b, i, :n[i]]) for i in range(G)])
    gold = {int(ids[b, h, j]) for h in range(G) if success[b, h] for j in range(1, n[h] + 1)}
    p = np.exp(alp[b].astype(np.float64))
    r = np.zeros((G, K))
    for i in range(G):
      phi = p[i, 0]
      for k in range(n[i] - 1):  # the calls
        new = p[i, k + 1] if int(ids[b, i, k + 1]) in gold else phi
        r[i, k], phi = new - phi, new
    ret = {(i, k): sum(gamma ** (j - k) * r[i, j] for j in range(k, n[i]))
           for i in range(G) for k in range(n[i])}
    vals = list(ret.values())
    for (i, k), v in ret.items():
      norm = (0.0 if len(vals) < 2 or max(vals) == min(vals)
              else (v - np.mean(vals)) / (np.std(vals, ddof=1) + 1e-6))
      out[b, i, k] = a[i] + beta * norm
  return out


@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([(1.0, 1.0), (0.5, 0.9)]))
def test_pica_matches_reference(group, seed, hp):
  ids, rewards, mask, success = group
  alp = np.log(np.random.default_rng(seed).uniform(0.01, 1.0, ids.shape)).astype(np.float32)
  turns = validate_turns(Turns(state_ids=ids, rewards=rewards, turn_mask=mask, success=success,
                               answer_logprobs=alp))
  got = np.asarray(tc.pica(turns, beta=hp[0], gamma=hp[1]))
  want = ref_pica(ids, np.where(mask, rewards, 0.0), mask, success, alp, *hp)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_pica_without_a_success_is_grpo():
  turns = _turns([5, 3, 2, 4]).replace(state_ids=np.arange(G * (K + 1), dtype=np.int32)
                                       .reshape(G, K + 1) % 3)
  every = np.where(np.asarray(turns.turn_mask), _grpo([1.0, 0.0, 1.0, 0.0])[:, None], 0.0)
  np.testing.assert_allclose(np.asarray(tc.pica(turns.replace(success=np.zeros(G, bool)))),
                             every, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(tc.pica(turns.replace(success=np.ones(G, bool)),
                                                beta=0.0)), every, rtol=1e-5, atol=1e-7)
  shaped = np.asarray(tc.pica(turns.replace(success=np.ones(G, bool))))
  assert not np.allclose(shaped, every)
  with pytest.raises(ValueError, match='success'):
    tc.pica(turns)
