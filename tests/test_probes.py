"""Self-probe potentials (issue 23): the gold-continuation probes of
experiments/training/probes.py against teacher forcing of hand-built sequences, and SPAE,
P2S and MIG (credit/probes.py) against plain-Python references and their GRPO reductions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
from credit.rollouts import StepProbes
from envs.scratchpad_addition import ScratchpadAddition
from experiments.models import decoder
from experiments.training import probes
from groups import groups, grpo_ref

S = 3  # probes 0..S


# ------------------------------------------------------------------ the probe pass


def ref_cuts(ends, mask, s):
  pos = [t for t in range(len(mask)) if mask[t] and ends[t]]
  cuts = [0] + [pos[k - 1] + 1 if k <= len(pos) else 0 for k in range(1, s + 1)]
  ok = [True] + [k < len(pos) for k in range(1, s + 1)]
  return [c if o else 0 for c, o in zip(cuts, ok)], ok


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_probe_cuts_match_reference(seed):
  rng = np.random.default_rng(seed)
  ends = rng.random((5, 7)) < 0.35
  mask = np.arange(7) < rng.integers(0, 8, (5, 1))
  cuts, ok = (np.asarray(x) for x in probes.probe_cuts(ends, mask, S))
  for i in range(5):
    want_c, want_ok = ref_cuts(ends[i], mask[i], S)
    assert list(cuts[i]) == want_c and list(ok[i]) == want_ok


TASK = ScratchpadAddition(num_digits=2)
CFG = decoder.PolicyConfig(vocab_size=TASK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                           d_ff=32, max_len=TASK.prompt_len + 2 * TASK.response_len)


forward = jax.jit(lambda params, prompt, seq: decoder.token_logprobs(params, CFG, prompt, seq))


def jitted_task(task):
  """The task's sample, demonstrations and step ends jitted (one program per shape; op by
  op they compile a few hundred small programs): the fixtures of the probe-pass tests."""
  return (jax.jit(task.sample, static_argnums=1), jax.jit(task.demonstrations),
          jax.jit(task.step_ends))


def test_probes_equal_teacher_forcing_of_the_gold_continuation():
  params = decoder.init_params(jax.random.PRNGKey(0), CFG)
  sample, demonstrations, step_ends = jitted_task(TASK)
  b, g, l = 2, 3, TASK.response_len
  prompts, info = sample(jax.random.key(1), b)
  demo, dmask = (np.asarray(x) for x in demonstrations(prompts, info))
  # Responses: the demonstration, one with a wrong carry step, one cut after a step.
  style = sample(jax.random.key(2), b)[1]['style']  # another valid path
  other, omask = (np.asarray(x) for x in demonstrations(prompts, {**info, 'style': style}))
  tokens = np.stack([demo, other, demo], 1)
  mask = np.stack([dmask, omask, dmask], 1)
  tokens[:, 1, 0] = (tokens[:, 1, 0] + 1) % 10  # a wrong first term
  first_comma = [int(np.argmax(demo[i] == TASK.token_id(','))) for i in range(b)]
  for i in range(b):
    mask[i, 2, first_comma[i] + 1:] = False  # truncated after step 1: no EOS
  ginfo = jax.tree.map(lambda x: jnp.repeat(x[:, None], g, 1), info)
  gp = jnp.repeat(prompts[:, None], g, 1)
  ends = np.asarray(step_ends(gp, jnp.asarray(tokens), jnp.asarray(mask), ginfo)) & mask
  got = probes.step_probes(params, prompts, jnp.asarray(tokens), jnp.asarray(mask),
                           jnp.asarray(ends), info, cfg=CFG, task=TASK)
  d_ends = np.asarray(step_ends(prompts, jnp.asarray(demo), jnp.asarray(dmask), info))
  for i in range(b):
    starts, _ = ref_cuts(d_ends[i], dmask[i], TASK.reasoning_steps)
    dl = int(dmask[i].sum())
    for j in range(g):
      cuts, ok = ref_cuts(ends[i, j], mask[i, j], TASK.reasoning_steps)
      assert list(np.asarray(got.mask[i, j])) == ok
      for k in range(TASK.reasoning_steps + 1):
        if not ok[k]:
          assert got.logprobs[i, j, k] == 0.0
          continue
        cont = demo[i, starts[k]:dl]
        seq = np.concatenate([tokens[i, j, :cuts[k]], cont])
        seq = np.pad(seq, (0, 2 * l - len(seq)), constant_values=TASK.pad_id)
        lp, ent = forward(params, prompts[i:i + 1], jnp.asarray(seq[None]))
        on = slice(cuts[k], cuts[k] + len(cont))
        np.testing.assert_allclose(got.logprobs[i, j, k], np.mean(np.asarray(lp)[0, on]),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.entropy[i, j, k], np.mean(np.asarray(ent)[0, on]),
                                   rtol=1e-5, atol=1e-5)
  # The truncated response has probes 0 and 1 only (its step 1 is its last step end).
  assert list(np.asarray(got.mask[0, 2])) == [True, False, False]
  assert list(np.asarray(got.mask[0, 0])) == [True, True, True]


# ------------------------------------------------------------------ the estimators


def probe_rollouts(draw_group, seed):
  tokens, mask, rewards = draw_group
  rng = np.random.default_rng(seed)
  ends = (rng.random(mask.shape) < 0.4) & mask
  n = rng.integers(1, S + 2, mask.shape[:-1])
  pmask = np.arange(S + 1) < n[..., None]
  lp = np.where(pmask, -rng.exponential(1.0, pmask.shape), 0.0).astype(np.float32)
  ent = np.where(pmask, rng.exponential(0.5, pmask.shape), 0.0).astype(np.float32)
  if rng.random() < 0.3:  # near-certain probes: SPAE saturates
    lp = np.where(pmask & (rng.random(pmask.shape) < 0.5), -1e-3, lp).astype(np.float32)
    ent = np.where(lp == np.float32(-1e-3), 1e-3, ent).astype(np.float32)
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, step_ends=ends,
                         step_probes=StepProbes(logprobs=lp, entropy=ent, mask=pmask))


def ref_steps(ends, mask):
  """Each token's step index: the step ends strictly before it."""
  out, seen = [], 0
  for t in range(len(mask)):
    out.append(seen)
    seen += int(mask[t] and ends[t])
  return out


