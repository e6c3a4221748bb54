"""Gradient saliency (experiments/training/saliency.py) against gradients w.r.t. the
embedding table and finite differences on the tiny decoder; GRAIL (credit/saliency.py)
against a plain-Python reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import credit
import credit.saliency  # noqa: F401 (registers grail)
from experiments.models import decoder
from experiments.training import saliency
from tests.groups import groups
from groups import grpo_ref
from tests.test_context_shift import ref_mass_conserving

V, B, G, P, L = 40, 2, 3, 4, 6
CFG = decoder.PolicyConfig(vocab_size=V, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                           max_len=P + L)


@pytest.fixture(scope="module")
def batch():
  """Params and rows whose prompt + response tokens are all distinct within each row, so
  the gradient w.r.t. embedding-table row y equals the gradient at y's one position.
  Group 0's prompt is whole, group 1's right-padded (prompt_len 2)."""
  params = decoder.init_params(jax.random.PRNGKey(0), CFG)
  rng = np.random.default_rng(0)
  prompts = np.zeros((B, P), np.int32)
  tokens = np.zeros((B, G, L), np.int32)
  for b in range(B):
    perm = rng.permutation(V)
    prompts[b] = perm[:P]
    for g in range(G):
      tokens[b, g] = rng.choice(perm[P:], L, replace=False)
  lengths = np.array([[L, 4, 1], [2, L, 5]])
  mask = np.arange(L) < lengths[..., None]
  plen = np.array([P, 2], np.int32)
  return params, jnp.asarray(prompts), jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(plen)


def run(batch, target=None, **kw):
  params, prompts, tokens, mask, plen = batch
  target = mask if target is None else target  # always an array: one compile per kw
  return np.asarray(saliency.token_saliency(params, prompts, tokens, mask, plen, target,
                                            cfg=CFG, **kw))


@jax.jit
@jax.grad
def table_grad(table, params, prompt, response, target, plen):
  """∂J/∂(embedding table) [V, D] of one row, J = Σ_t target_t log π(y_t)."""
  lp, _ = decoder.token_logprobs({**params, "embed": {"embedding": table}}, CFG, prompt[None],
                                 response[None], plen[None])
  return jnp.sum(jnp.where(target, lp[0], 0.0))


def table_reference(batch, target, kind="grad_norm"):
  """Saliency from ∂J/∂(embedding table), one row at a time: row y_t of the table's
  gradient is token t's (its only occurrence in the row's input); 0 off mask."""
  params, prompts, tokens, mask, plen = batch
  table = params["embed"]["embedding"]
  out = np.zeros(tokens.shape)
  for b in range(B):
    for g in range(G):
      grad = np.asarray(table_grad(table, params, prompts[b], tokens[b, g], target[b, g],
                                   plen[b]), np.float64)
      for t in range(L):
        row = grad[int(tokens[b, g, t])]
        e = np.asarray(table[int(tokens[b, g, t])], np.float64)
        out[b, g, t] = np.linalg.norm(row) if kind == "grad_norm" else abs(row @ e)
  return np.where(mask, out, 0.0)


def close(got, want):
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * np.abs(want).max())


def test_saliency_equals_embedding_table_gradients(batch):
  mask = np.asarray(batch[3])
  for kind in saliency.KINDS:
    got = run(batch, kind=kind)
    close(got, table_reference(batch, mask, kind))
    last = mask.sum(-1) - 1  # the last token is never fed back inside the response: 0
    for b, g in np.ndindex(B, G):
      if last[b, g] >= 0:
        assert got[b, g, last[b, g]] == 0
    assert np.sum(got > 1e-3) >= 8  # non-trivial: the other tokens are salient
  policy = mask & (np.arange(L) % 2 == 0)  # e.g. a multi-turn policy mask
  close(run(batch, policy), table_reference(batch, policy))
  after = np.cumsum(mask[..., ::-1], -1)[..., ::-1]  # (rows in 3 sequential parts, too)
  close(run(batch, answer_tokens=2, chunks=3), table_reference(batch, mask & (after <= 2)))


def test_saliency_equals_finite_differences(batch):
  """Central differences of J (row b=0, g=0) along token t's embedding: along each
  coordinate they give ∂J/∂e_t, whose norm is grad_norm; along e_t, <∂J/∂e_t, e_t>."""
  params, prompts, tokens, mask, plen = batch
  table = params["embed"]["embedding"]
  t, eps = 1, 1e-2
  row = int(tokens[0, 0, t])

  @jax.jit
  def j_of(shift):
    e = table.at[row].add(shift)
    lp, _ = decoder.token_logprobs({**params, "embed": {"embedding": e}}, CFG, prompts[:1],
                                   tokens[0, :1], plen[:1])
    return jnp.sum(jnp.where(mask[0, 0], lp[0], 0.0))

  fd = lambda u: (float(j_of(eps * u)) - float(j_of(-eps * u))) / (2 * eps)
  grad_fd = np.array([fd(np.eye(CFG.d_model, dtype=np.float32)[k])
                      for k in range(CFG.d_model)])
  assert run(batch)[0, 0, t] == pytest.approx(np.linalg.norm(grad_fd), rel=2e-2)
  assert run(batch, kind="grad_x_input")[0, 0, t] == pytest.approx(
      abs(fd(np.asarray(table[row]))), rel=2e-2, abs=1e-3)
  with pytest.raises(ValueError, match="kind"):
    run(batch, kind="integrated")
  with pytest.raises(ValueError, match="answer_tokens"):
    run(batch, answer_tokens=-1)


# ----------------------------------------------------------------------------
# GRAIL.


def ref_grail(rewards, mask, sal, mix=0.5, power=1.0, normalize="response"):
  u = np.where(mask, np.asarray(sal, np.float64) ** power, 0.0)
  w = 1 + mix * (ref_mass_conserving(u, mask, normalize) - 1)
  return np.where(mask, grpo_ref(rewards)[..., None] * w, 0.0)


@st.composite
def salient_rollouts(draw):
  tokens, mask, rewards = draw(groups(sizes=(1, 3, 6), lengths=(1, 6), batch=(2,)))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  sal = rng.exponential(1.0, tokens.shape) * (rng.random(tokens.shape) < 0.7)  # some zeros
  return credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards,
                         saliency=np.where(mask, sal, 0.0).astype(np.float32))


@settings(max_examples=20, deadline=None)
@given(r=salient_rollouts(), mix=st.sampled_from([0.0, 0.5, 1.0]),
       power=st.sampled_from([1.0, 2.0, 0.5]), normalize=st.sampled_from(["response", "group"]))
def test_grail_matches_reference(r, mix, power, normalize):
  got = credit.get("grail")(r, mix=mix, power=power, normalize=normalize)
  np.testing.assert_allclose(np.asarray(got), ref_grail(r.rewards, r.mask, r.saliency, mix,
                                                        power, normalize),
                             rtol=2e-5, atol=2e-5)


def test_grail_reduces_to_grpo_and_checks_its_inputs():
  rng = np.random.default_rng(0)
  mask = np.arange(5) < rng.integers(0, 6, (3, 4))[..., None]
  r = credit.Rollouts(tokens=np.zeros((3, 4, 5), np.int32), mask=mask,
                      rewards=rng.integers(0, 2, (3, 4)).astype(np.float32),
                      saliency=np.where(mask, rng.random((3, 4, 5)), 0).astype(np.float32))
  grpo = np.asarray(credit.get("grpo")(r))
  grail = credit.get("grail")
  np.testing.assert_array_equal(np.asarray(grail(r, mix=0.0)), grpo)
  np.testing.assert_array_equal(np.asarray(grail(r.replace(saliency=np.zeros_like(r.saliency)))),
                                grpo)
  np.testing.assert_allclose(np.asarray(grail(r)).sum(-1), grpo[..., 0] * mask.sum(-1),
                             rtol=1e-5, atol=1e-5)  # mass-conserving
  np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(grail))(r)), np.asarray(grail(r)),
                             atol=1e-6)
  with pytest.raises(ValueError, match="saliency"):
    grail(r.replace(saliency=None))
  for hp in (dict(mix=-0.1), dict(power=0.0), dict(normalize="batch"),
             dict(saliency_kind="grad"), dict(answer_tokens=-2)):
    with pytest.raises(ValueError, match=next(iter(hp))):
      grail(r, **hp)
