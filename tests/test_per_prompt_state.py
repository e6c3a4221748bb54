"""Per-prompt history (issue 40, item 5): with prompts that recur (a fixed pool,
`Rollouts.prompt_ids`), AAPO's reference reward and outcome exploration's answer counts are
kept per prompt; checked over several steps against plain-Python references that keep the
history in dicts. Without a pool, both keep today's behaviour."""

import functools

import jax
import numpy as np
import pytest

import credit
from credit.confidence import _outcome_bucket

P, B, G, L = 5, 3, 4, 4


def batches(seed, steps=4, vocab=2):
  """Random steps: B distinct pool prompts each, G responses of lengths 1..L over a small
  vocabulary (outcomes repeat), rewards in [0, 1]."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    ids = rng.choice(P, B, replace=False).astype(np.int32)
    tokens = rng.integers(0, vocab, (B, G, L)).astype(np.int32)
    mask = np.arange(L) < rng.integers(1, L + 1, (B, G, 1))
    yield ids, tokens, mask, rng.random((B, G)).astype(np.float32)


@jax.jit
def _grpo(tokens, mask, rewards):
  return credit.get("grpo")(credit.Rollouts(tokens, mask, rewards))


def grpo(tokens, mask, rewards):
  return np.asarray(_grpo(tokens, mask, rewards))


def _advantages_and_state(name, tokens, mask, rewards, ids, state, **hp):
  r = credit.Rollouts(tokens, mask, rewards, credit_state=state, prompt_ids=ids)
  return credit.get(name)(r, **hp), credit.update_state(name, state, r, **hp)


@functools.lru_cache
def _jitted(name, hp):
  return jax.jit(functools.partial(_advantages_and_state, name, **dict(hp)))


def run(name, tokens, mask, rewards, ids, state, eager=False, **hp):
  """(advantages, the state after the batch); jitted (one compile per estimator and
  hyperparameters: every batch has one shape) unless `eager` (the checks of concrete ids)."""
  f = (functools.partial(_advantages_and_state, name, **hp) if eager
       else _jitted(name, tuple(sorted(hp.items()))))
  adv, state = f(tokens, mask, rewards, ids, state)
  return np.asarray(adv), state


@pytest.mark.parametrize("seed", [0, 1])
def test_aapo_reference_is_each_prompts_own_reward_history(seed):
  hp = dict(coef=0.7, clip_low=0.2, clip_high=0.28, momentum=0.3)
  state = credit.init_state("aapo_history", prompts=P, **hp)
  assert state["reference"].shape == (P,)
  ref, visits = {}, {}  # the reference: prompt id -> EMA of its earlier group means
  for ids, tokens, mask, rewards in batches(seed):
    adv, state = run("aapo_history", tokens, mask, rewards, ids, state, **hp)
    for b, p in enumerate(ids):
      base = ref[p] if visits.get(p) else rewards[b].mean()  # a first visit: its own mean
      want = grpo(tokens, mask, rewards)[b] + hp["coef"] * np.clip(
          rewards[b] - base, -hp["clip_low"], hp["clip_high"])[:, None] * mask[b]
      np.testing.assert_allclose(adv[b], want, atol=1e-6, err_msg=f"prompt {p}")
    for b, p in enumerate(ids):
      y = rewards[b].mean()
      ref[p] = y if not visits.get(p) else (1 - hp["momentum"]) * ref[p] + hp["momentum"] * y
      visits[p] = visits.get(p, 0) + 1
  for p in range(P):  # prompts never drawn keep the initial state
    assert int(state["count"][p]) == visits.get(p, 0)
    if visits.get(p):
      assert float(state["reference"][p]) == pytest.approx(ref[p], abs=1e-6)


def test_aapo_pools_a_prompt_drawn_twice_in_one_batch():
  tokens, mask = np.zeros((2, 2, 1), np.int32), np.ones((2, 2, 1), bool)
  rewards = np.array([[1.0, 1.0], [0.0, 0.0]], np.float32)
  state = credit.init_state("aapo_history", prompts=3)
  _, state = run("aapo_history", tokens, mask, rewards, np.array([2, 2], np.int32), state)
  assert state["count"].tolist() == [0, 0, 1] and float(state["reference"][2]) == 0.5


def outcome(tokens, mask, answer_tokens):
  toks = tuple(int(t) for t in tokens[mask])
  return toks if answer_tokens is None else toks[-answer_tokens:]


@pytest.mark.parametrize("seed, answer_tokens", [(0, None), (1, 2)])
def test_outcome_explore_historical_bonus_counts_each_prompts_outcomes(seed, answer_tokens):
  hp = dict(coef=0.2, ucb_coef=0.5, buckets=4096, answer_tokens=answer_tokens)
  state = credit.init_state("outcome_explore", prompts=P, **hp)
  assert state["outcome_counts"].shape == (P, 4096)
  seen = {}  # the reference: (prompt id, outcome) -> times produced at earlier steps
  buckets = {}
  for ids, tokens, mask, rewards in batches(seed, steps=5):
    b = np.asarray(_outcome_bucket(tokens, mask, answer_tokens, 4096))
    shaped = rewards.copy()
    for i, p in enumerate(ids):
      outs = [outcome(tokens[i, j], mask[i, j], answer_tokens) for j in range(G)]
      for j, o in enumerate(outs):  # an outcome keeps its counter (checked distinct below)
        assert buckets.setdefault((p, o), b[i, j]) == b[i, j]
        n = outs.count(o)
        shaped[i, j] += -hp["coef"] * (n - 1) / (G - 1) + hp["ucb_coef"] / np.sqrt(
            1 + seen.get((p, o), 0))
    adv, state = run("outcome_explore", tokens, mask, rewards, ids, state, **hp)
    np.testing.assert_allclose(adv, grpo(tokens, mask, shaped), atol=1e-5)
    for i, p in enumerate(ids):
      for j in range(G):
        o = outcome(tokens[i, j], mask[i, j], answer_tokens)
        seen[(p, o)] = seen.get((p, o), 0) + 1
  for p in range(P):  # within a prompt, distinct outcomes had distinct counters
    mine = [c for (q, _), c in buckets.items() if q == p]
    assert len(set(mine)) == len(mine)
  assert max(seen.values()) > 1  # outcomes recurred across steps: the bonus varied
  assert float(state["outcome_counts"].sum()) == sum(seen.values())


def test_without_a_pool_the_state_is_global_or_none_and_both_zero_coefficients_give_grpo():
  ids, tokens, mask, rewards = next(batches(3))
  assert credit.init_state("outcome_explore") is None  # fresh prompts: no history
  state = credit.init_state("outcome_explore", prompts=P)
  adv, _ = run("outcome_explore", tokens, mask, rewards, ids, state, coef=0.0, ucb_coef=0.0)
  np.testing.assert_allclose(adv, grpo(tokens, mask, rewards), atol=1e-6)
  assert credit.init_state("aapo_history")["reference"].shape == ()
  assert credit.per_prompt("aapo_history") and credit.per_prompt("outcome_explore")
  for name in ("hadw", "gepo", "capo", "a_grae", "stare", "grpo"):  # histories of the policy
    assert not credit.per_prompt(name)
  assert credit.init_state("hadw", prompts=P)["anchor"].shape == ()  # prompts ignored


def test_bad_prompt_ids_are_refused_with_the_reason():
  ids, tokens, mask, rewards = next(batches(4))
  for name in ("aapo_history", "outcome_explore"):
    state = credit.init_state(name, prompts=P)
    with pytest.raises(ValueError, match="needs Rollouts.prompt_ids"):
      run(name, tokens, mask, rewards, None, state, eager=True)
    with pytest.raises(ValueError, match=r"must lie in \[0, 5\)"):
      run(name, tokens, mask, rewards, ids + P, state, eager=True)
    with pytest.raises(ValueError, match="one per group"):
      run(name, tokens, mask, rewards, ids[:2], state, eager=True)
  with pytest.raises(ValueError, match="prompts must be a non-negative integer"):
    credit.init_state("aapo_history", prompts=-1)


def test_validate_names_malformed_prompt_ids():
  ids, tokens, mask, rewards = next(batches(6))
  credit.validate(credit.Rollouts(tokens, mask, rewards, prompt_ids=ids))
  for bad, match in ((ids[:2], "one per group"), (ids.astype(np.float32), "must be integers"),
                     (ids - 10, "pool indices >= 0")):
    with pytest.raises(ValueError, match=match):
      credit.validate(credit.Rollouts(tokens, mask, rewards, prompt_ids=bad))
