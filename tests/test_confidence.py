"""CANON, GEPO, ProGRPO, VERL and outcome-based exploration (credit/confidence.py) against
plain-Python references, their reductions to GRPO, their errors and degenerate groups."""

import functools
import math

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
import credit.confidence  # noqa: F401  (registers the estimators)
from groups import groups, grpo_ref

NAMES = ["canon", "canon_length", "gepo", "progrpo", "verl_rank", "verl_rank_tokens",
         "outcome_explore"]
GROUPS = groups(sizes=(1, 5), lengths=(1, 6), batch=(3,))  # four shapes: few compiles


@functools.lru_cache(maxsize=None)
def _jitted(name, hp):
  return jax.jit(functools.partial(credit.get(name), **dict(hp)))


def run(name, r, **hp):
  """credit.get(name)(r, **hp), jitted once per (name, hparams, shape)."""
  return _jitted(name, tuple(sorted(hp.items())))(r)


def make(group, seed, p=5):
  """Rollouts with every optional field the estimators here read, from a `groups` draw."""
  tokens, mask, rewards = group
  rng = np.random.default_rng(seed)
  shape = mask.shape
  plp = -rng.exponential(1.0, shape[:-2] + (p,)).astype(np.float32)
  plp[..., 0] = 0.0  # the first prompt token has no log-prob
  plp[..., p - 1 - rng.integers(0, 2):] = 0.0  # padding
  return credit.Rollouts(
      tokens=tokens, mask=mask, rewards=rewards,
      logprobs=-rng.exponential(1.0, shape).astype(np.float32),
      entropy=(2 * rng.random(shape)).astype(np.float32), prompt_logprobs=plp,
      token_rewards=rng.normal(size=shape).astype(np.float32),
      hidden_states=rng.normal(size=shape + (3,)).astype(np.float32))


def mean_over(x, n):
  return float(np.mean(x[:n])) if n else 0.0


def to_tokens(per_response, mask):
  return np.where(mask, np.asarray(per_response)[..., None], 0.0)


def check(adv, want, mask, rtol=1e-4, atol=1e-5):
  adv = np.asarray(adv)
  assert np.all(adv[~mask] == 0)
  np.testing.assert_allclose(adv, to_tokens(want, mask), rtol=rtol, atol=atol)


# --- CANON ---------------------------------------------------------------------------------

def canon_ref(r, metric, mu):
  out = np.zeros(r.rewards.shape)
  for b in range(r.rewards.shape[0]):
    rew = r.rewards[b].astype(np.float64)
    g = len(rew)
    if g == 1:
      out[b] = rew
      continue
    lengths = r.mask[b].sum(-1)
    if metric == "entropy":
      value = [mean_over(r.entropy[b, i], lengths[i]) for i in range(g)]
    else:
      value = list(lengths)
    order = sorted(range(g), key=lambda i: value[i])
    low, high = order[:g // 2], order[g // 2:]
    m_lo, m_hi = rew[low].mean(), rew[high].mean()
    for i in range(g):
      other, own = (m_lo, m_hi) if i in high else (m_hi, m_lo)
      out[b, i] = 0.0 if rew.max() == rew.min() else (
          mu * (rew[i] - other) + (1 - mu) * (rew[i] - own))
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, st.integers(0, 2**31 - 1))
def test_canon_matches_the_reference(group, seed):
  r, mu = make(group, seed), 0.3
  for name, metric in (("canon", "entropy"), ("canon_length", "length")):
    want = canon_ref(r, metric, mu)
    check(run(name, r, mu=mu), want, r.mask)


def test_canon_half_mix_is_dr_grpo_for_even_groups():
  rng = np.random.default_rng(0)
  r = make((np.zeros((3, 4, 6), np.int32), np.ones((3, 4, 6), bool),
            rng.integers(0, 2, (3, 4)).astype(np.float32)), 1)
  np.testing.assert_allclose(credit.get("canon")(r, mu=0.5), credit.get("dr_grpo")(r),
                             atol=1e-6)
  assert credit.needs("canon") == ("entropy",) and credit.needs("canon_length") == ()
  with pytest.raises(ValueError, match="rollouts.entropy"):
    credit.get("canon")(r.replace(entropy=None))
  with pytest.raises(ValueError, match="metric"):
    credit.get("canon")(r, metric="perplexity")
  with pytest.raises(ValueError, match="mu"):
    credit.get("canon")(r, mu=1.5)


