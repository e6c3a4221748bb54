"""Milestone credit (credit.milestones.beacon, issue 23) against a plain-Python reference, its
outcome counterpart, and the milestones the household sampler reports."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp
import credit
from credit import milestones as ms
from credit.turns import Turns, validate_turns
from groups import groups, grpo_ref
from test_agent_credit import grpo_per_turn, ref_grpo
from test_step_graph import turn_groups  # noqa: E402 (tests/ is on sys.path)

G, K = 4, 3


def ref_beacon(rewards, mask, milestones, gamma, omega, scale=True):
  """Loops over one group [G, K]: segments closed by key turns, γ^(κ − t) shaping, mean per
  segment index over the group's turns, plus GRPO of the returns."""
  g, k = np.shape(mask)
  shaped, seg = {}, {}
  for i in range(g):
    n = int(sum(mask[i]))
    keys = [t for t in range(n) if milestones[i][t] > 0]
    for t in range(n):
      closing = [c for c in keys if c >= t]
      shaped[i, t] = gamma ** (closing[0] - t) if closing else 0.0
      seg[i, t] = sum(1 for c in keys if c < t)
  episode = ref_grpo(rewards, mask, scale)
  out = np.zeros((g, k))
  for (i, t), r in shaped.items():
    same = [shaped[key] for key in shaped if seg[key] == seg[i, t]]
    a_seg = r - np.mean(same) if len(same) > 1 else 0.0
    out[i, t] = episode[i] + omega * a_seg
  return out


@settings(max_examples=30, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([(0.9, 1.0), (0.5, 0.3), (1.0, 2.0)]))
def test_beacon_matches_reference(group, seed, hp):
  ids, rewards, mask, success = group
  m = np.where(mask, np.random.default_rng(seed).integers(0, 3, mask.shape) * (
      np.random.default_rng(seed + 1).random(mask.shape) < 0.4), 0).astype(np.int32)
  turns = validate_turns(Turns(state_ids=ids, rewards=rewards, turn_mask=mask,
                               success=success, milestones=m))
  got = np.asarray(ms.beacon(turns, gamma=hp[0], omega=hp[1]))
  for b in range(2):
    np.testing.assert_allclose(got[b], ref_beacon(rewards[b], mask[b], m[b], *hp), rtol=2e-4,
                               atol=2e-5)


def test_without_milestones_beacon_is_grpo_on_every_turn():
  rng = np.random.default_rng(0)
  mask = np.arange(K) < rng.integers(1, K + 1, (G, 1))
  rewards = np.where(mask & ~np.roll(mask, -1, 1), rng.integers(0, 2, (G, 1)), 0.0)
  rewards = rewards.astype(np.float32)
  turns = Turns(state_ids=np.zeros((G, K + 1), np.int32), rewards=rewards, turn_mask=mask,
                milestones=np.zeros((G, K), np.int32))
  np.testing.assert_allclose(ms.beacon(turns), grpo_per_turn(rewards, mask), atol=1e-6)
  with pytest.raises(ValueError, match="milestones"):
    ms.beacon(turns.replace(milestones=None))
  with pytest.raises(ValueError, match=">= 0"):
    ms.beacon(turns.replace(milestones=-np.ones((G, K), np.int32)))
  with pytest.raises(ValueError, match="gamma"):
    ms.beacon(turns, gamma=1.5)
  assert credit.needs("beacon") == ("turns", "milestones")


