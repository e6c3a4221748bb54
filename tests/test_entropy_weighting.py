"""Entropy / surprisal token weighting (STARE, TACO, A3PO, Miner, DGPO, UCAS, DCPO)
against plain-Python references, their reductions to GRPO, state, and input checks."""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
import credit.entropy_guided  # noqa: F401  (registers dgpo, ucas, dcpo)
import credit.entropy_weighting  # noqa: F401  (registers stare, taco, a3po, miner)
from credit.entropy_guided import hellinger
from groups import groups, grpo_ref

NAMES = ("stare", "taco", "a3po", "miner", "dgpo", "ucas", "dcpo")
FEW = settings(max_examples=12, deadline=None)


def make(tokens, mask, rewards, seed, ties=False):
  """Rollouts with sampled-token log-probs, reference log-probs and entropies."""
  rng = np.random.default_rng(seed)
  shape = mask.shape
  if ties:  # a few distinct probabilities: many tied surprisals
    logp = np.log(rng.choice([0.05, 0.4, 0.9, 1.0], shape))
  else:
    logp = np.log(rng.uniform(0.01, 1.0, shape))
  ref = np.where(rng.random(shape) < 0.3, logp, np.log(rng.uniform(0.01, 1.0, shape)))
  ent = rng.uniform(0.0, 1.0, shape)
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards,
                         logprobs=logp.astype(np.float32), ref_logprobs=ref.astype(np.float32),
                         entropy=ent.astype(np.float32))