# --- GEPO ----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=2)
def _update(state, r, hp):
  return credit.update_state("gepo", state, r, **dict(hp))


def gepo_ref_step(r, state, attenuation, kappa, momentum):
  """(advantages [B, G], next state) for one batch; state = (count, mean, sq)."""
  count, m, sq = state
  lengths = r.mask.sum(-1)
  bsz, g = r.rewards.shape
  h = np.zeros(bsz)
  has = np.zeros(bsz, bool)
  for b in range(bsz):
    vals = [mean_over(r.entropy[b, i].astype(np.float64), lengths[b, i])
            for i in range(g) if lengths[b, i] > 0]
    has[b] = bool(vals)
    h[b] = np.mean(vals) if vals else 0.0
  if has.any():
    rate = 1.0 if count == 0 else momentum
    m = (1 - rate) * m + rate * h[has].mean()
    sq = (1 - rate) * sq + rate * (h[has] ** 2).mean()
    count += 1
  std = math.sqrt(max(sq - m * m, 0.0))
  adv = np.stack([grpo_ref(row) for row in r.rewards])
  for b in range(bsz):
    for i in range(g):
      if (h[b] < m - kappa * std and adv[b, i] > 0) or (h[b] > m + kappa * std and adv[b, i] < 0):
        adv[b, i] *= 1 - attenuation
  return adv, (count, m, sq)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(GROUPS, st.integers(0, 2**31 - 1)), min_size=3, max_size=3))
def test_gepo_thresholds_from_the_entropy_history(batches):
  hp = dict(attenuation=0.6, kappa=0.7, momentum=0.3)
  state, ref_state = credit.init_state("gepo", **hp), (0, 0.0, 0.0)
  for group, seed in batches:
    r = make(group, seed).replace(credit_state=state)
    want, ref_state = gepo_ref_step(r, ref_state, **hp)
    check(run("gepo", r, **hp), want, r.mask)
    state = _update(state, r, tuple(hp.items()))
    np.testing.assert_allclose([int(state["count"]), state["mean"], state["sq"]], ref_state,
                               rtol=1e-5, atol=1e-6)
  assert credit.stateful("gepo") and not credit.stateful("canon")


def test_gepo_attenuates_the_right_sign_and_zero_attenuation_is_grpo():
  # Group 0 has low entropy, group 2 high; both have mixed rewards.
  mask = np.ones((3, 4, 6), bool)
  ent = np.stack([np.full((4, 6), v, np.float32) for v in (0.1, 1.0, 3.0)])
  rewards = np.array([[1, 0, 0, 1]] * 3, np.float32)
  r = credit.Rollouts(tokens=np.zeros((3, 4, 6), np.int32), mask=mask, rewards=rewards,
                      entropy=ent)
  base = np.asarray(credit.get("grpo")(r))
  adv = np.asarray(credit.get("gepo")(r, attenuation=0.5, kappa=0.5))
  np.testing.assert_array_equal(adv[1], base[1])
  np.testing.assert_allclose(adv[0], np.where(base[0] > 0, base[0] / 2, base[0]), rtol=1e-6)
  np.testing.assert_allclose(adv[2], np.where(base[2] < 0, base[2] / 2, base[2]), rtol=1e-6)
  np.testing.assert_array_equal(credit.get("gepo")(r, attenuation=0.0), base)
  for bad in (dict(attenuation=1.5), dict(kappa=-1.0), dict(momentum=0.0)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      credit.get("gepo")(r, **bad)


# --- ProGRPO -------------------------------------------------------------------------------

def progrpo_ref(r, alpha, correct_only, low_frac):
  bsz, g = r.rewards.shape
  out = np.zeros((bsz, g))
  lengths = r.mask.sum(-1)
  for b in range(bsz):
    row = r.prompt_logprobs[b].astype(np.float64)
    on = row != 0 if r.prompt_mask is None else r.prompt_mask[b]
    plp = [x for x, m in zip(row, on) if m]
    cq = np.mean(plp) if plp else 0.0
    adv = grpo_ref(r.rewards[b])
    correct = r.rewards[b] > 0.5
    for i in range(g):
      lp = sorted(r.logprobs[b, i, :lengths[b, i]].astype(np.float64))
      if low_frac is not None:
        lp = lp[:math.ceil(low_frac * len(lp))]
      co = np.mean(lp) if lp else 0.0
      on = correct.any() and (correct[i] or not correct_only)
      out[b, i] = adv[i] + alpha * (cq - co) if on else adv[i]
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, st.integers(0, 2**31 - 1), st.sampled_from([(False, None), (True, 0.4)]))
def test_progrpo_matches_the_reference(group, seed, options):
  correct_only, low_frac = options
  r = make(group, seed)
  adv = run("progrpo", r, alpha=0.3, correct_only=correct_only, low_frac=low_frac)
  check(adv, progrpo_ref(r, 0.3, correct_only, low_frac), r.mask)