def test_household_reports_the_milestones_each_turn_achieves():
  """Expert household episodes: every milestone the start state lacks is achieved exactly
  once, the last on the solving turn; `credit.get('beacon')` reads them through the loop's
  Turns."""
  from envs import household
  from experiments.rollouts import agent_sampling as ags
  env = household.Household(max_turns=8)
  ep = ags.expert_episodes(env, jax.random.key(0), 32)
  assert ep.milestones.shape == ep.state_ids.shape + (3,)
  turns_m = np.asarray(ags.milestone_turns(ep, env))
  start = np.asarray(ep.milestones)[:, :, 0]  # [B, G, M] of s_0
  np.testing.assert_array_equal(turns_m.sum(-1), (~start).sum(-1))
  last = np.asarray(ep.lengths) - 1
  assert np.all(np.take_along_axis(turns_m, last[..., None], -1)[..., 0] >= 1)  # solved
  turns = Turns(ep.state_ids, ep.turn_rewards, ep.turn_mask, token_turn=ep.token_turn,
                success=ep.success, milestones=turns_m)
  rollouts = credit.Rollouts(tokens=ep.tokens, mask=ep.policy_mask | ep.obs_mask,
                             rewards=ep.returns, policy_mask=ep.policy_mask, turns=turns)
  adv = np.asarray(credit.get("beacon")(rollouts))
  assert adv.shape == ep.tokens.shape and np.all(np.isfinite(adv))
  assert np.all(adv[~np.asarray(ep.policy_mask)] == 0)


def ref_span_rewards(tr, mask, ends):
  """(span of each token [G][L], span rewards r [G, L + 1]) of one group, by loops."""
  g, l = mask.shape
  spans = [[sum(1 for u in range(t) if ends[i][u] and mask[i][u]) for t in range(l)]
           for i in range(g)]
  r = np.zeros((g, l + 1))
  for i in range(g):
    for t in range(l):
      if mask[i][t]:
        r[i][spans[i][t]] += tr[i][t]
  return spans, r


def process_group(group, seed):
  """Rollouts with random step ends and per-step rewards on a `groups` draw."""
  tokens, mask, rewards = group
  rng = np.random.default_rng(seed)
  ends = (rng.random(mask.shape) < 0.35) & mask
  tr = np.where(ends, rng.integers(0, 3, mask.shape) / 2.0, 0.0).astype(np.float32)
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, token_rewards=tr,
                         step_ends=ends)


def ref_scrl(tr, mask, ends, scale=True):
  """Loops over one group [G, L]: span rewards by position, GRPO down each position."""
  g, l = mask.shape
  spans, r = ref_span_rewards(tr, mask, ends)
  out = np.zeros((g, l))
  for j in range(l + 1):
    col = list(r[:, j])
    for i in range(g):
      for t in range(l):
        if mask[i][t] and spans[i][t] == j:
          out[i][t] = (col[i] if g == 1 else ref_norm_col(col, i, scale))
  return out


def ref_norm_col(col, i, scale):
  if max(col) == min(col):
    return 0.0
  mu, sd = np.mean(col), np.std(col, ddof=1)
  return (col[i] - mu) / (sd + 1e-6) if scale else col[i] - mu


def test_scrl_with_one_span_and_the_outcome_at_the_end_is_grpo():
  rng = np.random.default_rng(3)
  mask = np.arange(6) < rng.integers(1, 7, (2, 5, 1))
  rewards = rng.integers(0, 2, (2, 5)).astype(np.float32)
  last = mask & ~np.concatenate([mask[..., 1:], np.zeros_like(mask[..., :1])], -1)
  r = credit.Rollouts(tokens=np.zeros(mask.shape, np.int32), mask=mask, rewards=rewards,
                      token_rewards=np.where(last, rewards[..., None], 0.0).astype(np.float32),
                      step_ends=np.zeros(mask.shape, bool))
  np.testing.assert_allclose(credit.get("scrl")(r), credit.get("grpo")(r), atol=1e-6)
  with pytest.raises(ValueError, match="token_rewards"):
    credit.get("scrl")(r.replace(token_rewards=None))


