"""GCPO and PGPO (credit/context_shift.py) against plain-Python references, the loop's
changed-context pass and prompt log-probs against direct computations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
import credit.context_shift  # noqa: F401 (registers gcpo, pgpo)
from groups import groups, grpo_ref

SETTINGS = settings(max_examples=20, deadline=None)


def ref_mass_conserving(u, mask, normalize):
  """w = u · n / Σ|u| per response (or group), 1 where Σ|u| = 0, 0 off mask; loops."""
  w = np.zeros(u.shape)
  for idx in np.ndindex(u.shape[:-2]):
    g, l = u.shape[-2:]
    units = [[i] for i in range(g)] if normalize == "response" else [list(range(g))]
    for rows in units:
      toks = [(i, t) for i in rows for t in range(l) if mask[idx + (i, t)]]
      total = sum(abs(u[idx + k]) for k in toks)
      for k in toks:
        w[idx + k] = u[idx + k] * len(toks) / total if total > 0 else 1.0
  return w


def ref_gcpo(rewards, mask, lp, ctx, transform="abs", mix=1.0, normalize="response"):
  x = np.where(mask, lp.astype(np.float64) - ctx, 0.0)
  d = {"relu": np.maximum(x, 0), "abs": np.abs(x), "signed": x}[transform]
  w = 1 + mix * (ref_mass_conserving(d, mask, normalize) - 1)
  return np.where(mask, grpo_ref(rewards)[..., None] * w, 0.0)


def ref_pgpo(rewards, mask, lp, ctx, estimator="k3", threshold=1.0, absolute=False,
             weight="proportional", floor=0.2, max_ratio=10.0):
  """Per response: dependency, mean, gate, weights, mass-conserving normalisation."""
  base = grpo_ref(rewards)
  out = np.zeros(mask.shape)
  for idx in np.ndindex(mask.shape[:-1]):
    toks = [t for t in range(mask.shape[-1]) if mask[idx + (t,)]]
    if not toks:
      continue
    x = {t: float(lp[idx + (t,)]) - float(ctx[idx + (t,)]) for t in toks}
    dep = {t: {"k3": math.expm1(-x[t]) + x[t], "relu": max(x[t], 0.0),
               "abs": abs(x[t])}[estimator] for t in toks}
    mean = sum(dep.values()) / len(toks)
    tau = threshold if absolute else threshold * mean
    gate = {t: dep[t] > tau for t in toks}
    if not any(gate.values()):
      w = {t: 1.0 for t in toks}
    else:
      v = {t: min(dep[t] / (mean if mean > 0 else 1.0), max_ratio) if weight == "proportional"
           else 1.0 for t in toks}
      u = {t: v[t] if gate[t] else floor for t in toks}
      total = sum(abs(a) for a in u.values())
      w = {t: u[t] * len(toks) / total for t in toks}
    for t in toks:
      out[idx + (t,)] = base[idx] * w[t]
  return out


@st.composite
def context_rollouts(draw, batch=(2,)):
  """groups() with sampling and changed-context log-probs; some tokens unchanged (x = 0)."""
  tokens, mask, rewards = draw(groups(sizes=(1, 3, 6), lengths=(1, 6), batch=batch))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  lp = -rng.exponential(1.0, tokens.shape).astype(np.float32)
  ctx = (lp - rng.normal(0.0, 1.0, tokens.shape)).astype(np.float32)
  ctx = np.where(rng.random(tokens.shape) < 0.3, lp, ctx)  # x = 0 here
  lp, ctx = np.where(mask, lp, 0.0), np.where(mask, ctx, 0.0)
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, logprobs=lp,
                         context_logprobs=ctx)


@SETTINGS
@given(r=context_rollouts(), transform=st.sampled_from(["abs", "relu", "signed"]),
       mix=st.sampled_from([0.0, 0.4, 1.0]), normalize=st.sampled_from(["response", "group"]))
def test_gcpo_matches_reference(r, transform, mix, normalize):
  got = credit.get("gcpo")(r, transform=transform, mix=mix, normalize=normalize)
  want = ref_gcpo(r.rewards, r.mask, r.logprobs, r.context_logprobs, transform, mix, normalize)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  assert np.all(np.asarray(got)[~r.mask] == 0)


@SETTINGS
@given(r=context_rollouts(), estimator=st.sampled_from(["k3", "relu", "abs"]),
       threshold=st.sampled_from([0.0, 1.0, 1.5]), absolute=st.booleans(),
       weight=st.sampled_from(["proportional", "binary"]), floor=st.sampled_from([0.0, 0.2, 1.0]))
def test_pgpo_matches_reference(r, estimator, threshold, absolute, weight, floor):
  hp = dict(estimator=estimator, threshold=threshold, absolute=absolute, weight=weight,
            floor=floor, max_ratio=3.0)
  got = credit.get("pgpo")(r, **hp)
  want = ref_pgpo(r.rewards, r.mask, r.logprobs, r.context_logprobs, **hp)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@SETTINGS
@given(r=context_rollouts())
def test_unchanged_context_is_grpo_exactly_and_weights_conserve_mass(r):
  grpo = np.asarray(credit.get("grpo")(r))
  same = r.replace(context_logprobs=r.logprobs)
  for name in ("gcpo", "pgpo"):
    np.testing.assert_array_equal(np.asarray(credit.get(name)(same)), grpo)
  np.testing.assert_array_equal(np.asarray(credit.get("gcpo")(r, mix=0.0)), grpo)
  # Mass conservation: each response's token credits sum to n · A_i (weights >= 0).
  n = r.mask.sum(-1)
  for name in ("gcpo", "pgpo"):
    total = np.asarray(credit.get(name)(r)).sum(-1)
    np.testing.assert_allclose(total, grpo[..., 0] * n, rtol=1e-4, atol=1e-4)


def test_jit_vmap_degenerate_and_errors():
  rng = np.random.default_rng(0)
  b, g, l = 3, 4, 5
  mask = np.ones((b, g, l), bool)
  mask[0] = False  # an all-masked group
  mask[1, 0] = False  # an all-masked response
  r = credit.Rollouts(tokens=np.zeros((b, g, l), np.int32), mask=mask,
                      rewards=rng.integers(0, 2, (b, g)).astype(np.float32),
                      logprobs=np.where(mask, -rng.random((b, g, l)), 0).astype(np.float32),
                      context_logprobs=np.where(mask, -2 * rng.random((b, g, l)), 0).astype(
                          np.float32))
  for name in ("gcpo", "pgpo"):
    est = credit.get(name)
    eager = np.asarray(est(r))
    assert np.all(np.isfinite(eager)) and np.all(eager[~mask] == 0)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(est))(r)), eager, rtol=1e-6,
                               atol=1e-6)
    one = jax.tree.map(lambda x: x[:, :1], r)  # G = 1: finite
    assert np.all(np.isfinite(np.asarray(est(one))))
    with pytest.raises(ValueError, match="context_logprobs"):
      est(r.replace(context_logprobs=None))
    with pytest.raises(ValueError, match="logprobs"):
      est(r.replace(logprobs=None))
  for hp in (dict(transform="log"), dict(mix=1.5), dict(normalize="batch")):
    with pytest.raises(ValueError, match=next(iter(hp))):
      credit.get("gcpo")(r, **hp)
  for hp in (dict(estimator="k2"), dict(threshold=-1.0), dict(floor=-0.1), dict(max_ratio=0.0),
             dict(weight="soft")):
    with pytest.raises(ValueError, match=next(iter(hp))):
      credit.get("pgpo")(r, **hp)


# ----------------------------------------------------------------------------
# The loop's side: the changed context and prompt log-probs.


@pytest.fixture(scope="module")
def tiny():
  from experiments.models import decoder
  cfg = decoder.PolicyConfig(vocab_size=11, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                             max_len=14)
  return decoder.init_params(jax.random.PRNGKey(0), cfg), cfg


def test_context_logprobs_are_the_next_prompts_teacher_forced_logprobs(tiny):
  from experiments.models import decoder
  from experiments.rollouts import text_rollouts
  from experiments.training import loop
  params, cfg = tiny
  rng = np.random.default_rng(1)
  b, g, p, l = 3, 2, 4, 5
  prompts = jnp.asarray(rng.integers(0, 11, (b, p)), jnp.int32)
  plen = jnp.asarray([4, 2, 3], jnp.int32)
  tokens = jnp.asarray(rng.integers(0, 11, (b, g, l)), jnp.int32)
  mask = jnp.asarray(np.arange(l) < rng.integers(1, l + 1, (b, g))[..., None])
  draw = text_rollouts.Draw(prompts, plen, jnp.arange(b), [None] * b)  # a text-task draw
  ctx_p, ctx_len = loop.context_prompts(type('P', (), {})(), draw, prompts, plen)
  got = loop.rows_logprobs(params, ctx_p, tokens, mask, ctx_len, cfg=cfg)
  rows, starts = [], []
  for i in range(b):
    j = (i + 1) % b  # the next group's prompt
    for k in range(g):  # the next prompt's true tokens, the response, padding at the end
      seq = np.concatenate([np.asarray(prompts[j, :int(plen[j])]), np.asarray(tokens[i, k])])
      rows.append(np.pad(seq, (0, p + l - len(seq))))
      starts.append(int(plen[j]))
  logp = np.asarray(jax.nn.log_softmax(decoder.forward(params, cfg, jnp.asarray(rows))),
                    np.float64)  # causal: the padding at the end changes nothing before it
  for n, (i, k) in enumerate(np.ndindex(b, g)):
    want = [logp[n, starts[n] - 1 + t, rows[n][starts[n] + t]] for t in range(l)]
    np.testing.assert_allclose(np.asarray(got[i, k]), np.where(mask[i, k], want, 0.0),
                               atol=2e-5)

  class Task:  # a JAX task's own hook wins over the roll
    @staticmethod
    def context_prompts(prompts, info):
      return prompts[:, ::-1]

  jax_draw = text_rollouts.Draw(prompts, None, jnp.arange(b), {'x': jnp.zeros(b)})
  hooked = loop.context_prompts(type('P', (), {'task': Task})(), jax_draw, prompts, None)
  np.testing.assert_array_equal(hooked[0], prompts[:, ::-1])


def test_prompt_logprobs_are_teacher_forced_with_padding_zeroed(tiny):
  from experiments.models import decoder
  from experiments.training import loop
  params, cfg = tiny
  prompts = jnp.asarray(np.random.default_rng(2).integers(0, 11, (3, 6)), jnp.int32)
  plen = jnp.asarray([6, 1, 4], jnp.int32)
  got = np.asarray(loop.prompt_logprobs(params, prompts, plen, cfg=cfg))
  logp = np.asarray(jax.nn.log_softmax(decoder.forward(params, cfg, prompts)), np.float64)
  for i in range(3):
    for t in range(6):
      want = logp[i, t - 1, int(prompts[i, t])] if 1 <= t < int(plen[i]) else 0.0
      assert got[i, t] == pytest.approx(want, abs=2e-5), (i, t)
  full = np.asarray(loop.prompt_logprobs(params, prompts, None, cfg=cfg))
  np.testing.assert_allclose(full[0], got[0], atol=1e-6)
  assert np.all(full[:, 0] == 0) and np.all(full[:, 1:] < 0)
  scored = np.asarray(loop.prompt_scored(plen, 6))  # the loop's Rollouts.prompt_mask
  np.testing.assert_array_equal(
      scored, [[1 <= t < int(plen[i]) for t in range(6)] for i in range(3)])
  np.testing.assert_array_equal(loop.prompt_scored(None, 6, 3),  # unpadded prompts
                                np.broadcast_to(np.arange(6) >= 1, (3, 6)))