def fixed(g, l, batch, seed=0):
  """(tokens, mask, rewards) [batch, g, l] with ragged lengths (one empty response)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, l + 1, (batch, g))
  lengths[0, 0] = 0
  return (rng.integers(0, 3, (batch, g, l)).astype(np.int32), np.arange(l) < lengths[..., None],
          (rng.random((batch, g)) < 0.5).astype(np.float32))


@st.composite
def batches(draw, sizes=(1, 3, 6)):
  tokens, mask, rewards = draw(groups(sizes=sizes, lengths=(5, 12), batch=(2,)))
  return make(tokens, mask, rewards, draw(st.integers(0, 2**31 - 1)), ties=draw(st.booleans()))


def arrays(r):
  f64 = lambda x: np.asarray(x, np.float64)
  return (np.asarray(r.mask), f64(r.rewards), -f64(r.logprobs), f64(r.entropy),
          f64(r.ref_logprobs))


def ref_tokens(per_response, mask):
  return np.where(mask, per_response[..., None], 0.0)


def ref_select(score, cand, fraction):
  """Candidates with fewer than fraction·n candidates scoring strictly higher (float32 cut)."""
  idx = list(zip(*np.nonzero(cand)))
  values = np.array([score[i] for i in idx])
  cut = np.float32(fraction) * np.float32(len(idx))
  out = np.zeros(cand.shape, bool)
  for i in idx:
    out[i] = np.count_nonzero(values > score[i]) < cut
  return out


def close(got, want, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


# --- references against the estimators ------------------------------------------------


def ref_stare(r, gate, w, m, variant, fraction):
  mask, rewards, s, _, _ = arrays(r)
  base = ref_tokens(grpo_ref(rewards), mask)
  weight = np.ones_like(base)
  if gate:
    weight[ref_select(s, mask & (base > 0), fraction)] = w
    if variant == "C2":
      weight[ref_select(s, mask & (base < 0), fraction)] = m
  return base * weight


@FEW
@given(batches(), st.sampled_from(["O1", "C2"]), st.sampled_from([0.1, 0.25, 0.5]))
def test_stare_reweights_surprisal_quantiles_when_the_gate_is_on(r, variant, fraction):
  h = float(np.mean(np.asarray(r.entropy)[np.asarray(r.mask)])) if np.asarray(r.mask).any() else 0.
  for target in (0.1, 0.9):
    got = credit.get("stare")(r, variant=variant, top_ratio=fraction, target_entropy=target)
    gate = bool(np.asarray(r.mask).any()) and h < target
    close(got, ref_stare(r, gate, 1.1, 0.9, variant, fraction))


class Controller:
  """The public STAREController (closed-loop gate, adaptive W/M), re-written in Python."""

  def __init__(self, target, w, m, alpha, w_max, m_min):
    self.target, self.w, self.m = target, w, m
    self.alpha, self.w_max, self.m_min = alpha, w_max, m_min

  def update(self, h):
    self.gate = h < self.target
    sign = float(np.sign(self.target - h))
    self.w = float(np.clip(self.w + self.alpha * sign, 1.0, self.w_max))
    self.m = float(np.clip(self.m - self.alpha * sign, self.m_min, 1.0))


def test_stare_closed_loop_state_follows_the_public_controller():
  tokens, mask, rewards = fixed(6, 12, 3)
  rewards = np.tile(np.array([1, 0, 1, 0, 0, 1], np.float32), (3, 1))
  hp = dict(variant="C2", adaptive=True, alpha=0.05, w_max=1.2, m_min=0.8, target_entropy=0.3)
  ctrl = Controller(0.3, 1.1, 0.9, 0.05, 1.2, 0.8)
  state = credit.init_state("stare", **hp)
  gates = []
  for step, scale in enumerate([0.2, 0.2, 0.2, 0.1, 0.9, 0.9, 0.2]):
    r = make(tokens, mask, rewards, step)
    r = r.replace(entropy=np.asarray(r.entropy) * 0 + scale)  # batch entropy = scale
    ctrl.update(scale)
    got = credit.get("stare")(r.replace(credit_state=state), **hp)
    close(got, ref_stare(r, ctrl.gate, ctrl.w, ctrl.m, "C2", 0.1))
    state = credit.update_state("stare", state, r, **hp)
    assert float(state["reweight_pos"]) == pytest.approx(ctrl.w)
    assert float(state["reweight_neg"]) == pytest.approx(ctrl.m)
    gates.append(ctrl.gate)
  assert gates == [True, True, True, True, False, False, True]
  assert float(state["reweight_pos"]) == pytest.approx(1.15)  # clipped at 1.2, stepped back


def test_stare_entropy_ema_and_empty_batches_keep_the_estimate():
  tokens, mask, rewards = fixed(3, 5, 2)
  mask = np.ones_like(mask)
  hp = dict(entropy_ema=0.5)
  state, want = credit.init_state("stare", **hp), None
  for h in (0.6, 0.2, 0.1):
    r = make(tokens, mask, rewards, 0).replace(entropy=np.full(mask.shape, h, np.float32))
    state = credit.update_state("stare", state, r, **hp)
    want = h if want is None else 0.5 * want + 0.5 * h
    assert float(state["entropy"]) == pytest.approx(want)
  empty = r.replace(mask=np.zeros_like(mask))
  assert float(credit.update_state("stare", state, empty, **hp)["entropy"]) == pytest.approx(want)


def ref_taco(r, alpha, lam):
  mask, rewards, s, h, _ = arrays(r)
  base = ref_tokens(grpo_ref(rewards), mask)
  out = base.copy()
  for i in zip(*np.nonzero(mask)):
    risk = s[i] - h[i] + math.log(alpha)
    if base[i] > 0 and risk > 0:
      out[i] = base[i] * (1 - lam * (1 - math.exp(-risk)))
  return out


@FEW
@given(batches(), st.sampled_from([(0.01, 0.9), (0.5, 0.5), (0.9, 1.0)]))
def test_taco_damps_positive_credit_of_tail_tokens(r, hp):
  alpha, lam = hp
  close(credit.get("taco")(r, alpha=alpha, lam=lam), ref_taco(r, alpha, lam))


def ref_a3po(r, fraction, kp, kn, decay):
  mask, rewards, s, _, _ = arrays(r)
  base = ref_tokens(grpo_ref(rewards), mask)
  weight = np.ones_like(base)
  weight[ref_select(-s, mask & (base < 0), fraction)] = 1 + kn * decay
  weight[ref_select(s, mask & (base > 0), fraction)] = 1 + kp * decay
  return base * weight


@FEW
@given(batches(), st.sampled_from([0.1, 0.25, 0.5]))
def test_a3po_amplifies_rare_positive_and_likely_negative_tokens_on_a_schedule(r, fraction):
  hp = dict(top_ratio=fraction, pos_scale=0.5, neg_scale=0.3, decay_steps=4)
  state = credit.init_state("a3po", **hp)
  for step in range(6):
    got = credit.get("a3po")(r.replace(credit_state=state), **hp)
    close(got, ref_a3po(r, fraction, 0.5, 0.3, max(0.0, 1 - step / 4)))
    state = credit.update_state("a3po", state, r, **hp)
  np.testing.assert_array_equal(got, credit.get("grpo")(r))  # past decay_steps: GRPO


def ref_miner(r, gamma, cs, ics, calibration, above=0.0):
  mask, rewards, s, _, _ = arrays(r)
  base = ref_tokens(grpo_ref(rewards), mask)
  extra = np.zeros_like(base)
  for b in range(len(rewards)):
    row = rewards[b]
    if len(row) == 1 or row.max() != row.min():
      continue
    seq = {g: -s[b, g][mask[b, g]].mean() for g in range(len(row)) if mask[b, g].any()}
    if not seq:
      continue
    mean = sum(seq.values()) / len(seq)
    for g, ell in seq.items():
      u = cs * max(0.0, mean - ell) if row[0] > above else ics * min(0.0, mean - ell)
      for t in np.nonzero(mask[b, g])[0]:
        extra[b, g, t] = u * (1 - math.exp(-s[b, g, t])) ** gamma
  if calibration > 0 and np.abs(extra).sum() > 0:
    extra *= min(1.0, calibration * np.abs(base).sum() / np.abs(extra).sum())
  return base + extra


@FEW
@given(batches(sizes=(1, 3, 6)), st.sampled_from([(2.0, 1.0, 0.0, 0.0015), (1.0, 0.5, 0.7, 0.0),
                                                   (0.0, 1.0, 1.0, 0.5)]))
def test_miner_gives_focal_intrinsic_credit_to_homogeneous_groups(r, hp):
  gamma, cs, ics, cal = hp
  got = credit.get("miner")(r, gamma=gamma, correct_scale=cs, incorrect_scale=ics,
                            calibration=cal)
  close(got, ref_miner(r, gamma, cs, ics, cal), rtol=1e-4)


def test_miner_rewards_the_less_likely_responses_of_an_all_correct_group():
  mask = np.ones((1, 3, 4), bool)
  logp = np.log(np.array([[[0.9] * 4, [0.5] * 4, [0.2] * 4]], np.float32))
  r = credit.Rollouts(tokens=np.zeros((1, 3, 4), np.int32), mask=mask,
                      rewards=np.ones((1, 3), np.float32), logprobs=logp)
  adv = np.asarray(credit.get("miner")(r, calibration=0.0))[0, :, 0]
  mean = np.log([0.9, 0.5, 0.2]).mean()
  want = [max(0.0, mean - np.log(p)) * (1 - p) ** 2 for p in (0.9, 0.5, 0.2)]
  assert want[0] == want[1] == 0 < want[2]
  np.testing.assert_allclose(adv, want, rtol=1e-5)
  assert np.all(np.asarray(credit.get("miner")(r)) == 0)  # calibration: no GRPO signal, none


def ref_dgpo(r, mix, form):
  mask, rewards, s, h, ref = arrays(r)
  base = ref_tokens(grpo_ref(rewards), mask)
  out = np.zeros_like(base)
  for b, g in np.ndindex(mask.shape[:2]):
    ts = np.nonzero(mask[b, g])[0]
    score = []
    for t in ts:
      p, q = math.exp(-s[b, g, t]), math.exp(ref[b, g, t])
      d2 = 0.5 * (math.sqrt(p) - math.sqrt(q)) ** 2
      if form == "binary":
        d2 += 0.5 * (math.sqrt(1 - p) - math.sqrt(1 - q)) ** 2
      score.append(math.sqrt(d2) * h[b, g, t])
    total = sum(score)
    for t, c in zip(ts, score):
      w = len(ts) * c / total if total > 0 else 1.0
      out[b, g, t] = base[b, g, t] * (1 - mix + mix * w)
  return out


@FEW
@given(batches(), st.sampled_from([0.5, 1.0]), st.sampled_from(["binary", "token"]))
def test_dgpo_redistributes_the_sequence_advantage_by_gated_hellinger(r, mix, form):
  got = credit.get("dgpo")(r, mix=mix, form=form)
  close(got, ref_dgpo(r, mix, form), rtol=1e-4)
  mask, rewards = np.asarray(r.mask), np.asarray(r.rewards, np.float64)
  lengths = mask.sum(-1)
  close(np.asarray(got, np.float64).sum(-1), grpo_ref(rewards) * lengths, rtol=1e-4)  # total kept


def test_hellinger_reading_is_exact_on_two_tokens_and_a_lower_bound_on_more():
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(2), 50)
  q = rng.dirichlet(np.ones(2), 50)
  full = np.sqrt(0.5 * ((np.sqrt(p) - np.sqrt(q)) ** 2).sum(-1))
  close(hellinger(np.log(p[:, 0]), np.log(q[:, 0])), full, atol=1e-6)
  p, q = rng.dirichlet(np.ones(6), 200), rng.dirichlet(np.ones(6), 200)
  full = np.sqrt(0.5 * ((np.sqrt(p) - np.sqrt(q)) ** 2).sum(-1))
  for form in ("binary", "token"):
    assert np.all(np.asarray(hellinger(np.log(p[:, 0]), np.log(q[:, 0]), form)) <= full + 1e-6)
  assert np.all(np.asarray(hellinger(np.log(p[:, 0]), np.log(p[:, 0]))) == 0)


def ref_ucas(r, bp, bn, lam, confidence):
  mask, rewards, s, h, _ = arrays(r)
  adv = grpo_ref(rewards)
  out = np.zeros(mask.shape)
  vals = -s[mask]
  lo, hi = (vals.min(), vals.max()) if vals.size else (0.0, 0.0)
  for b in range(len(rewards)):
    c = -h[b] if confidence == "entropy" else -s[b]
    conf = np.array([c[g][mask[b, g]].sum() for g in range(mask.shape[1])])
    if len(conf) == 1:
      z = conf / (1 + 1e-6)
    elif conf.max() == conf.min():
      z = np.zeros_like(conf)
    else:
      z = (conf - conf.mean()) / (conf.std(ddof=1) + 1e-6)
    for g in range(mask.shape[1]):
      a = adv[b, g] * (math.exp(-bp * z[g]) if adv[b, g] > 0 else math.exp(bn * z[g]))
      for t in np.nonzero(mask[b, g])[0]:
        flat = abs(hi - lo) <= 1e-8 + 1e-5 * abs(lo)
        scaled = 0.5 if flat else (-s[b, g, t] - lo) / (hi - lo + 1e-6)
        raw = a - lam * scaled
        out[b, g, t] = max(raw, 0.0) if a > 0 else raw
  return out


@FEW
@given(batches(), st.sampled_from(["entropy", "logprob"]))
def test_ucas_confidence_modulation_and_certainty_penalty(r, confidence):
  got = credit.get("ucas")(r, confidence=confidence)
  close(got, ref_ucas(r, 0.25, 0.35, 0.05, confidence), rtol=1e-4, atol=2e-5)


def ref_dcpo(r, target=0.5, t_high=1.2, t_low=0.8, alpha_max=0.1, threshold=0.05):
  mask, rewards, s, h, _ = arrays(r)
  base = ref_tokens(grpo_ref(rewards), mask)
  hbar = h[mask].mean() if mask.any() else 0.0
  temp = t_high if hbar <= target else t_low
  correct = rewards > threshold
  rho = correct.mean()
  a = min(abs(target - hbar), alpha_max) / rho if rho > 0 else 0.0
  alpha = a / (1 + a)
  out = np.zeros_like(base)
  for i in zip(*np.nonzero(mask)):
    ratio = math.exp(min(20.0, max(-20.0, (1 - 1 / temp) * (s[i] - h[i]))))
    out[i] = (1 - alpha) * base[i] + alpha * correct[i[:2]] * ratio
  return out


@FEW
@given(batches(), st.sampled_from([0.2, 0.5, 0.9]))
def test_dcpo_mixes_grpo_with_the_tempered_ratio_on_correct_responses(r, target):
  close(credit.get("dcpo")(r, entropy_target=target), ref_dcpo(r, target), rtol=1e-4)


def test_dcpo_first_order_ratio_is_close_to_the_exact_tempered_ratio():
  rng = np.random.default_rng(1)
  for temp in (1.05, 0.95):
    for _ in range(20):
      p = rng.dirichlet(np.ones(8) * 0.7)
      h = -(p * np.log(p)).sum()
      exact = p ** (1 / temp) / (p ** (1 / temp)).sum() / p
      approx = np.exp((1 - 1 / temp) * (-np.log(p) - h))
      np.testing.assert_allclose(approx, exact, rtol=0.03)


# --- reductions, shapes, degenerate input, errors --------------------------------------

NEUTRAL = {"stare": dict(reweight_pos=1.0, reweight_neg=1.0, variant="C2", target_entropy=9.0),
           "taco": dict(lam=0.0), "a3po": dict(pos_scale=0.0, neg_scale=0.0),
           "miner": dict(correct_scale=0.0, incorrect_scale=0.0), "dgpo": dict(mix=0.0),
           "ucas": dict(beta_pos=0.0, beta_neg=0.0, penalty=0.0), "dcpo": dict(alpha_max=0.0)}


@settings(max_examples=10, deadline=None)
@given(batches())
def test_unit_weights_are_grpo_exactly(r):
  grpo = np.asarray(credit.get("grpo")(r))
  for name, hp in NEUTRAL.items():
    np.testing.assert_array_equal(credit.get(name)(r, **hp), grpo, err_msg=name)
  same = r.replace(ref_logprobs=r.logprobs)  # π = π_ref: DGPO has nothing to redistribute
  np.testing.assert_array_equal(credit.get("dgpo")(same), grpo)
  off = credit.get("stare")(r, target_entropy=0.0)  # gate off: entropy never below 0
  np.testing.assert_array_equal(off, grpo)


def test_jit_and_vmap_match_eager_per_slice():
  tokens, mask, rewards = fixed(6, 12, 2)
  r = make(tokens, mask, (np.arange(12).reshape(2, 6) % 3 == 0).astype(np.float32), 0)
  for name in NAMES:
    f = credit.get(name)
    close(jax.jit(f)(r), np.asarray(f(r)), atol=1e-6)
    one = jax.jit(f)  # batch statistics are per mapped slice under vmap
    per_slice = np.stack([np.asarray(one(jax.tree.map(lambda x: x[b], r))) for b in range(2)])
    close(jax.jit(jax.vmap(f))(r), per_slice, atol=1e-6)


def test_degenerate_batches_are_finite_and_zero_off_the_mask():
  cases = []
  for g in (1, 4):
    tokens, mask, rewards = fixed(g, 5, 2)
    cases += [(tokens, mask, rewards), (tokens, np.zeros_like(mask), rewards),
              (tokens, mask, np.full(rewards.shape, 0.3, np.float32))]
  for tokens, m, rw in cases:
    r = make(tokens, m, rw, 0)
    for name in NAMES:
      adv = np.asarray(credit.get(name)(r))
      assert np.all(np.isfinite(adv)) and np.all(adv[~m] == 0), name
      if not m.any():
        assert np.all(adv == 0), name


def test_missing_fields_are_named():
  tokens, mask, rewards = fixed(3, 5, 1)
  r = make(tokens, mask, rewards, 0)
  for name in NAMES:
    for field in credit.needs(name):
      with pytest.raises(ValueError, match=field):
        credit.get(name)(r.replace(**{field: None}))
  assert credit.needs("dgpo") == ("logprobs", "ref_logprobs", "entropy")
  assert credit.stateful("stare") and credit.stateful("a3po") and not credit.stateful("taco")


@pytest.mark.parametrize("name, hp", [
    ("stare", dict(variant="O2")), ("stare", dict(top_ratio=1.5)),
    ("stare", dict(reweight_pos=-1.0)), ("stare", dict(entropy_ema=1.0)),
    ("taco", dict(alpha=0.0)), ("taco", dict(lam=2.0)), ("a3po", dict(top_ratio=-0.1)),
    ("a3po", dict(pos_scale=-1.0)), ("miner", dict(gamma=-1.0)), ("dgpo", dict(mix=1.5)),
    ("dgpo", dict(form="kl")), ("ucas", dict(confidence="logits")), ("ucas", dict(penalty=-1)),
    ("dcpo", dict(temperature_low=0.0)), ("dcpo", dict(alpha_max=-0.1))])
def test_bad_hyperparameters_are_refused(name, hp):
  tokens, mask, rewards = fixed(3, 5, 1)
  with pytest.raises(ValueError, match=name):
    credit.get(name)(make(tokens, mask, rewards, 0), **hp)