def ref_blockwise(tr, mask, ends, scale=False):
  """Loops over one group [G, L]: block rewards, the all-earlier-blocks-rewarded stratum,
  the block reward minus its stratum's mean (0 for a stratum of one or all equal)."""
  g, l = mask.shape
  spans, r = ref_span_rewards(tr, mask, ends)
  ok = [[all(r[i][u] > 0 for u in range(j)) for j in range(l)] for i in range(g)]
  out = np.zeros((g, l))
  for i in range(g):
    for t in range(l):
      if not mask[i][t]:
        continue
      j = spans[i][t]
      same = [r[u][j] for u in range(g) if ok[u][j] == ok[i][j]]
      if len(same) < 2 or max(same) == min(same):
        continue
      dev = r[i][j] - np.mean(same)
      out[i][t] = dev / (np.std(same, ddof=1) + 1e-6) if scale else dev
  return out


@pytest.mark.parametrize("name", ["scrl", "blockwise"])
@settings(max_examples=25, deadline=None)
@given(group=groups(sizes=(1, 3, 6), lengths=(6,), batch=(2,)), seed=st.integers(0, 2**31 - 1),
       scale=st.booleans())
def test_step_credit_matches_reference(name, group, seed, scale):
  r = process_group(group, seed)
  mask, tr, ends = r.mask, r.token_rewards, r.step_ends
  got = np.asarray(credit.get(name)(r, scale_by_std=scale))
  for b in range(2):
    if name == "scrl":
      want = ref_scrl(tr[b], mask[b], ends[b], scale)
      if mask.shape[1] == 1 and scale:  # GRPO's group of one: R / (1 + ε)
        want = want / (1 + 1e-6)
    else:
      want = ref_blockwise(tr[b], mask[b], ends[b], scale)
    np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-5)


def test_blockwise_with_every_prefix_rewarded_is_scrl_without_scaling():
  """One stratum per block (every earlier block rewarded everywhere): the baseline is the
  block's group mean, SCRL's with scale_by_std=False (groups of more than one)."""
  rng = np.random.default_rng(4)
  g, l = 5, 6
  mask = np.ones((g, l), bool)
  ends = np.zeros((g, l), bool)
  ends[:, [1, 3]] = True
  tr = np.zeros((g, l), np.float32)
  tr[:, 1] = 0.5
  tr[:, 3] = 0.5
  tr[:, 5] = rng.integers(0, 2, g)  # the answer block's outcome differs
  r = credit.Rollouts(tokens=np.zeros((g, l), np.int32), mask=mask,
                      rewards=np.zeros(g, np.float32), token_rewards=tr, step_ends=ends)
  np.testing.assert_allclose(credit.get("blockwise")(r),
                             credit.get("scrl")(r, scale_by_std=False), atol=1e-6)


def ref_hrpo(tr, mask, ends, rewards, w, scale=True):
  """Loops over one group [G, L]: the reasoning phase (through the last step end not on
  the last token) gets w·GRPO(r¹) + (1 − w)·GRPO(R), the rest GRPO(R)."""
  g, l = mask.shape
  phase = np.zeros((g, l), bool)
  r1 = np.zeros(g)
  for i in range(g):
    n = int(mask[i].sum())
    cut = max([t + 1 for t in range(n - 1) if ends[i][t]], default=0)
    phase[i, :cut] = True
    r1[i] = sum(tr[i][:cut])
  a1, a2 = grpo_ref(r1[None], scale)[0], grpo_ref(np.asarray(rewards)[None], scale)[0]
  out = np.where(phase, w * a1[:, None] + (1 - w) * a2[:, None], a2[:, None])
  return np.where(mask, out, 0.0)


@settings(max_examples=12, deadline=None)
@given(group=groups(sizes=(1, 3, 6), lengths=(6,), batch=(2,)), seed=st.integers(0, 2**31 - 1),
       scale=st.booleans(), w=st.sampled_from([1.0, 0.5]))
def test_hrpo_matches_reference(group, seed, scale, w):
  r = process_group(group, seed)
  got = np.asarray(credit.get("hrpo")(r, reason_weight=w, scale_by_std=scale))
  for b in range(2):
    want = ref_hrpo(r.token_rewards[b], r.mask[b], r.step_ends[b], r.rewards[b], w, scale)
    np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(credit.get("hrpo")(r, reason_weight=0.0, scale_by_std=scale),
                             credit.get("grpo")(r, scale_by_std=scale), atol=1e-6)
  with pytest.raises(ValueError, match="token_rewards"):
    credit.get("hrpo")(r.replace(token_rewards=None))