def ref_norm(values):
  """{key: (v − mean)/(std + eps)} over a group's valid steps (0 if < 2 or all equal)."""
  vals = list(values.values())
  if len(vals) < 2 or max(vals) == min(vals):
    return {k: 0.0 for k in values}
  m = np.mean(vals)
  s = np.std(vals, ddof=1)
  return {k: (v - m) / (s + 1e-6) for k, v in values.items()}


def ref_estimator(r, kind, **hp):
  tokens, mask, rewards = (np.asarray(x) for x in (r.tokens, r.mask, r.rewards))
  lp, ent, pm = (np.asarray(x, np.float64) for x in (r.step_probes.logprobs,
                                                    r.step_probes.entropy, r.step_probes.mask))
  pm = pm.astype(bool)
  out = np.zeros(mask.shape)
  g = mask.shape[0]
  a = grpo_ref(rewards)
  ok = {(i, j): pm[i, j] and pm[i, j + 1] for i in range(g) for j in range(S)}
  if kind == "p2s":
    vals = {k: math.exp(lp[k[0], k[1] + 1]) for k, v in ok.items() if v}
  elif kind == "mig":
    vals = {}
    for (i, j), v in ok.items():
      if v:
        vals[i, j] = max(0.0, lp[i, j + 1] - max(lp[i, :j + 1]))
  if kind in ("p2s", "mig"):
    norm = ref_norm(vals)
  for i in range(g):
    steps = ref_steps(np.asarray(r.step_ends)[i], mask[i])
    phi = [1.5 * math.exp(lp[i, k]) * math.exp(-ent[i, k]) + 0.5 * math.exp(lp[i, k])
           - math.exp(-ent[i, k]) for k in range(S + 1)]
    for t in range(mask.shape[1]):
      if not mask[i, t]:
        continue
      j = steps[t]
      has = j < S and ok[i, j]
      if kind in ("p2s", "mig"):
        out[i, t] = a[i] + (hp["coef"] * norm[i, j] if has else 0.0)
      else:
        sat = any(pm[i, k] and phi[k] > hp["saturation"] for k in range(min(j, S) + 1))
        f = 1.0
        if has and sat:
          f = 1 - hp["penalty"] if a[i] > 0 else 1 + hp["penalty"]
        out[i, t] = a[i] * f + (hp["xi"] * (phi[j + 1] - phi[j]) if has else 0.0)
  return out