def test_progrpo_prompt_mask_counts_a_certain_prompt_token():
  """With `prompt_mask` (the loop passes it) a scored prompt token of log-prob exactly 0
  (probability 1 in float32) counts toward c(q); without it, 0 reads as padding."""
  r = make(next_group(), 5)
  plp = np.array(r.prompt_logprobs)
  plp[:, 1] = 0.0
  pmask = np.zeros(plp.shape, bool)
  pmask[:, 1:3] = True
  r = r.replace(prompt_logprobs=plp, prompt_mask=pmask, rewards=np.array(r.rewards))
  r.rewards[:, 0] = 1.0  # a correct response in every group: the term is on
  masked = run("progrpo", r, alpha=0.3)
  check(masked, progrpo_ref(r, 0.3, False, None), r.mask)
  unmasked = run("progrpo", r.replace(prompt_mask=None), alpha=0.3)
  check(unmasked, progrpo_ref(r.replace(prompt_mask=None), 0.3, False, None), r.mask)
  assert not np.allclose(np.asarray(masked), np.asarray(unmasked))
  with pytest.raises(ValueError, match="prompt_mask must have"):
    credit.get("progrpo")(r.replace(prompt_mask=pmask[:, :2]))


def test_progrpo_zero_alpha_is_grpo_and_needs_its_fields():
  r = make(next_group(), 3)
  np.testing.assert_array_equal(credit.get("progrpo")(r, alpha=0.0), credit.get("grpo")(r))
  assert credit.needs("progrpo") == ("logprobs", "prompt_logprobs")
  with pytest.raises(ValueError, match="prompt_logprobs"):
    credit.get("progrpo")(r.replace(prompt_logprobs=None))
  with pytest.raises(ValueError, match="logprobs"):
    credit.get("progrpo")(r.replace(logprobs=None))
  with pytest.raises(ValueError, match="leading dims"):
    credit.get("progrpo")(r.replace(prompt_logprobs=np.zeros((2, 5), np.float32)))
  with pytest.raises(ValueError, match="low_frac"):
    credit.get("progrpo")(r, low_frac=0.0)


def next_group(g=4, l=6, b=3, seed=0):
  rng = np.random.default_rng(seed)
  mask = np.arange(l) < rng.integers(1, l + 1, (b, g))[..., None]
  return (rng.integers(0, 4, (b, g, l)).astype(np.int32), mask,
          rng.integers(0, 2, (b, g)).astype(np.float32))


# --- VERL ----------------------------------------------------------------------------------

def effective_rank_ref(tokens, buckets):
  counts = {}
  ranks = []
  for t in tokens:
    counts[int(t) % buckets] = counts.get(int(t) % buckets, 0) + 1
    roots = np.sqrt(np.array(list(counts.values()), np.float64))
    p = roots / roots.sum()
    ranks.append(math.exp(-np.sum(p * np.log(p))))
  return ranks


def zscore_ref(x):
  x = np.asarray(x, np.float64)
  varies = x.max() - x.min() > 1e-4 * max(1.0, np.abs(x).max())
  return (x - x.mean()) / x.std() if varies else np.zeros_like(x)


def verl_ref(r, beta, buckets):
  bsz, g = r.rewards.shape
  out = np.zeros((bsz, g))
  lengths = r.mask.sum(-1)
  for b in range(bsz):
    er, erv, era = [], [], []
    for i in range(g):
      ranks = effective_rank_ref(r.tokens[b, i, :lengths[b, i]], buckets)
      vel = np.diff(ranks)
      er.append(ranks[-1] if ranks else 0.0)
      erv.append(vel.mean() if len(vel) else 0.0)
      era.append(np.diff(vel).mean() if len(vel) > 1 else 0.0)
    gate = 1 / (1 + np.exp(-zscore_ref(era)))
    phi = gate * zscore_ref(er) + (1 - gate) * zscore_ref(erv)
    out[b] = grpo_ref(r.rewards[b]) + beta * np.tanh(phi)
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, st.integers(0, 2**31 - 1), st.sampled_from([2, 64]))
def test_verl_rank_tokens_matches_the_reference(group, seed, buckets):
  r = make(group, seed)
  check(run("verl_rank_tokens", r, beta=0.4, buckets=buckets), verl_ref(r, 0.4, buckets),
        r.mask, atol=2e-5)


