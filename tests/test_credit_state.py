"""The loop's side of the reweighting estimators: a stateful estimator's state is carried,
logged, checkpointed and restored exactly (interrupted runs give the uninterrupted rows),
and the optional Rollouts inputs (entropy, prompt / changed-context log-probs, saliency)
reach an estimator that needs them, equal to direct computations, and only then."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import credit
from credit import registry
from credit.outcome import grpo
from experiments.training import forward, loop, samplers
from experiments.training import saliency as saliency_lib
from tests.test_resume import Crash, init_params, strip, tiny_cfg

STATEFUL, PROBE, VISITS = "_test_ema_grpo", "_test_fields_probe", "_test_visits_grpo"
REF_PROBE = "_test_ref_rewards_probe"
DECAY = 0.5
OPTIONAL = ("entropy", "prompt_logprobs", "context_logprobs", "saliency", "hidden_states")
CAPTURED, VISITED, REF_SEEN = [], [], []


def ema_init():
  return {"ema": jnp.float32(0.0), "count": jnp.int32(0)}


def ema_update(state, rollouts):
  mean = jnp.mean(jnp.asarray(rollouts.rewards, jnp.float32))
  return {"ema": DECAY * state["ema"] + (1 - DECAY) * mean, "count": state["count"] + 1}


def ema_grpo(rollouts):
  """GRPO scaled by 1 + an EMA of the batch mean reward (the state before this batch)."""
  if rollouts.credit_state is None:
    raise ValueError("needs rollouts.credit_state")
  for field in OPTIONAL:  # not needed: the loop computes nothing (trace-time check)
    if getattr(rollouts, field) is not None:
      raise ValueError(f"{field} was computed although not needed")
  return grpo(rollouts) * (1.0 + rollouts.credit_state["ema"])


def fields_probe(rollouts):
  """GRPO; records the optional inputs it needs (host callback) after checking them."""
  for field in OPTIONAL:
    if getattr(rollouts, field) is None:
      raise ValueError(f"{field} missing")
  jax.debug.callback(lambda *a: CAPTURED.append(a), rollouts.tokens, rollouts.mask,
                     *(getattr(rollouts, f) for f in OPTIONAL))
  return grpo(rollouts)


def visits_init(prompts=0):
  return {"visits": jnp.zeros((prompts,), jnp.int32)}


def visits_update(state, rollouts):
  return {"visits": state["visits"].at[rollouts.prompt_ids].add(1)}


def visits_grpo(rollouts):
  """GRPO; records the batch's pool ids and the per-prompt state it got (host callback)."""
  jax.debug.callback(lambda *a: VISITED.append(tuple(map(np.asarray, a))), rollouts.prompt_ids,
                     rollouts.credit_state["visits"])
  return grpo(rollouts)


def ref_rewards_probe(rollouts):
  """GRPO; records the reference rewards the loop passes (host callback)."""
  jax.debug.callback(lambda r: REF_SEEN.append(np.asarray(r)), rollouts.ref_rewards)
  return grpo(rollouts)


@pytest.fixture(scope="module", autouse=True)
def toy_estimators():
  registry.register(STATEFUL, state=(ema_init, ema_update))(ema_grpo)
  registry.register(PROBE, needs=OPTIONAL)(fields_probe)
  registry.register(VISITS, state=(visits_init, visits_update))(visits_grpo)
  registry.register(REF_PROBE, needs=("ref_rewards",))(ref_rewards_probe)
  yield
  for name in (STATEFUL, PROBE, VISITS, REF_PROBE):
    registry.unregister(name)


def rows_of(workdir):
  return loop.read_metrics(workdir / "metrics.jsonl")


def train(cfg, workdir):
  return loop.train(cfg, str(workdir), init_params(cfg), method=f"{STATEFUL}:iid")