def ref_rebel(rewards, mask, milestones, feedback, gamma, lam, beta, scale=False):
  """Loops over one group [G, K]: ReBel's A^ep + λ·(c(R^env) + β·c(R^bel)), belief groups =
  the count of milestones before each turn."""
  g, k = np.shape(mask)
  episode = ref_grpo(rewards, mask, scale)
  env, bel, phase = {}, {}, {}
  for i in range(g):
    n = int(sum(mask[i]))
    ret = float(np.sum(np.asarray(rewards[i][:n], np.float64)))
    for t in range(n):
      env[i, t] = gamma ** (n - 1 - t) * ret
      bel[i, t] = sum(gamma ** (j - t) * np.exp(np.float64(feedback[i][j])) for j in range(t, n))
      phase[i, t] = min(int(sum(milestones[i][:t])), k)
  centre = lambda x, key: x[key] - np.mean([x[o] for o in x if phase[o] == phase[key]])
  out = np.zeros((g, k))
  for key in env:
    alone = sum(1 for o in env if phase[o] == phase[key]) == 1
    step = 0.0 if alone else centre(env, key) + beta * centre(bel, key)
    out[key] = episode[key[0]] + lam * step
  return out


@settings(max_examples=20, deadline=None)
@given(turn_groups(shapes=((G, K),), batch=(2,)), st.integers(0, 2**31 - 1),
       st.sampled_from([(0.95, 0.5, 1.0), (0.5, 1.0, 0.0), (1.0, 2.0, 3.0)]))
def test_rebel_matches_reference(group, seed, hp):
  ids, rewards, mask, success = group
  rng = np.random.default_rng(seed)
  m = np.where(mask, rng.integers(0, 2, mask.shape), 0).astype(np.int32)
  fb = np.where(mask, -rng.exponential(1.0, mask.shape), 0.0).astype(np.float32)
  turns = Turns(ids, rewards, mask, success=success, milestones=m, feedback_logprobs=fb)
  got = np.asarray(ms.rebel(turns, gamma=hp[0], lam=hp[1], belief_coef=hp[2]))
  for b in range(2):
    np.testing.assert_allclose(got[b], ref_rebel(rewards[b], mask[b], m[b], fb[b], *hp),
                               rtol=2e-4, atol=2e-4)


def test_rebel_reductions_and_refusals():
  rng = np.random.default_rng(0)
  rewards = np.zeros((G, K), np.float32)
  rewards[:, -1] = [1.0, 0.0, 1.0, 0.0]
  mask = np.ones((G, K), bool)
  m = rng.integers(0, 2, (G, K)).astype(np.int32)
  fb = -rng.exponential(1.0, (G, K)).astype(np.float32)
  turns = Turns(np.zeros((G, K + 1), np.int32), rewards, mask, milestones=m, feedback_logprobs=fb)
  outcome = credit.Rollouts(tokens=np.zeros((G, K), np.int32), mask=mask, rewards=rewards.sum(-1))
  np.testing.assert_allclose(ms.rebel(turns, lam=0.0),  # GRPO without the std, every turn
                             credit.get("grpo")(outcome, scale_by_std=False), atol=1e-6)
  # One phase, no belief term: the outcome discounted back, centred over each turn's phase.
  flat = turns.replace(milestones=np.zeros((G, K), np.int32))
  env = 0.9 ** (K - 1 - np.arange(K)) * rewards.sum(-1, keepdims=True)
  want = np.asarray(ref_grpo(rewards, mask, False))[:, None] + (env - env.mean())
  np.testing.assert_allclose(ms.rebel(flat, gamma=0.9, lam=1.0, belief_coef=0.0), want,
                             atol=1e-6)
  with pytest.raises(ValueError, match="feedback_logprobs"):
    ms.rebel(turns.replace(feedback_logprobs=None))
  with pytest.raises(ValueError, match="feedback_logprobs"):
    ms.rebel(turns.replace(feedback_logprobs=np.where(mask, np.nan, 0.0).astype(np.float32)))
  with pytest.raises(ValueError, match="lam"):
    ms.rebel(turns, lam=-1.0)
  assert credit.needs("rebel") == ("turns", "milestones", "feedback_logprobs")