def hidden_rank_ref(h):
  """Effective rank of each prefix h[:t] by numpy's SVD (float64)."""
  out = []
  for t in range(1, len(h) + 1):
    sv = np.linalg.svd(np.asarray(h[:t], np.float64), compute_uv=False)
    p = sv[sv > 1e-9 * max(sv.max(), 1e-300)] / sv.sum() if sv.sum() > 0 else []
    out.append(math.exp(-np.sum(p * np.log(p))) if len(p) else 0.0)
  return out


@settings(max_examples=10, deadline=None)
@given(GROUPS, st.integers(0, 2**31 - 1))
def test_hidden_state_effective_rank_matches_an_svd(group, seed):
  r = make(group, seed)
  h = np.array(r.hidden_states)
  if h.shape[-2] > 2:  # a repeated state and a zero one
    h[..., 1, :] = h[..., 0, :]
    h[..., 2, :] = 0.0
  er = np.asarray(jax.jit(credit.confidence.prefix_effective_rank_hidden)(h, r.mask))
  for idx in np.ndindex(r.mask.shape[:-1]):
    n = int(r.mask[idx].sum())
    np.testing.assert_allclose(er[idx][:n], hidden_rank_ref(h[idx][:n]), rtol=1e-4, atol=1e-4)
    assert not er[idx][n:].any()


@settings(max_examples=10, deadline=None)
@given(GROUPS, st.integers(0, 2**31 - 1))
def test_verl_rank_on_token_one_hots_is_verl_rank_tokens(group, seed):
  """Hidden states that are each token's one-hot over 4 hashed ids give the token reading:
  the singular values of a prefix's one-hot rows are the square roots of its id counts
  (equal to float32 rounding of the SVD, which the z-scores amplify: 1e-4)."""
  r = make(group, seed)
  onehot = np.eye(4, dtype=np.float32)[np.asarray(r.tokens) % 4]
  np.testing.assert_allclose(run("verl_rank", r.replace(hidden_states=onehot), beta=0.4),
                             run("verl_rank_tokens", r, beta=0.4, buckets=4), atol=1e-4)
  with pytest.raises(ValueError, match="hidden_states"):
    credit.get("verl_rank")(r.replace(hidden_states=None))


def test_hidden_states_are_validated():
  r = make(next_group(g=4, seed=3), 4)
  assert credit.validate(r) is r
  with pytest.raises(ValueError, match=r"hidden_states must be real \[\.\.\., G, L, D\]"):
    credit.validate(r.replace(hidden_states=r.hidden_states[..., 0]))  # no D axis
  with pytest.raises(ValueError, match="hidden_states must be real"):
    credit.validate(r.replace(hidden_states=r.hidden_states > 0))
  h = np.array(r.hidden_states)
  h[np.asarray(r.mask)] = np.nan  # every unmasked token's state
  with pytest.raises(ValueError, match="finite on unmasked tokens"):
    credit.validate(r.replace(hidden_states=h))
  h = np.array(r.hidden_states)
  h[~np.asarray(r.mask)] = np.nan  # masked positions may hold anything
  credit.validate(r.replace(hidden_states=h))


def test_effective_rank_of_distinct_tokens_grows_like_the_prefix():
  rank = jax.jit(credit.confidence.prefix_effective_rank, static_argnums=2)
  tokens = np.arange(5, dtype=np.int32)[None, None]
  er = rank(tokens, np.ones((1, 1, 5), bool), 64)
  np.testing.assert_allclose(er[0, 0], [1, 2, 3, 4, 5], rtol=1e-5)  # t distinct rows: rank t
  same = rank(np.zeros_like(tokens), np.ones((1, 1, 5), bool), 64)
  np.testing.assert_allclose(same, 1.0, rtol=1e-6)  # repeating one token: rank 1


# --- outcome-based exploration -------------------------------------------------------------

