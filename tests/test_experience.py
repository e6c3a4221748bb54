"""SLEA-RL (#46): the experience wrapper (envs/experience.py) and the library's update
(experiments/training/experience.py) against a plain-Python reading of its rules, and the
'experience' sampler through the loop."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp

import envs
from envs import experience as X
from experiments.training import experience as L

PAD, EOA = 9, 8  # the toy action vocabulary of the reference test: tokens 0..7, EOA, PAD


def _ref_update(lib, turns, *, admit, min_count, max_new, ema):
  """Plain Python: lib a dict of lists (slots), turns [(cluster, action tuple, taken, won)]."""
  s = len(lib['tip_key'])
  slot = lambda c: (c % 2**32) % s
  def hint(action):
    out = []
    for t in action:
      if t == EOA:
        break
      out.append(t)
    return tuple(out + [PAD] * (len(action) - 1 - len(out)))[:len(action) - 1]
  taken = [t for t in turns if t[2]]
  hit_rate = tuple(
      sum(1 for c, _, _, _ in taken if lib[score][slot(c)] >= 0 and lib[key][slot(c)] == c)
      / max(len(taken), 1) for score, key in (('tip_score', 'tip_key'),
                                              ('avoid_count', 'avoid_key')))
  pairs = {}  # (cluster, hint) -> [count, wins, first index]
  for i, (c, a, tk, won) in enumerate(turns):
    if tk and EOA in a:
      p = pairs.setdefault((c, hint(a)), [0, 0, i])
      p[0] += 1
      p[1] += int(won)
  f32 = np.float32
  score, count_av = [f32(x) for x in lib['tip_score']], [f32(x) for x in lib['avoid_count']]
  for j in range(s):
    p = pairs.get((lib['tip_key'][j], tuple(lib['tip'][j])))
    if score[j] >= 0 and p:
      score[j] = f32(1 - ema) * score[j] + f32(ema) * (f32(p[1]) / f32(p[0]))
      if score[j] < admit:
        score[j] = f32(-1)
    p = pairs.get((lib['avoid_key'][j], tuple(lib['avoid'][j])))
    if count_av[j] >= 0 and p and p[1] > 0:
      count_av[j] = f32(-1)
  is_tip = lambda c, h: (score[slot(c)] >= 0 and lib['tip_key'][slot(c)] == c
                         and tuple(lib['tip'][slot(c)]) == h)
  is_avoid = lambda c, h: (count_av[slot(c)] >= 0 and lib['avoid_key'][slot(c)] == c
                           and tuple(lib['avoid'][slot(c)]) == h)
  tips, avoids = {}, {}  # slot -> the best candidate (key, c, h, rate, count)
  for (c, h), (n, w, i) in pairs.items():
    rate = f32(w) / f32(n)
    if n >= min_count and rate >= admit and not is_tip(c, h):
      cand = ((-rate, -n, i), c, h, rate, n)
      if slot(c) not in tips or cand[0] < tips[slot(c)][0]:
        tips[slot(c)] = cand
    if n >= min_count and w == 0 and not is_tip(c, h) and not is_avoid(c, h):
      cand = ((-n, i), c, h, n)
      if slot(c) not in avoids or cand[0] < avoids[slot(c)][0]:
        avoids[slot(c)] = cand
  tip_w = sorted(v for k, v in tips.items() if score[k] < 0 or v[3] > score[k])[:max_new]
  avoid_w = sorted(v for k, v in avoids.items() if count_av[k] < 0 or v[3] > count_av[k])
  new = {k: [list(x) if isinstance(x, (list, tuple)) else x for x in v] for k, v in lib.items()}
  new['tip_score'], new['avoid_count'] = score, count_av
  for _, c, h, rate, _ in tip_w:
    new['tip_key'][slot(c)], new['tip'][slot(c)], new['tip_score'][slot(c)] = c, list(h), rate
  for _, c, h, n in avoid_w[:max_new]:
    new['avoid_key'][slot(c)], new['avoid'][slot(c)] = c, list(h)
    new['avoid_count'][slot(c)] = f32(n)
  return new, hit_rate


def _lib_dict(lib):
  return {k: np.asarray(getattr(lib, k)).tolist() for k in
          ('tip_key', 'tip', 'tip_score', 'avoid_key', 'avoid', 'avoid_count')}


@settings(deadline=None)
@given(st.data())
def test_library_update_matches_a_plain_python_reading(data):
  """Three batches in a row (admission, evolution, eviction, replacement, collisions in 8
  slots, the rate limit) equal the plain-Python rules token for token."""
  b, g, k, a, slots = 2, 4, 3, 3, 8
  admit = data.draw(st.sampled_from([0.26, 0.51, 0.76]))  # no tie with a rate or an EMA
  min_count = data.draw(st.integers(1, 3))
  max_new = data.draw(st.integers(1, 2))
  names = data.draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=5, max_size=5,
                             unique=True))
  lib = X.empty_library(slots, a, PAD)
  for _ in range(3):
    clusters = data.draw(st.lists(st.sampled_from(names), min_size=b * g * (k + 1),
                                  max_size=b * g * (k + 1)))
    acts = data.draw(st.lists(st.sampled_from([(0, 1, EOA), (1, EOA, PAD), (0, 1, 2), (2, 0, EOA)]),
                              min_size=b * g * k, max_size=b * g * k))
    lengths = data.draw(st.lists(st.integers(0, k), min_size=b * g, max_size=b * g))
    won = data.draw(st.lists(st.booleans(), min_size=b * g, max_size=b * g))
    clusters = np.asarray(clusters, np.int32).reshape(b, g, k + 1)
    actions = np.asarray(acts, np.int32).reshape(b, g, k, a)
    eoa_at = np.argmax(actions == EOA, -1) + np.where(np.any(actions == EOA, -1), 0, a)
    policy = np.arange(a) <= eoa_at[..., None]
    turn_mask = np.arange(k) < np.asarray(lengths).reshape(b, g, 1)
    success = np.asarray(won).reshape(b, g)
    turns = [(int(clusters[i, j, t]), tuple(np.where(policy[i, j, t], actions[i, j, t], PAD)),
              bool(turn_mask[i, j, t]), bool(success[i, j]))
             for i in range(b) for j in range(g) for t in range(k)]
    want, want_hit = _ref_update(_lib_dict(lib), turns, admit=admit, min_count=min_count,
                                 max_new=max_new, ema=0.5)
    lib, m = L.update(lib, clusters, actions, policy, turn_mask, success, eoa_id=EOA,
                      pad_id=PAD, admit=admit, min_count=min_count, max_new=max_new, ema=0.5)
    got = _lib_dict(lib)
    for key in ('tip_key', 'tip', 'avoid_key', 'avoid'):
      assert got[key] == want[key], key
    np.testing.assert_array_equal(got['tip_score'], np.asarray(want['tip_score'], np.float32))
    np.testing.assert_array_equal(got['avoid_count'], np.asarray(want['avoid_count'], np.float32))
    assert float(m['experience_hit_rate']) == pytest.approx(want_hit[0])
    assert float(m['experience_avoid_hit_rate']) == pytest.approx(want_hit[1])
    assert m['experience_tips'] == sum(x >= 0 for x in want['tip_score'])


def test_library_admits_a_strategy_and_a_failure_pattern_by_hand():
  """Cluster 7: 'take' (0 1) succeeded in 2 of 2 episodes, 'go' (2 0) failed in 2 of 2. The
  first batch admits both; a batch where the strategy fails in both brings its score to
  0.5·1 + 0.5·0 = 0.5 < 0.51: evicted; a success through the failure pattern evicts it, and the
  same batch admits them the other way round."""
  take, go = (0, 1, EOA), (2, 0, EOA)
  clusters = np.full((1, 4, 2), 7, np.int32)
  actions = np.asarray([[[take, take], [take, take], [go, go], [go, go]]], np.int32)[:, :, :1]
  policy = np.ones(actions.shape, bool)
  turn_mask = np.ones((1, 4, 1), bool)
  kw = dict(eoa_id=EOA, pad_id=PAD, admit=0.51, min_count=2, max_new=4, ema=0.5)
  lib = X.empty_library(8, 3, PAD)
  lib, m = L.update(lib, clusters, actions, policy, turn_mask,
                    np.asarray([[True, True, False, False]]), **kw)
  tip, has_tip, avoid, has_avoid = X.lookup(lib, jnp.int32(7))
  assert bool(has_tip) and bool(has_avoid) and m['experience_hit_rate'] == 0
  assert tip.tolist() == [0, 1] and avoid.tolist() == [2, 0]
  assert not bool(X.lookup(lib, jnp.int32(7 + 8))[1])  # same slot, other cluster: a miss
  lib, m = L.update(lib, clusters, actions, policy, turn_mask,
                    np.asarray([[False, False, True, True]]), **kw)
  assert m['experience_hit_rate'] == 1.0  # every turn saw the strategy
  tip, has_tip, avoid, has_avoid = X.lookup(lib, jnp.int32(7))
  assert bool(has_tip) and bool(has_avoid)
  assert tip.tolist() == [2, 0] and avoid.tolist() == [0, 1]
  assert float(lib.tip_score[7]) == 1.0 and float(lib.avoid_count[7]) == 2.0
  only, _ = L.update(X.empty_library(8, 3, PAD), clusters, actions, policy, turn_mask,
                     np.asarray([[True, True, False, False]]), **kw, failure_patterns=False)
  _, has_tip, _, has_avoid = X.lookup(only, jnp.int32(7))
  assert bool(has_tip) and not bool(has_avoid)  # strategies only


def test_experience_env_shows_hints_and_plays_the_inner_environment():
  inner = envs.get_env('household', max_turns=8)
  env = X.ExperienceEnv(inner=inner, slots=64)
  assert env.obs_len == inner.obs_len + 2 * inner.action_len
  assert env.vocab[:inner.vocab_size] == inner.vocab and env.pad_id == inner.pad_id
  state, obs, mask = env.reset(jax.random.key(0), 3)
  istate, iobs, imask = inner.reset(jax.random.key(0), 3)
  np.testing.assert_array_equal(obs[:, :inner.obs_len], iobs)  # empty library: no hints
  np.testing.assert_array_equal(mask[:, :inner.obs_len], imask)
  assert not np.asarray(mask[:, inner.obs_len:]).any()
  c = np.asarray(env.state_id(state))
  assert c[0] == int(envs.multiturn.hash_arrays([jnp.where(imask, iobs, inner.pad_id)])[0])
  go, go_mask = inner.pad_action(['go', 'fridge', '<eoa>'])
  lib = env.empty()
  s0 = int(X.slot_of(c[0], 64))
  lib = lib.replace(tip_key=lib.tip_key.at[s0].set(c[0]), tip=lib.tip.at[s0].set(go[:2]),
                    tip_score=lib.tip_score.at[s0].set(1.0),
                    avoid_key=lib.avoid_key.at[s0].set(c[0]),
                    avoid=lib.avoid.at[s0].set([inner.token_id('go'), inner.pad_id]),
                    avoid_count=lib.avoid_count.at[s0].set(2.0))
  state, obs, mask = env.with_library((state, obs, mask), lib)
  assert env.render(state, 0) == inner.render(istate, 0) + ' tip go fridge avoid go'
  assert env.render(state, 1) == inner.render(istate, 1)  # another cluster: no hint
  acts = jnp.asarray(np.repeat(go[None], 3, 0))
  acts_mask = jnp.asarray(np.repeat(go_mask[None], 3, 0))
  state, obs, mask, reward, done, info = env.step(state, acts, acts_mask)
  istate, iobs, imask, ireward, idone, iinfo = inner.step(istate, acts, acts_mask)
  np.testing.assert_array_equal(reward, ireward)
  np.testing.assert_array_equal(done, idone)
  np.testing.assert_array_equal(info['invalid'], iinfo['invalid'])
  np.testing.assert_array_equal(env.milestones(state), inner.milestones(istate))
  assert X.ExperienceEnv(inner=inner, slots=64, cluster='state').state_id(state)[0] == \
      inner.state_id(istate)[0]
  with pytest.raises(ValueError, match='cluster'):
    X.ExperienceEnv(inner=inner, cluster='text')


def slea_cfg():
  from configs import agents as agents_config
  from configs import turn_norm as turn_norm_config
  return agents_config.shrink(turn_norm_config.get_config('slea'),
                              turn_norm_config.get_config('slea'))


def test_experience_sampler_refusals(tmp_path):
  """The sampler is refused without the wrapper, and the wrapper with a pretrained LM."""
  from experiments.training import loop
  cfg = slea_cfg()
  plain = cfg.copy_and_resolve_references()
  plain.agent.experience_slots = 0
  with pytest.raises(ValueError, match='experience_slots'):
    loop.train(plain, str(tmp_path / 'c'), None, method='gigpo:experience')
  lm = cfg.copy_and_resolve_references()
  lm.agent.lm_source = 'smollm2'
  with pytest.raises(ValueError, match='toy decoder'):
    loop.build_problem(lm)


@pytest.mark.slow  # ~55 s; the default suite runs this path exactly: test_golden's agents_experience
def test_experience_sampler_through_the_loop(tmp_path):
  """gigpo:experience on the wrapped household (quick): the library grows from the batches,
  is checkpointed, and a resumed run equals an uninterrupted one."""
  from experiments.models import decoder
  from experiments.training import loop
  cfg = slea_cfg()
  cfg.progress, cfg.quick = False, False
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 2, 1, 2
  cfg.sampler.min_count, cfg.rl.prompts_per_step = 1, 16  # tasks recur: step 2 sees hints
  cfg.eval.num_prompts, cfg.eval.pass_prompts = 8, 2
  problem = loop.build_problem(cfg)
  params0 = decoder.init_params(jax.random.PRNGKey(0), problem.pcfg)
  loop.train(cfg, str(tmp_path / 'a'), params0, method='gigpo:experience')
  rows = [r for r in loop.read_metrics(tmp_path / 'a' / 'metrics.jsonl') if 'reward' in r]
  assert len(rows) == 2 and rows[-1]['experience_avoids'] > 0  # random actions all fail
  assert rows[0]['experience_hit_rate'] == rows[0]['experience_avoid_hit_rate'] == 0
  assert rows[1]['experience_avoid_hit_rate'] > 0  # step 2 read what step 1 admitted
  assert rows[0]['experience_hints_per_turn'] == 0 < rows[1]['experience_hints_per_turn']
  short = cfg.copy_and_resolve_references()
  short.rl.steps = 1
  loop.train(short, str(tmp_path / 'b'), params0, method='gigpo:experience')
  loop.train(cfg, str(tmp_path / 'b'), params0, method='gigpo:experience')  # resumes
  again = [r for r in loop.read_metrics(tmp_path / 'b' / 'metrics.jsonl') if 'reward' in r]
  for key in ('loss', 'experience_avoids', 'experience_tips', 'experience_avoid_hit_rate',
              'experience_hints_per_turn',
              'reward', 'greedy_acc', 'eval_return'):
    assert again[-1][key] == rows[-1][key], key


@pytest.mark.slow  # ~60 s; the 'experience' sampler's loop path: test_golden's agents_experience
def test_slea_family_script_runs_quick(tmp_path):
  from configs import agents as agents_config
  from configs import turn_norm as turn_norm_config
  from experiments.training import compare, loop
  cfg = agents_config.shrink(turn_norm_config.get_config('slea'),
                             turn_norm_config.get_config('slea'))
  cfg.progress = False
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 1, 1, 1
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['gigpo:experience', 'gigpo:iid', 'grpo:iid']
  rows = [r for r in loop.read_metrics(tmp_path / 'gigpo_experience' / 'seed0' /
                                       'metrics.jsonl') if 'reward' in r]
  assert rows and all(np.isfinite(r['loss']) for r in rows)
  assert all('experience_tips' in r for r in rows)


def test_slea_probe_oracle_library_holds_the_expert_moves():
  """experiments/slea_probe.py: the oracle library's strategies are the expert's actions on its
  own paths (it agrees with itself), and every evaluation episode's first observation, being on
  the expert's path, shows one."""
  from configs import agents as agents_config
  from configs import turn_norm as turn_norm_config
  from experiments import slea_probe
  from experiments.models import decoder
  from experiments.training import loop
  cfg = agents_config.shrink(turn_norm_config.get_config('slea'),
                             turn_norm_config.get_config('slea'))
  cfg.eval.num_prompts = 8
  problem = loop.build_problem(cfg)
  oracle = slea_probe.oracle_library(problem, cfg.eval)
  assert slea_probe.agreement(oracle, oracle) == 1.0
  params = decoder.init_params(jax.random.PRNGKey(0), problem.pcfg)
  out = slea_probe.play(problem, params, oracle, cfg.eval)
  assert out['tip_turns'] >= 8 and 0.0 <= out['follows'] <= 1.0 and out['avoid_turns'] == 0
  none = slea_probe.play(problem, params, problem.env.empty(), cfg.eval, shown=oracle)
  assert none['tip_turns'] >= 8  # the same clusters, hints not shown