def test_stateful_estimator_resumes_exactly_and_state_matches_recomputation(tmp_path,
                                                                            monkeypatch):
  assert credit.stateful(STATEFUL) and not credit.stateful("grpo")
  cfg = tiny_cfg(4)
  straight = train(cfg, tmp_path / "a")
  want = rows_of(tmp_path / "a")

  # The state after each step, recomputed in plain Python from the logged batch rewards.
  ema = 0.0
  for row in want[1:]:
    ema = DECAY * ema + (1 - DECAY) * row["reward"]
    assert row["credit_state/ema"] == pytest.approx(ema, rel=1e-6, abs=1e-7)
    assert row["credit_state/count"] == row["step"]
  assert ema > 0  # the state moved, so the advantages depended on it

  # Ctrl-C while sampling step 3 (no periodic checkpoint): the interrupt saves step 2 with
  # its credit state; the rerun finishes exactly like the uninterrupted run.
  c = cfg.copy_and_resolve_references()
  c.rl.ckpt_every = 100
  real_sample = loop.sample

  def failing_at(n, error):
    """loop.sample that raises `error` on its n-th call."""
    calls = {"n": 0}

    def sample(*a, **k):
      calls["n"] += 1
      if calls["n"] == n:
        raise error
      return real_sample(*a, **k)

    return sample

  monkeypatch.setattr(samplers, "sample", failing_at(3, KeyboardInterrupt))
  with pytest.raises(KeyboardInterrupt):
    train(c, tmp_path / "b")
  monkeypatch.setattr(samplers, "sample", real_sample)
  assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["2"]
  again = train(c, tmp_path / "b")
  assert strip(rows_of(tmp_path / "b")) == strip(want)

  # A crash (kill -9) during step 4: resumes from the checkpoint of step 3 (every step's).
  monkeypatch.setattr(samplers, "sample", failing_at(4, Crash))
  with pytest.raises(Crash):
    train(cfg, tmp_path / "c")
  monkeypatch.setattr(samplers, "sample", real_sample)
  resumed = train(cfg, tmp_path / "c")
  assert strip(rows_of(tmp_path / "c")) == strip(want)
  for out in (again, resumed):
    for x, y in zip(jax.tree.leaves(straight["params"]), jax.tree.leaves(out["params"])):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_optional_inputs_reach_the_estimator_equal_to_direct_computations(tmp_path):
  cfg = tiny_cfg(1)  # test_resume's (both tests share its programs): 1-token prompts
  p0 = init_params(cfg)
  CAPTURED.clear()
  loop.train(cfg, str(tmp_path / "probe"), p0, method=f"{PROBE}:iid")
  assert len(CAPTURED) == 1
  tokens, mask, entropy, prompt_lp, ctx_lp, sal, hidden = (np.asarray(x) for x in CAPTURED[0])
  # Step 0's prompts (the loop's key schedule) and the policy before the update.
  problem = loop.JaxProblem(cfg)
  key = jax.random.fold_in(jax.random.PRNGKey(cfg.rl.seed), 0)
  prompts = problem.draw(jax.random.fold_in(key, 0), 0, cfg.rl.prompts_per_step).prompts
  pcfg = problem.pcfg
  tok, m = jnp.asarray(tokens), jnp.asarray(mask)
  _, ent = loop.rows_logprobs(p0, prompts, tok, m, cfg=pcfg, with_entropy=True)
  np.testing.assert_allclose(entropy, np.asarray(ent), atol=1e-5)  # the sampler's
  assert np.all(entropy[mask] > 0) and np.all(entropy[~mask] == 0)
  np.testing.assert_allclose(prompt_lp, np.asarray(loop.prompt_logprobs(p0, prompts, cfg=pcfg)),
                             atol=1e-6)
  rolled = jnp.roll(prompts, -1, axis=0)  # the next group's prompt
  np.testing.assert_allclose(ctx_lp, np.asarray(loop.rows_logprobs(p0, rolled, tok, m,
                                                                   cfg=pcfg)), atol=1e-6)
  np.testing.assert_allclose(hidden, np.asarray(forward.rows_hidden(p0, prompts, tok, m, cfg=pcfg)),
                             atol=1e-6)
  assert hidden.shape[-1] == pcfg.d_model and np.all(hidden[~mask] == 0)
  assert np.any(np.asarray(prompts) != np.asarray(rolled))  # (non-trivial prompt log-
  # probs: tests/test_context_shift.py)
  np.testing.assert_allclose(sal, np.asarray(saliency_lib.token_saliency(
      p0, prompts, tok, m, cfg=pcfg)), rtol=1e-4, atol=1e-6)


def test_a_per_prompt_state_is_made_for_the_pool_and_reads_each_groups_pool_index(tmp_path):
  """With rl.prompt_pool, an estimator whose state `init` takes `prompts` gets a state for
  the pool and `Rollouts.prompt_ids`: the per-prompt visit counts it carries equal the
  counts of the pool indices of the earlier steps."""
  assert credit.per_prompt(VISITS) and not credit.per_prompt(STATEFUL)
  cfg = tiny_cfg(3)
  cfg.rl.prompt_pool = 24
  VISITED.clear()
  loop.train(cfg, str(tmp_path), init_params(cfg), method=f"{VISITS}:iid")
  assert len(VISITED) == 3
  counts = np.zeros(24, np.int64)
  for ids, visits in VISITED:
    assert ids.shape == (16,) and len(set(ids.tolist())) == 16 and ids.max() < 24
    np.testing.assert_array_equal(visits, counts)
    np.add.at(counts, ids, 1)
  assert counts.max() > 1  # prompts recurred (24 in the pool, 16 a step)



def test_ref_rewards_are_one_reference_sample_per_prompt_and_its_tokens_count(tmp_path):
  """AAPO's baseline (#48): the ReferenceSamples pass samples one response per prompt from
  the frozen reference params with key fold_in(step key, 2) and scores it; the estimator
  gets exactly those rewards, and the step's generated tokens include the sample's."""
  from experiments.rollouts import sampling
  cfg = tiny_cfg(1)  # test_resume's (shared programs)
  params0 = init_params(cfg)
  REF_SEEN.clear()
  loop.train(cfg, str(tmp_path), params0, method=f"{REF_PROBE}:iid")
  assert len(REF_SEEN) == 1
  problem = loop.build_problem(cfg)
  rows = [r for r in loop.read_metrics(str(tmp_path / "metrics.jsonl")) if r["step"] > 0]
  for i, (seen, row) in enumerate(zip(REF_SEEN, rows)):
    k = jax.random.fold_in(jax.random.PRNGKey(cfg.rl.seed), i)
    draw = problem.draw(jax.random.fold_in(k, 0), i, 16)
    ref = sampling.sample_iid(params0, problem.pcfg, jax.random.fold_in(k, 2), draw.prompts, 1,
                              problem.response_len, eos_id=problem.eos_id,
                              pad_id=problem.pad_id, prompt_ids=draw.prompt_ids)
    np.testing.assert_array_equal(seen, np.asarray(problem.rewards(draw, ref)[0])[:, 0])
    assert row["ref_sample_tokens"] == float(np.sum(ref.mask)) > 0
    assert row["generated_tokens"] == pytest.approx(
        row["response_len"] * 16 * 8 + row["ref_sample_tokens"])
  from configs import agents
  with pytest.raises(ValueError, match="reference policy samples"):
    loop.check_config(loop.with_method(agents.get_config(), "aapo:iid"))
