"""Alternative policy losses (LossConfig.policy_loss) and the answer-only gradient mask."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import credit
import credit.answer_mask  # noqa: F401  (registers answer_only)
from experiments.models import decoder
from experiments.training import train_step as ts
from groups import groups

N, L = 4, 5
CONFIGS = {
    'clip': ts.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0),
    'rgra': ts.LossConfig(policy_loss='rgra'),
    'apa': ts.LossConfig(policy_loss='apa', apa_coef=0.5),
    'apa_old': ts.LossConfig(policy_loss='apa', apa_coef=2.0, apa_anchor='old'),
    'em': ts.LossConfig(policy_loss='em', em_alpha=0.7, kl_coef=0.1),  # KL: not in `surrogate`
}


def tiny_case(seed):
  rng = np.random.default_rng(seed)
  mask = np.arange(L) < rng.integers(1, L + 1, (N, 1))
  old = rng.normal(size=(N, L)) - 1.5
  logp = old + 0.4 * rng.normal(size=(N, L))
  ref = old + 0.3 * rng.normal(size=(N, L))
  adv = np.where(mask, rng.normal(size=(N, 1)) * np.ones((1, L)), 0.0)
  adv[0] = np.where(mask[0], 0.0, 0.0)  # a zero-advantage row
  return logp, old, ref, adv, mask


def loss_ref(lc, logp, old, ref, adv, mask, w, kl=False):
  """sum_{n,t} w pg with the per-token formulas of the module docstring, element by element
  (`kl`: plus kl_coef k3(logp, ref) where the loss has the KL)."""
  total = 0.0
  for n in range(logp.shape[0]):
    for t in range(logp.shape[1]):
      if not mask[n, t]:
        continue
      a, lp = adv[n, t], logp[n, t]
      if lc.policy_loss == 'clip':
        r = np.exp(lp - old[n, t])
        pg = max(-r * a, -min(max(r, 1 - lc.eps_low), 1 + lc.eps_high) * a)
        if lc.dual_clip and a < 0:
          pg = min(pg, -lc.dual_clip * a)
      elif lc.policy_loss == 'rgra':
        pg = -a * lp
      elif lc.policy_loss == 'apa':
        anchor = ref[n, t] if lc.apa_anchor == 'ref' else old[n, t]
        pg = 0.5 * lc.apa_coef * (lp - anchor - a / lc.apa_coef) ** 2
      else:
        weight = lc.em_alpha if a > 0 else (-(1 - lc.em_alpha) if a < 0 else 0.0)
        pg = -weight * lp
      if kl and lc.kl_loss:
        pg += lc.kl_coef * (np.exp(ref[n, t] - lp) - 1 - (ref[n, t] - lp))
      total += w[n, t] * pg
  return total


def jax_loss(lc, logp, old, ref, adv, mask, w):
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  pg, _, _ = ts.surrogate(lc, logp, f32(old), f32(adv), jnp.asarray(mask), f32(ref))
  return jnp.sum(f32(w) * jnp.where(mask, pg, 0.0))


@pytest.mark.parametrize('name', sorted(CONFIGS))
@pytest.mark.parametrize('agg', ['token-mean', 'seq-mean-token-sum'])
def test_loss_value_and_gradient_match_numpy_and_finite_differences(name, agg):
  lc = dataclasses.replace(CONFIGS[name], agg=agg)
  logp, old, ref, adv, mask = tiny_case(0)
  w = np.asarray(ts.token_weights(jnp.asarray(mask), agg), np.float64)
  value, grad = jax.value_and_grad(jax_loss, argnums=1)(lc, jnp.asarray(logp, jnp.float32), old,
                                                         ref, adv, mask, w)
  assert float(value) == pytest.approx(loss_ref(lc, logp, old, ref, adv, mask, w), rel=1e-5,
                                       abs=1e-6)
  h, fd = 1e-6, np.zeros_like(logp)
  for idx in np.ndindex(logp.shape):  # central differences of the float64 reference
    up, down = logp.copy(), logp.copy()
    up[idx] += h
    down[idx] -= h
    fd[idx] = (loss_ref(lc, up, old, ref, adv, mask, w)
               - loss_ref(lc, down, old, ref, adv, mask, w)) / (2 * h)
  np.testing.assert_allclose(np.asarray(grad), fd, rtol=1e-4, atol=1e-6)
  assert np.all(np.asarray(grad)[~mask] == 0)


def test_analytic_gradients_and_identities_with_the_clip_loss():
  logp, old, ref, adv, mask = tiny_case(1)
  w = np.asarray(ts.token_weights(jnp.asarray(mask), 'token-mean'))
  grad = lambda lc, lp, anchor=ref: np.asarray(jax.grad(jax_loss, argnums=1)(
      lc, jnp.asarray(lp, jnp.float32), old, anchor, adv, mask, w))
  # rgra: -A w.  apa: w (lam (logp - anchor) - A).  em: -w (alpha [A>0] - (1-alpha) [A<0]).
  np.testing.assert_allclose(grad(CONFIGS['rgra'], logp), -adv * w, rtol=1e-5, atol=1e-7)
  lam = CONFIGS['apa'].apa_coef
  np.testing.assert_allclose(grad(CONFIGS['apa'], logp),
                             np.where(mask, w * (lam * (logp - ref) - adv), 0), rtol=1e-4,
                             atol=1e-6)
  em = np.where(adv > 0, 0.7, 0.0) - np.where(adv < 0, 0.3, 0.0)
  np.testing.assert_allclose(grad(CONFIGS['em'], logp), -w * em, rtol=1e-5, atol=1e-7)
  # At r = 1 (logp = old) the clip loss's gradient is REINFORCE's (-A w); so is APA's at its
  # anchor, whatever lam; EM with alpha 1/2 is REINFORCE on sign(A) / 2.
  at_old = grad(CONFIGS['clip'], old)
  np.testing.assert_allclose(at_old, -adv * w, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad(CONFIGS['rgra'], old), at_old, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad(CONFIGS['apa_old'], old, anchor=old), at_old, rtol=1e-5,
                             atol=1e-7)
  np.testing.assert_allclose(grad(CONFIGS['apa'], ref), -adv * w, rtol=1e-5, atol=1e-7)
  half = ts.LossConfig(policy_loss='em', em_alpha=0.5, kl_coef=0.1)
  sign_adv = np.sign(adv) / 2
  np.testing.assert_allclose(
      jax.grad(jax_loss, argnums=1)(half, jnp.asarray(logp, jnp.float32), old, ref, adv, mask, w),
      jax.grad(jax_loss, argnums=1)(CONFIGS['rgra'], jnp.asarray(logp, jnp.float32), old, ref,
                                    sign_adv, mask, w), rtol=1e-6, atol=1e-8)


def test_default_surrogate_is_the_clip_formula_bit_for_bit():
  logp, old, ref, adv, mask = tiny_case(2)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  lc = ts.LossConfig()
  pg, ratio, log_ratio = jax.jit(ts.surrogate, static_argnums=0)(
      lc, f32(logp), f32(old), f32(adv), jnp.asarray(mask), f32(ref))

  @jax.jit
  def before(logp, old, adv, mask):  # the clip loss as train_step computed it before #61/#66
    log_ratio = jnp.where(mask, logp - old, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - lc.eps_low, 1.0 + lc.eps_high)
    pg = jnp.maximum(-ratio * adv, -clipped * adv)
    pg = jnp.where(adv < 0, jnp.minimum(pg, -lc.dual_clip * adv), pg)
    return pg, ratio, log_ratio

  for a, b in zip((pg, ratio, log_ratio), before(f32(logp), f32(old), f32(adv), jnp.asarray(mask))):
    np.testing.assert_array_equal(a, b)
  assert lc.policy_loss == 'clip' and not lc.needs_ref


CFG = decoder.PolicyConfig(vocab_size=14, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                           max_len=16)


def test_policy_loss_with_the_model():
  params = decoder.init_params(jax.random.PRNGKey(0), CFG)
  rng = np.random.default_rng(4)
  prompts = jnp.asarray(rng.integers(0, 12, (N, 6)), jnp.int32)
  tokens = jnp.asarray(rng.integers(0, 12, (N, L)), jnp.int32)
  _, _, ref, adv, mask = tiny_case(4)
  names = ('rgra', 'apa', 'em')

  @jax.jit
  def losses(params, batch, w):  # one program: the forward pass is shared
    logp, _ = decoder.token_logprobs(params, CFG, batch.prompts, batch.tokens)
    return logp, [ts.policy_loss(params, CFG, CONFIGS[n], batch, (w, w)) for n in names]

  batch = ts.Batch(prompts=prompts, tokens=tokens, mask=jnp.asarray(mask),
                   advantages=jnp.asarray(adv, jnp.float32),
                   old_logprobs=jnp.asarray(rng.normal(size=(N, L)) - 2.5, jnp.float32),
                   ref_logprobs=jnp.asarray(np.where(mask, ref - 1.0, 0), jnp.float32))
  w = ts.token_weights(batch.mask, 'token-mean')
  logp, out = losses(params, batch, w)
  for name, (loss, aux) in zip(names, out):
    args = (CONFIGS[name], np.asarray(logp, np.float64), np.asarray(batch.old_logprobs),
            np.asarray(batch.ref_logprobs), adv, mask, np.asarray(w))
    assert float(loss) == pytest.approx(loss_ref(*args, kl=True), rel=1e-4, abs=1e-5), name
    assert float(aux['pg_loss']) == pytest.approx(loss_ref(*args), rel=1e-4, abs=1e-5), name
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  with pytest.raises(ValueError, match='ref_logprobs'):
    ts.surrogate(CONFIGS['apa'], logp, batch.old_logprobs, f32(adv), batch.mask, None)
  pg, _, _ = ts.surrogate(CONFIGS['apa_old'], logp, batch.old_logprobs, f32(adv), batch.mask)
  assert np.all(np.isfinite(np.asarray(pg)))


def test_bad_loss_settings_name_the_field():
  for kw, match in [(dict(policy_loss='ppo'), 'policy_loss'), (dict(apa_coef=0.0), 'apa_coef'),
                    (dict(apa_coef=float('nan')), 'apa_coef'),
                    (dict(apa_anchor='init'), 'apa_anchor'),
                    (dict(em_alpha=1.5), 'em_alpha'), (dict(em_alpha=-0.1), 'em_alpha')]:
    with pytest.raises(ValueError, match=match):
      ts.LossConfig(**kw)
  assert ts.LossConfig(policy_loss='apa').needs_ref
  assert not ts.LossConfig(policy_loss='apa', apa_anchor='old').needs_ref
  assert ts.LossConfig(kl_coef=0.1).needs_ref
  assert not ts.LossConfig(policy_loss='em', em_alpha=1.0).needs_ref
  for kw in (dict(), dict(kl_coef=0.1, kl_in_reward=True)):  # no KL in the loss
    with pytest.raises(ValueError, match='em_alpha=0.5 < 1 needs the KL'):
      ts.LossConfig(policy_loss='em', **kw)


def test_the_run_config_carries_the_loss_fields_with_their_defaults():
  from configs import tempo
  c = tempo.get_config()
  assert ts.LossConfig(**dict(c.loss)) == dataclasses.replace(  # = loop.loss_config(c)
      ts.LossConfig(), eps_high=0.28, num_minibatches=2)
  for f in ('policy_loss', 'apa_coef', 'apa_anchor', 'em_alpha'):
    assert c.loss[f] == getattr(ts.LossConfig(), f)


# ----------------------------------------------------------------------------
# The forecasting gradient mask (#143): credit.loss_mask of answer_only.


def answer_ref(mask, ends, k):
  out = np.zeros_like(mask)
  for idx in np.ndindex(mask.shape[:-1]):
    n = int(mask[idx].sum())
    if k:
      out[idx][max(n - k, 0):n] = True
      continue
    start = 0
    for t in range(n - 1):  # the last step starts after the last step end before the end
      if ends[idx][t]:
        start = t + 1
    out[idx][start:n] = True
  return out


@functools.lru_cache(maxsize=None)
def _answer_fns(k):
  est = jax.jit(functools.partial(credit.get('answer_only'), answer_tokens=k))
  mask_fn = jax.jit(lambda r, a: credit.loss_mask('answer_only', r, a, answer_tokens=k))
  return est, mask_fn


@settings(max_examples=20)
@given(groups(batch=(2,), sizes=(1, 4), lengths=(6,)), st.integers(0, 2**31 - 1),
       st.sampled_from([0, 2]))
def test_answer_only_masks_everything_but_the_last_step(g, seed, k):
  tokens, mask, rewards = g
  ends = (np.random.default_rng(seed).random(mask.shape) < 0.35) & mask
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, step_ends=ends)
  est, mask_fn = _answer_fns(k)
  adv = est(r)
  np.testing.assert_array_equal(adv, jax.jit(credit.get('grpo'))(r))
  np.testing.assert_array_equal(mask_fn(r, adv), answer_ref(mask, ends, k))


def test_answer_only_on_a_scratchpad_response():
  # "4+8=12,3+5+1=09,7+9=16,1692<eos>": steps end at each ',' and at EOS; the answer is 1692<eos>.
  text = list('4+8=12,3+5+1=09,7+9=16,1692') + ['<eos>']
  mask = np.ones((1, len(text)), bool)
  ends = np.array([[c in (',', '<eos>') for c in text]])
  r = credit.Rollouts(tokens=np.zeros((1, len(text)), np.int32), mask=mask,
                      rewards=np.ones(1, np.float32), step_ends=ends)
  keep = np.asarray(credit.loss_mask('answer_only', r, credit.get('answer_only')(r)))[0]
  assert [c for c, k in zip(text, keep) if k] == ['1', '6', '9', '2', '<eos>']
  # Combined with a policy loss: reasoning tokens get no gradient.
  adv, rgra = jnp.ones((1, len(text))), ts.LossConfig(policy_loss='rgra')
  loss = lambda lp: jnp.sum(ts.surrogate(rgra, lp, lp, adv, jnp.asarray(keep))[0])
  grads = jax.grad(loss)(jnp.zeros((1, len(text))))
  np.testing.assert_array_equal(np.asarray(grads)[0] != 0, keep)
  with pytest.raises(ValueError, match='step_ends'):
    credit.get('answer_only')(r.replace(step_ends=None))
  with pytest.raises(ValueError, match='step_ends'):
    credit.loss_mask('answer_only', r.replace(step_ends=None), adv)
  with pytest.raises(ValueError, match='answer_tokens'):
    credit.get('answer_only')(r, answer_tokens=-1)
  assert credit.needs('answer_only') == ('step_ends',)