HPARAMS = {"p2s": [dict(coef=0.5), dict(coef=2.0)], "mig": [dict(coef=0.5), dict(coef=1.0)],
           "spae": [dict(xi=0.2, saturation=0.9, penalty=0.5),
                    dict(xi=1.0, saturation=0.0, penalty=0.3)]}


@pytest.mark.parametrize("kind", sorted(HPARAMS))
@settings(max_examples=25, deadline=None)
@given(group=groups(sizes=(1, 3, 6), lengths=(5, 12)), seed=st.integers(0, 2**31 - 1),
       which=st.integers(0, 1))
def test_probe_estimators_match_reference(kind, group, seed, which):
  r = probe_rollouts(group, seed)
  hp = HPARAMS[kind][which]
  got = np.asarray(credit.get(kind)(credit.validate(r), **hp))
  np.testing.assert_allclose(got, ref_estimator(r, kind, **hp), rtol=2e-4, atol=2e-5)


@settings(max_examples=10, deadline=None)
@given(group=groups(sizes=(3, 6), lengths=(5, 12)), seed=st.integers(0, 2**31 - 1))
def test_without_the_process_term_each_is_grpo_bit_for_bit(group, seed):
  r = probe_rollouts(group, seed)
  grpo = np.asarray(credit.get("grpo")(r))
  np.testing.assert_array_equal(np.asarray(credit.get("p2s")(r, coef=0.0)), grpo)
  np.testing.assert_array_equal(np.asarray(credit.get("mig")(r, coef=0.0)), grpo)
  np.testing.assert_array_equal(np.asarray(credit.get("spae")(r, xi=0.0, penalty=0.0)), grpo)


def test_nan_probe_is_named_or_stays_nan_and_missing_probes_are_refused():
  tokens = np.zeros((4, 6), np.int32)
  mask = np.ones((4, 6), bool)
  ends = np.zeros((4, 6), bool)
  ends[:, [1, 3]] = True
  pm = np.ones((4, S + 1), bool)
  lp = -np.ones((4, S + 1), np.float32)
  lp[0, 1] = np.nan
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=np.array([1.0, 0, 1, 0]),
                      step_ends=ends, step_probes=StepProbes(lp, np.ones_like(lp), pm))
  with pytest.raises(ValueError, match=r"step_probes.logprobs\[0, 1\]"):
    credit.validate(r)
  for kind in HPARAMS:  # under jit nothing can raise: a NaN potential gives NaN, never 0
    assert np.isnan(np.asarray(credit.get(kind)(r))[0, 0]), kind
  with pytest.raises(ValueError, match="step_probes"):
    credit.get("spae")(r.replace(step_probes=None))
  with pytest.raises(ValueError, match="S >= 1"):
    credit.validate(r.replace(step_probes=StepProbes(lp[:, :1], lp[:, :1], pm[:, :1])))


def test_countdown_steps_demonstrations_have_every_probe():
  # countdown_steps: k − 2 probes after steps, the last step (to the target) is the answer.
  from envs.countdown_steps import CountdownSteps
  task = CountdownSteps(num_numbers=3, max_number=9)
  cfg = decoder.PolicyConfig(vocab_size=task.vocab_size, d_model=16, num_layers=1, num_heads=2,
                             d_ff=32, max_len=task.prompt_len + 2 * task.response_len)
  params = decoder.init_params(jax.random.PRNGKey(1), cfg)
  sample, demonstrations, step_ends = jitted_task(task)
  prompts, info = sample(jax.random.key(3), 3)
  demo, dmask = demonstrations(prompts, info)
  tokens, mask = demo[:, None], dmask[:, None]  # G = 1: the demonstration itself
  ends = step_ends(prompts, demo, dmask, info)[:, None] & mask
  got = probes.step_probes(params, prompts, tokens, mask, ends, info, cfg=cfg, task=task)
  assert got.mask.shape == (3, 1, task.reasoning_steps + 1) and bool(jnp.all(got.mask))
  assert np.all(np.isfinite(np.asarray(got.logprobs))) and np.all(np.asarray(got.logprobs) < 0)