def test_feedback_logprobs_equal_teacher_forcing_of_each_observation():
  from experiments.models import decoder
  from experiments.rollouts import agent_sampling as ags
  from envs.household import Household
  env, nt = Household(max_turns=6), 4
  pcfg = decoder.PolicyConfig(vocab_size=env.vocab_size, d_model=16, num_layers=1, num_heads=2,
                              d_ff=32, max_len=ags.sequence_length(env, nt))
  params = decoder.init_params(jax.random.PRNGKey(3), pcfg)
  ep = ags.sample_episodes(params, pcfg, env, jax.random.key(1), 2, 2, num_turns=nt)
  got = np.asarray(ags.feedback_logprobs(params, pcfg, env, ep.tokens, ep.turn_mask, env.pad_id,
                                         num_turns=nt))
  tokens, turn_mask = np.asarray(ep.tokens), np.asarray(ep.turn_mask)
  _, obs_pos, _ = ags.slot_layout(env, nt)
  forward = jax.jit(lambda prefix, obs: decoder.token_logprobs(params, pcfg, prefix, obs)[0])
  for k in range(nt):
    # Turn k's observation slot scored after its own prefix only (an independent forward of
    # the 4 trajectories, one program per turn; the causal forward scores each token from
    # the ones before it, so the padding after an observation changes none of its scores).
    start, slot = obs_pos[k][0], tokens[..., obs_pos[k]].reshape(4, -1)
    lp = np.asarray(forward(jnp.asarray(tokens[..., :start].reshape(4, start)),
                            jnp.asarray(slot)))
    for n, (b, g) in enumerate(np.ndindex(2, 2)):
      if not turn_mask[b, g, k]:
        assert got[b, g, k] == 0.0
        continue
      real = slot[n] != env.pad_id
      np.testing.assert_allclose(got[b, g, k], float(np.mean(lp[n][real])), rtol=1e-4,
                                 atol=1e-5)
  assert np.all(got[turn_mask] < 0)


@pytest.mark.slow  # ~65 s; ReBel's loop path (milestones, observation log-probs) is in
# test_agent_loop's agents run
def test_milestone_family_script_runs_quick(tmp_path):
  """configs/milestones.py (household) through the loop: BEACON and ReBel read the milestones
  and observation log-probs the loop fills."""
  from configs import agents as agents_config
  from configs import milestones as milestones_config
  from experiments.training import compare, loop
  cfg = agents_config.shrink(milestones_config.get_config(), milestones_config.get_config())
  cfg.progress = False
  cfg.rl.steps, cfg.rl.ckpt_every, cfg.eval.every = 1, 1, 1
  summary = compare.run_experiment(cfg, str(tmp_path))
  assert sorted(summary['methods']) == ['beacon:iid', 'grpo:iid', 'rebel:iid']
  train = {m: [r for r in loop.read_metrics(tmp_path / m.replace(':', '_') / 'seed0' /
                                            'metrics.jsonl') if 'reward' in r]
           for m in summary['methods']}
  base = train['grpo:iid'][0]
  for m in ('beacon:iid', 'rebel:iid'):
    assert np.isfinite(train[m][0]['loss']) and train[m][0]['reward'] == base['reward'], m
  # From the shrunk config's random start no episode succeeds, so GRPO's (and BEACON's, no
  # milestone reached) advantages are 0; ReBel's belief term still compares turns.
  assert base['success'] == 0 and base['loss'] == 0 == train['beacon:iid'][0]['loss']
  assert train['rebel:iid'][0]['loss'] != 0
