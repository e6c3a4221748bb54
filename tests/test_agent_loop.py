"""Multi-turn trajectories in the training loop: policy masks in the registry, token-level
estimators over whole trajectories (TEMPO, Tree-GRPO over turns) against plain-Python
references, IGPO and its answer probes, the household solver, packing, and the quick
agents comparison end to end."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import credit
import reference_tree
import reference_trie
from configs import agents as agents_config
from credit import agents
from credit.turns import Turns
from envs import exact_mdp, household
from experiments.rollouts import agent_rollouts
from experiments.training import compare, loop
from experiments.rollouts import agent_sampling as ags
from experiments.models import decoder
from experiments.training import train_step as ts
from test_agent_sampling import tiny_policy

MDP = exact_mdp.ExactMDP(max_turns=4)
HOUSE = household.Household(max_turns=6)
KEY = jax.random.key(3)


@pytest.fixture(scope="module")
def mdp_policy():
  s, a = MDP.num_states, MDP.num_actions
  return tiny_policy(MDP, range(s), range(s, s + a))


# The household tests sample as the quick agents loop below samples (its problem's policy
# config and start states, params placed as the loop places them, a raw key, the same
# static arguments): the end-to-end comparison then reuses their compiled samplers (its
# training and pass@k episodes: sample_episodes [4, 4]; tree_turns: fork_episodes [4, 2 x 2]
# forked at turn 1) instead of compiling each twice.
HOUSE_KEY = jax.random.PRNGKey(3)


@pytest.fixture(scope="module")
def house_problem():
  problem = agent_rollouts.AgentProblem(quick_agents_cfg('grpo:iid'))
  assert problem.env == HOUSE and problem.num_turns == HOUSE.max_turns
  return problem


@pytest.fixture(scope="module")
def house_policy(house_problem):
  pcfg = decoder.PolicyConfig(vocab_size=HOUSE.vocab_size, d_model=32, num_layers=1,
                              num_heads=2, d_ff=64, max_len=ags.sequence_length(HOUSE))
  assert house_problem.pcfg == pcfg
  params = decoder.init_params(jax.random.PRNGKey(1), pcfg)
  return jax.device_put(params, ts.param_sharding(params, ts.make_mesh(1))), pcfg


@pytest.fixture(scope="module")
def house_draw(house_problem):
  """The loop's draw of 4 start states: (state, obs, obs_mask) for the samplers' `start`."""
  return house_problem.draw(jax.random.fold_in(HOUSE_KEY, 0), 0, 4).handle


@pytest.fixture(scope="module")
def house_episodes(house_policy, house_draw):
  """G = 4 i.i.d. trajectories from each of the 4 start states (test_packed_logprobs',
  test_answer_probes' and test_solver_values' episodes)."""
  params, pcfg = house_policy
  return ags.sample_episodes(params, pcfg, HOUSE, HOUSE_KEY, 4, 4, 1.0,
                             num_turns=HOUSE.max_turns, start=house_draw, vocab=None)


# The tests' own calls of environment functions, jitted (one program each; op by op every
# primitive in them compiles on its own).
_reset = jax.jit(lambda env, key, n: env.reset(key, n), static_argnums=(0, 2))
_env_fn = jax.jit(lambda env, name, *args: getattr(env, name)(*args), static_argnums=(0, 1))


def unpad(tokens, mask):
  return [list(map(int, t[m])) for t, m in zip(np.asarray(tokens), np.asarray(mask))]


# --------------------------------------------------------------------------- policy_mask


def test_policy_mask_zeroes_advantages_and_loss_off_the_policy_tokens():
  tokens = jnp.asarray([[[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 3, 4]]], jnp.int32)
  mask = jnp.asarray([[[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]], bool)
  policy = jnp.asarray([[[0, 1, 0, 1], [0, 1, 0, 0], [0, 1, 0, 1]]], bool)
  rewards = jnp.asarray([[1.0, 0.0, 0.5]])
  full = credit.Rollouts(tokens, mask, rewards)
  part = full.replace(policy_mask=policy)
  for name in ("grpo", "tempo", "rloo", "treerl"):
    a_full, a_part = credit.get(name)(full), credit.get(name)(part)
    np.testing.assert_array_equal(a_part, jnp.where(policy, a_full, 0.0))
    np.testing.assert_array_equal(credit.loss_mask(name, part, a_part), policy)
  # An estimator with its own loss mask keeps only the policy's tokens of it.
  lp = jnp.log(jnp.full(tokens.shape, 0.5))
  spo = part.replace(logprobs=lp, parent=jnp.asarray([[-1, 0, -1]]), fork=jnp.asarray([[0, 2, 0]]))
  kept = credit.loss_mask("spo_chain", spo, credit.get("spo_chain")(spo))
  assert not np.any(np.asarray(kept) & ~np.asarray(policy))
  credit.validate(part)
  with pytest.raises(ValueError, match="outside mask"):
    credit.validate(part.replace(policy_mask=policy | ~mask))
  with pytest.raises(ValueError, match="policy_mask must be boolean"):
    credit.validate(part.replace(policy_mask=policy.astype(jnp.int32)))


# --------------------------------------------------------------------------- token-level estimators


def test_tempo_over_whole_trajectories_matches_the_dict_trie(mdp_policy):
  params, pcfg = mdp_policy
  ep = ags.sample_episodes(params, pcfg, MDP, KEY, 3, 8)
  rollouts = ags.to_rollouts(ep)
  credit.validate(rollouts)
  adv = np.asarray(credit.get("tempo")(rollouts))
  policy = np.asarray(ep.policy_mask)
  assert np.all(adv[~policy] == 0.0)
  for b in range(3):
    span = np.asarray(ep.span_mask[b])
    want = reference_trie.tempo_advantages(unpad(ep.tokens[b], span),
                                           [float(r) for r in ep.returns[b]])
    for g in range(8):
      got = adv[b, g][span[g]]
      np.testing.assert_allclose(np.where(policy[b, g][span[g]], want[g], 0.0), got, atol=1e-5)
  # Nothing branches inside a turn's action when every trajectory differs from the first
  # action on: then TEMPO's TD term vanishes on all later tokens, i.e. equals GRPO there.
  grpo = np.asarray(credit.get("grpo")(rollouts))
  assert np.any(adv != grpo) and np.all(np.isfinite(adv))


def test_tree_grpo_over_turns_matches_the_reference(mdp_policy):
  params, pcfg = mdp_policy
  n, c, fork_turn = 2, 4, 1
  ep = ags.fork_episodes(params, pcfg, MDP, KEY, 3, n, c, fork_turn)
  prompts, s = agent_rollouts.split_prompt(ep, MDP)
  np.testing.assert_array_equal(prompts, ep.tokens[:, 0, :MDP.obs_len])
  fn = loop.credit_fn("tree_grpo", "{}", True)
  adv, keep = fn(s.tokens, s.mask, ep.returns, s.parent, s.fork, s.logprobs, None,
                 policy_mask=s.policy_mask, turns=s.turns)
  adv, policy = np.asarray(adv), np.asarray(s.policy_mask)
  np.testing.assert_array_equal(keep, policy)
  lengths, parent, fork = (np.asarray(x) for x in (s.lengths, s.parent, s.fork))
  for b in range(3):
    tree = reference_tree.Tree(reference_tree.sampled_paths(lengths[b], parent[b], fork[b]),
                               np.asarray(ep.returns[b]))
    want = reference_tree.tree_grpo(tree)
    for g in range(n * c):
      got = adv[b, g, :lengths[b, g]]
      np.testing.assert_allclose(got, np.where(policy[b, g, :lengths[b, g]], want[g], 0.0),
                                 atol=1e-5)
  # Generated tokens and environment steps leave out the forks' copied turns.
  copied = np.sum(policy & (np.asarray(s.turns.token_turn) < np.asarray(s.fork_turn)[..., None]))
  assert float(s.generated_tokens) == policy.sum() - copied
  k = MDP.max_turns
  taken = np.asarray(s.turns.turn_mask)
  assert float(s.env_steps) == taken.sum() - np.sum(
      taken & (np.arange(k) < np.asarray(s.fork_turn)[..., None]))


def test_packed_logprobs_of_trajectories_equal_flat_rows(house_policy, house_episodes):
  params, pcfg = house_policy
  ep = house_episodes
  prompts, s = agent_rollouts.split_prompt(ep, HOUSE)
  cfg = agents_config.get_config()
  packed = loop.pack_groups(cfg.train, prompts, s)
  flat = loop.rows_logprobs(params, prompts, s.tokens, s.mask, cfg=pcfg)
  tree = loop.rows_logprobs(params, prompts, s.tokens, s.mask, None, packed, cfg=pcfg)
  np.testing.assert_allclose(tree, flat, atol=1e-5)
  # ... and the sampler's log-probs on the policy tokens.
  np.testing.assert_allclose(np.where(s.policy_mask, flat, 0.0), s.logprobs, atol=1e-4)


# 'paths' (slow): its packed log-probs and gradients equal flat rows in test_block_attention.
@pytest.mark.parametrize('attention', [pytest.param('paths', marks=pytest.mark.slow), 'blocks'])
def test_packed_update_of_forked_trajectories_equals_flat_rows(house_policy, house_draw,
                                                              attention):
  """Issue 21 item 5: forked multi-turn groups (a shared turn before the fork, actions
  and observations interleaved, the loss on policy tokens only) through the packed
  update step: loss, metrics, gradients and updated params equal the flat rows'."""
  params, pcfg = house_policy
  # The quick loop's tree_turns sampling (2 chains x 2, forked at turn 1: its program).
  ep = ags.fork_episodes(params, pcfg, HOUSE, HOUSE_KEY, 4, 2, 2, 1, 1.0,
                         num_turns=HOUSE.max_turns, start=house_draw, vocab=None)
  prompts, s = agent_rollouts.split_prompt(ep, HOUSE)
  tcfg = agents_config.get_config().train
  tcfg.pack_attention = attention
  packed = loop.pack_groups(tcfg, prompts, s)
  flat_slots = s.tokens.shape[1] * s.tokens.shape[2]
  assert int(packed.num_slots.max()) - prompts.shape[1] < flat_slots  # the forks' turns shared
  rng = np.random.default_rng(0)
  keep = s.policy_mask
  adv = jnp.where(keep, jnp.asarray(rng.normal(size=keep.shape), jnp.float32), 0.0)
  old = jnp.where(keep, s.logprobs + 0.2 * jnp.asarray(rng.normal(size=keep.shape)), 0.0)
  lc = ts.LossConfig(kl_coef=0.0, num_microbatches=2)
  results = []
  for pk in (None, packed):
    batch = ts.batch_from_samples(prompts, s.tokens, keep, adv, old.astype(jnp.float32),
                                  packing=pk)
    w = ts.token_weights(batch.mask, 'token-mean')
    loss_grad = jax.jit(jax.value_and_grad(ts.policy_loss, has_aux=True), static_argnums=(1, 2))
    (loss, _), grad = loss_grad(params, pcfg, lc, batch, (w, w))  # jitted: op by op is slow
    state = ts.init_state(jax.tree.map(jnp.copy, params), ts.make_optimizer(1e-2, 0))
    state, m = ts.train_step_jit(state, batch, cfg=pcfg, loss_cfg=lc)
    results.append((loss, grad, m, state.params))
  (l_f, g_f, m_f, p_f), (l_p, g_p, m_p, p_p) = results
  np.testing.assert_allclose(l_p, l_f, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_f)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for k in m_f:
    np.testing.assert_allclose(m_p[k], m_f[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # One Adam step at lr 1e-2: Adam's normalisation magnifies the gradients' last-bit
  # differences where a gradient is ~0; 'blocks' sums the softmax in another order than
  # flat rows ('paths' reproduces their order), so its bound is 1 % of the step.
  atol = 1e-5 if attention == 'paths' else 1e-4
  for a, b in zip(jax.tree.leaves(p_p), jax.tree.leaves(p_f)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


# --------------------------------------------------------------------------- IGPO


def igpo_reference(rewards, mask, logp, gamma, eps=1e-6):
  """One group, plain Python: IG rewards, z-normalised over the group's turns, returns."""
  g_n, k_n = len(mask), len(mask[0])
  n = [sum(row) for row in mask]
  r = [[rewards[g][k] + (0.0 if k == n[g] - 1 else
                         np.exp(logp[g][k + 1]) - np.exp(logp[g][k])) for k in range(n[g])]
       for g in range(g_n)]
  flat = [x for row in r for x in row]
  if len(flat) > 1 and max(flat) > min(flat):
    mu = sum(flat) / len(flat)
    sd = (sum((x - mu) ** 2 for x in flat) / (len(flat) - 1)) ** 0.5
    r = [[(x - mu) / (sd + eps) for x in row] for row in r]
  else:
    r = [[0.0] * len(row) for row in r]
  out = [[0.0] * k_n for _ in range(g_n)]
  for g in range(g_n):
    acc = 0.0
    for k in reversed(range(n[g])):
      acc = r[g][k] + gamma * acc
      out[g][k] = acc
  return out


def random_turns(rng, batch, g, k):
  n = rng.integers(0, k + 1, size=batch + (g,))
  mask = np.arange(k) < n[..., None]
  rewards = np.where(mask, rng.choice([0.0, 0.5, 1.0], size=mask.shape), 0.0)
  return Turns(state_ids=rng.integers(0, 5, size=batch + (g, k + 1)).astype(np.int32),
               rewards=rewards.astype(np.float32), turn_mask=mask,
               answer_logprobs=np.log(rng.uniform(0.05, 1.0, size=batch + (g, k + 1))
                                      ).astype(np.float32))


def test_igpo_matches_the_reference_and_is_grpo_with_one_turn():
  rng = np.random.default_rng(0)
  for gamma in (1.0, 0.9):
    turns = random_turns(rng, (3,), 5, 4)
    got = np.asarray(agents.igpo(turns, gamma=gamma))
    for b in range(3):
      want = igpo_reference(turns.rewards[b].tolist(), turns.turn_mask[b].tolist(),
                            turns.answer_logprobs[b].tolist(), gamma)
      np.testing.assert_allclose(got[b], want, atol=2e-5)
  one = random_turns(rng, (4,), 6, 1)
  one = one.replace(turn_mask=np.ones((4, 6, 1), bool))
  r = np.asarray(one.rewards)[..., 0]
  grpo = credit.get("grpo")(credit.Rollouts(np.zeros((4, 6, 1), np.int32),
                                            np.ones((4, 6, 1), bool), r))[..., 0]
  np.testing.assert_allclose(np.asarray(agents.igpo(one))[..., 0], grpo, atol=1e-6)
  with pytest.raises(ValueError, match="answer_logprobs"):
    agents.igpo(one.replace(answer_logprobs=None))


def test_answer_probes_equal_teacher_forcing_of_the_answer(house_policy, house_draw,
                                                           house_episodes):
  params, pcfg = house_policy
  ep = house_episodes  # test_packed_logprobs' episodes
  state = house_draw[0]  # their start states
  answer, amask = _env_fn(HOUSE, 'answer', state)
  answer, amask = (jnp.repeat(x[:, None], 4, 1) for x in (answer, amask))
  got = np.asarray(ags.answer_logprobs(params, pcfg, HOUSE, ep.tokens, answer, amask))
  action_pos, _, _ = ags.slot_layout(HOUSE)
  tokens = np.asarray(ep.tokens)
  probes = [(b, g, k) for b, g in ((0, 0), (1, 1)) for k in range(HOUSE.max_turns)]
  seqs = []
  for b, g, k in probes:
    start = action_pos[k, 0]
    seq = np.concatenate([tokens[b, g, :start], np.asarray(answer[b, g])])
    # Padded to one length (one batch; causal attention ignores what follows).
    seqs.append(np.pad(seq, (0, tokens.shape[-1] - len(seq))))
  seqs = jnp.asarray(np.stack(seqs))
  lp, _ = jax.jit(decoder.token_logprobs, static_argnums=1)(params, pcfg, seqs[:, :1],
                                                            seqs[:, 1:])
  for i, (b, g, k) in enumerate(probes):
    start = action_pos[k, 0]
    want = np.mean(np.asarray(lp)[i, start - 1:start - 1 + HOUSE.action_len])
    np.testing.assert_allclose(got[b, g, k], want, atol=1e-5, err_msg=(b, g, k))
  for b, g in ((0, 0), (1, 1)):
    assert got[b, g, -1] == got[b, g, -2]  # index K is not probed


# --------------------------------------------------------------------------- household solver


EXPERT_ENV = household.Household(max_turns=8)  # the expert tests' (their programs compile once)


def test_household_expert_solves_and_its_distances_count_down():
  env = EXPERT_ENV
  state = _reset(env, jax.random.fold_in(jax.random.key(0), 0), 128)[0]  # expert_episodes' starts
  d0 = np.asarray(_env_fn(env, 'optimal_distance', state))
  assert list(d0) == [len(env.expert_plan(state, i)) for i in range(128)]
  ep = ags.expert_episodes(env, jax.random.key(0), 128)
  assert bool(jnp.all(ep.success))
  d = np.asarray(ep.distances)[:, 0]
  n = np.asarray(ep.lengths)[:, 0]
  np.testing.assert_array_equal(n, d0)
  for k in range(env.max_turns):
    np.testing.assert_array_equal(d[:, k], np.maximum(d0 - k, 0))
  # From a state holding another object the expert puts it down first, then solves.
  other = (state.goal_obj + 1) % household.NUM_OBJ
  held = state.replace(holding=other.astype(jnp.int32),
                       obj_loc=state.obj_loc.at[jnp.arange(128), other].set(-1))
  assert np.all(np.asarray(_env_fn(env, 'optimal_distance', held)) >= d0 + 1)
  start = (held, *_env_fn(env, 'observe', held))
  ep2 = ags.expert_episodes(env, jax.random.key(0), 128, start=start)
  assert bool(jnp.all(ep2.success))
  np.testing.assert_array_equal(ep2.lengths[:, 0], _env_fn(env, 'optimal_distance', held))
  # CAST's solver values: γ^(d-1) plus the reward so far; advantages telescope to
  # R - V*(s_0) on every trajectory.
  gamma = 0.9
  values = np.asarray(ags.solver_values(ep, env, gamma))
  np.testing.assert_allclose(values[:, 0, 0], gamma ** (d0 - 1), rtol=1e-6)
  cast = np.asarray(agents.cast(Turns(ep.state_ids, ep.turn_rewards, ep.turn_mask,
                                      values_star=values), **agents.CAST_VALUE_DIFFERENCE))
  np.testing.assert_allclose(cast.sum(-1)[:, 0], 1.0 - gamma ** (d0 - 1), atol=1e-6)
  assert np.all(cast[:, 0][np.asarray(ep.turn_mask)[:, 0]] >= -1e-7)  # the expert never loses
  # At γ = 1 that form gives every expert move 0, the solving one included (R = 1 + V = 0
  # against R_{<k} = 0 + V = 1): nothing in it rewards finishing (issue 23's cause of the
  # collapse).
  flat = np.asarray(agents.cast(Turns(ep.state_ids, ep.turn_rewards, ep.turn_mask,
                                      values_star=ags.solver_values(ep, env, 1.0)),
                                **agents.CAST_VALUE_DIFFERENCE))
  assert np.all(flat == 0)
  # The paper's recipe reads the step counts: every expert move is one step closer, the
  # solving move included.
  steps = np.asarray(ags.solver_steps(ep, env))
  np.testing.assert_array_equal(steps, np.asarray(ep.distances))  # all solved: unchanged
  taken = np.asarray(ep.turn_mask)
  recipe = np.asarray(agents.cast(Turns(ep.state_ids, ep.turn_rewards, ep.turn_mask,
                                        solver_steps=steps), outcome='none', alpha=1.0))
  np.testing.assert_allclose(recipe[taken], 1.0, rtol=1e-6)  # asinh(1) over its RMS
  # A trajectory that ended without success at distance 0 (webshop: a wrong purchase ends
  # the episode) keeps its previous count there: no step credit for the failing turn.
  i, n0 = 0, int(n[0])
  failed = ep.replace(success=ep.success.at[i, 0].set(False),
                      distances=ep.distances.at[i, 0, n0 - 1].set(5))
  fixed = np.asarray(ags.solver_steps(failed, env))
  assert fixed[i, 0, n0] == 5 and fixed[i, 0, n0 - 1] == 5
  np.testing.assert_array_equal(fixed[1:], steps[1:])


def test_household_answer_is_the_final_put():
  env = EXPERT_ENV
  state = _reset(env, jax.random.fold_in(jax.random.key(0), 0), 128)[0]  # expert_episodes' starts
  answer, mask = _env_fn(env, 'answer', state)
  ep = ags.expert_episodes(env, jax.random.key(0), 128)
  _, actions, _ = ags.split_slots(ep.tokens[:, 0], env)
  last = np.take_along_axis(np.asarray(actions), np.asarray(ep.lengths)[:, :1, None] - 1, 1)[:, 0]
  np.testing.assert_array_equal(last, answer)
  assert bool(jnp.all(mask))


# --------------------------------------------------------------------------- the loop


def quick_agents_cfg(methods):
  cfg = agents_config.shrink(agents_config.get_config())
  cfg.progress = False
  cfg.methods = methods
  return cfg


def test_quick_agents_comparison_end_to_end(tmp_path, capsys):
  # tree_grpo needs the forks; ppo_turns the learned critic's values at turn boundaries; taura
  # the teacher-forced entropies of the actions. The fields the multi-turn problem computes
  # (CAST's solver values, ReBel's milestones and feedback log-probs, the answer probes):
  # test_agent_needs; the family runs that train on them are slow-marked.
  methods = ('grpo:iid', 'tree_grpo:tree_turns', 'ppo_turns:iid', 'taura:iid')
  cfg = quick_agents_cfg(','.join(methods))
  summary = compare.run_experiment(cfg, str(tmp_path))
  out = capsys.readouterr().out
  assert 'environment steps' in out and 'taura:iid' in out
  first = {}
  for method in methods:
    rows = loop.read_metrics(os.path.join(compare.run_dir(str(tmp_path), method, 0),
                                          'metrics.jsonl'))
    train = [r for r in rows if 'reward' in r]
    assert len(train) == cfg.rl.steps
    totals = [r['env_steps_total'] for r in train]
    assert totals == list(np.cumsum([r['env_steps'] for r in train]))
    rows_per_step = cfg.rl.prompts_per_step * 4  # G = 4 for both samplers
    for r in train:
      trained = r['response_len'] * rows_per_step  # action tokens in the batch
      if method.endswith(':iid'):
        assert r['generated_tokens'] == pytest.approx(trained)
      else:  # forks copy their chain's turns before fork_turn
        assert 0 < r['generated_tokens'] < trained
      assert 0.0 <= r['success'] <= 1.0 and np.isfinite(r['loss'])
    assert 'greedy_acc' in rows[-1] and 'eval_return' in rows[-1]
    assert all(('critic/vf_loss' in r) == (method == 'ppo_turns:iid') for r in train)
    assert all(np.isfinite(r.get('critic/vf_loss', 0.0)) for r in train)
    first[method] = train[0]
  # No episode of the first batch succeeds: GRPO's advantages are 0.
  assert first['grpo:iid']['success'] == 0 and first['grpo:iid']['loss'] == 0
  s = json.load(open(tmp_path / 'summary.json'))
  assert np.isfinite(s['matched_tokens']['budget_env_steps'])
  assert set(s['paired']['by_method']) == set(methods) - {'grpo:iid'}
  # Forks copy their chain's first turns: fewer generated tokens than i.i.d. rollouts.
  assert (s['methods']['tree_grpo:tree_turns'][0]['generated_tokens_total']
          < s['methods']['grpo:iid'][0]['generated_tokens_total'])
  assert summary['methods'].keys() == s['methods'].keys()


def test_agent_configs_check_and_wrong_samplers_fail_clearly(tmp_path):
  for name in ('agents', 'gigpo', 'gagpo', 'salt', 'graphgpo', 'gtpo', 'cast', 'igpo',
               'tree_grpo_turns'):
    cfg = __import__(f'configs.{name}', fromlist=['get_config']).get_config()
    loop.check_config(cfg)
    assert 'grpo:iid' in cfg.methods.split(',')
  with pytest.raises(ValueError, match="does not play multi-turn"):
    loop.check_config(quick_agents_cfg('grpo:tree_fixed'))
  from configs import tempo
  cfg = tempo.get_config()
  cfg.methods = 'grpo:tree_turns'
  with pytest.raises(ValueError, match="multi-turn environment"):
    loop.check_config(cfg)
  cfg = tempo.shrink(tempo.get_config())
  cfg.progress = False
  cfg.task.name, cfg.task.kwargs = 'addition', {'num_digits': 3}
  params = decoder.init_params(jax.random.PRNGKey(0), loop.policy_config(cfg, loop.build_task(cfg)))
  with pytest.raises(ValueError, match="multi-turn"):
    loop.train(cfg, str(tmp_path), params, method='gigpo:iid')


# --------------------------------------------------------------------------- a pretrained LM


def test_smollm2_plays_household_through_its_own_tokens():
  """The built-in SmolLM2 as the policy: environment words are its tokens (aliases where
  its BPE splits a word), sampling log-probs equal one teacher-forced forward of the real
  model, and the words it reads are the environment's text."""
  cfg = quick_agents_cfg('grpo:iid')
  cfg.agent.update(lm_source='smollm2', num_turns=2)
  problem = agent_rollouts.AgentProblem(cfg)
  vocab, env = problem.vocab, problem.env
  np.testing.assert_array_equal(vocab.to_env[vocab.to_lm], np.arange(env.vocab_size))
  tokenizer = problem.tokenizer
  draw = problem.draw(jax.random.key(0), 0, 1)
  state, obs, mask = draw.handle
  text = tokenizer.decode(np.asarray(draw.prompts[0])[np.asarray(mask[0])])
  assert text.strip() == env.detokenize(np.asarray(obs[0])[np.asarray(mask[0])]).replace(
      'mug', 'cup')
  scfg = cfg.sampler.copy_and_resolve_references()
  scfg.update(name='iid', group_size=2)
  s = problem.sample(problem.init_params, scfg, jax.random.key(1), draw)
  policy = np.asarray(s.policy_mask)
  assert policy.any()
  full = ags.teacher_forced_logprobs(problem.init_params, problem.pcfg, s.episodes.tokens)
  np.testing.assert_allclose(np.asarray(full)[..., env.obs_len:][policy],
                             np.asarray(s.logprobs)[policy], atol=2e-3)
  with pytest.raises(ValueError, match="not one token"):
    agent_rollouts.lm_vocab_map(env, tokenizer, {'mug': 'mugmugmugx'})


def test_solver_values_bootstrap_trajectories_cut_by_the_turn_limit(house_episodes):
  """A trajectory that runs out of turns is truncated, not failed: its last value is the
  solver value of where it stopped (no cliff on the turn the deadline became infeasible)."""
  ep = house_episodes  # test_packed_logprobs' episodes
  cut = ~np.asarray(ep.success) & (np.asarray(ep.lengths) == HOUSE.max_turns)
  assert cut.any()
  values = np.asarray(ags.solver_values(ep, HOUSE, 0.9))
  d = np.asarray(ep.distances)
  np.testing.assert_allclose(values[cut][:, -1], 0.9 ** (d[cut][:, -1] - 1), rtol=1e-6)
  assert np.all(d[cut][:, -1] >= 1)