def outcome_ref(r, coef, answer_tokens):
  bsz, g = r.rewards.shape
  out = np.zeros((bsz, g))
  lengths = r.mask.sum(-1)
  for b in range(bsz):
    outcomes = []
    for i in range(g):
      toks = [int(t) for t in r.tokens[b, i, :lengths[b, i]]]
      if answer_tokens is not None:
        toks = [None] * max(answer_tokens - len(toks), 0) + toks[-answer_tokens:]
      outcomes.append(tuple(toks))
    rew = r.rewards[b].astype(np.float64)
    if g > 1:
      rew = rew - coef * np.array([outcomes.count(o) - 1 for o in outcomes]) / (g - 1)
    out[b] = grpo_ref(rew)
  return out


@settings(max_examples=15, deadline=None)
@given(GROUPS, st.integers(0, 2**31 - 1), st.sampled_from([None, 2]))
def test_outcome_explore_penalises_repeated_outcomes(group, seed, answer_tokens):
  r = make(group, seed)
  adv = run("outcome_explore", r, coef=0.3, answer_tokens=answer_tokens)
  check(adv, outcome_ref(r, 0.3, answer_tokens), r.mask)


def test_outcome_explore_rewards_a_rare_correct_answer_more():
  tokens = np.zeros((3, 4, 6), np.int32)
  tokens[:, :, :2] = [[1, 2], [3, 2], [1, 3], [4, 4]]
  r = credit.Rollouts(tokens=tokens, mask=np.broadcast_to(np.arange(6) < 2, (3, 4, 6)),
                      rewards=np.array([[1, 1, 1, 0]] * 3, np.float32))
  whole = np.asarray(credit.get("outcome_explore")(r, coef=0.5))[0, :, 0]
  np.testing.assert_array_equal(whole, np.asarray(credit.get("grpo")(r))[0, :, 0])  # all distinct
  answer = np.asarray(credit.get("outcome_explore")(r, coef=0.5, answer_tokens=1))[0, :, 0]
  assert answer[2] > answer[0] == answer[1] > answer[3]  # answers 2, 2, 3, 4: 3 is the rare one
  np.testing.assert_array_equal(credit.get("outcome_explore")(r, coef=0.0, answer_tokens=1),
                                credit.get("grpo")(r))
  with pytest.raises(ValueError, match="answer_tokens"):
    credit.get("outcome_explore")(r, answer_tokens=0)
  with pytest.raises(ValueError, match="coef"):
    credit.get("outcome_explore")(r, coef=-1.0)


# --- shared properties ---------------------------------------------------------------------

IDENTITY = {"gepo": dict(attenuation=0.0), "progrpo": dict(alpha=0.0),
            "verl_rank": dict(beta=0.0), "verl_rank_tokens": dict(beta=0.0),
            "outcome_explore": dict(coef=0.0)}


@pytest.mark.parametrize("name", sorted(IDENTITY))
@pytest.mark.parametrize("kind", ["binary", "real"])
def test_unit_weights_give_grpo_exactly(name, kind):
  tokens, mask, rewards = next_group(g=4, seed=7)
  if kind == "real":
    rewards = np.random.default_rng(8).normal(size=rewards.shape).astype(np.float32)
  r = make((tokens, mask, rewards), 9)
  np.testing.assert_array_equal(credit.get(name)(r, **IDENTITY[name]), credit.get("grpo")(r))


@pytest.mark.parametrize("name", NAMES)
def test_jit_vmap_and_degenerate_groups(name):
  r = make(next_group(g=4, seed=11), 12)
  np.testing.assert_allclose(run(name, r), credit.get(name)(r), atol=1e-6)
  per_slice = np.stack([np.asarray(run(name, jax.tree.map(lambda x: x[b], r)))
                        for b in range(3)])
  np.testing.assert_allclose(jax.jit(jax.vmap(credit.get(name)))(r), per_slice, atol=1e-6)
  chex.assert_tree_all_finite(run(name, make(next_group(g=1, seed=13), 14)))
  tokens, mask, _ = next_group(g=4, seed=15)
  mask[0] = False  # a group with no tokens
  adv = np.asarray(run(name, make((tokens, mask, np.full((3, 4), 0.7, np.float32)), 16)))
  chex.assert_tree_all_finite(adv)
  assert np.all(adv[~mask] == 0)
  if name not in ("verl_rank", "verl_rank_tokens", "outcome_explore", "progrpo"):  # beyond
    np.testing.assert_array_equal(adv, 0.0)  # all-equal rewards: exactly 0
