"""ELPO (#39): the binary-search rollout tree (experiments/rollouts/step_forks.py) against a replay
of its search from its own outputs, and `elpo`'s error-localised credit against a
plain-Python reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import credit
from envs.scratchpad_addition import ScratchpadAddition
from experiments.models import decoder
from experiments.rollouts import step_forks
from experiments.training import loop
from experiments.training.probes import probe_cuts
from groups import groups, grpo_ref

TASK = ScratchpadAddition(num_digits=3)
CFG = decoder.PolicyConfig(vocab_size=TASK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                           d_ff=32, max_len=TASK.prompt_len + TASK.response_len)

# Jitted, one program per shape (op by op they compile a hundred small programs): the
# prompts, the test's own boundaries and the estimators (as the loop's credit pass runs them).
sample = jax.jit(TASK.sample, static_argnums=1)
cuts_of = jax.jit(probe_cuts, static_argnums=2)


@functools.lru_cache(maxsize=None)
def _jitted(name, hp):
  return jax.jit(functools.partial(credit.get(name), **dict(hp)))


def estimate(name, rollouts, **hp):
  return np.asarray(_jitted(name, tuple(sorted(hp.items())))(rollouts))


def test_bisection_steps():
  lo, hi, last = jnp.array([-1, 0, 2]), jnp.array([4, 2, 3]), jnp.array([3, 1, 2])
  mid = step_forks.bisect_mid(lo, hi, last)
  assert list(np.asarray(mid)) == [1, 1, 2]
  new_lo, new_hi = step_forks.bisect_update(lo, hi, mid, jnp.array([True, False, True]))
  assert list(np.asarray(new_lo)) == [1, 0, 2] and list(np.asarray(new_hi)) == [4, 1, 3]


@pytest.fixture(scope='module')
def params():
  return decoder.init_params(jax.random.PRNGKey(0), CFG)


def test_sampler_forks_where_the_search_says_and_copies_the_chain(params):
  b, n, r, c = 3, 3, 3, 2
  prompts, info = sample(jax.random.key(0), b)
  # A success is a response whose first token is even: forks after position 0 inherit it.
  reward_fn = jax.jit(lambda t, m: ((t[..., 0] % 2 == 0) & m[..., 0]).astype(jnp.float32))
  ends_fn = lambda t, m: loop.group_process_rewards(prompts, t, m, info, task=TASK)[1]
  s, (lo, hi) = step_forks.sample_bisect(params, CFG, jax.random.key(1), prompts, n, r, c,
                                     TASK.response_len, reward_fn=reward_fn, ends_fn=ends_fn,
                                     num_steps=TASK.reasoning_steps, eos_id=TASK.eos_id,
                                     pad_id=TASK.pad_id)
  assert s.tokens.shape[1] == step_forks.group_size(n, r, c)
  tokens = np.asarray(s.tokens)
  parent, fork = np.asarray(s.parent), np.asarray(s.fork)
  assert np.all(parent[:, :n] == -1) and np.all(fork[:, :n] == 0)
  cuts, ok = (np.asarray(x) for x in cuts_of(ends_fn(s.tokens[:, :n], s.mask[:, :n]),
                                            s.mask[:, :n], TASK.reasoning_steps))
  rewards = np.asarray(reward_fn(s.tokens, s.mask))
  # The case exercises the search: chains with several boundaries, probes won and lost.
  assert (ok.sum(-1) > 2).any()
  assert (np.asarray(lo) >= 0).any() and (np.asarray(hi) < ok.sum(-1)).any()
  for i in range(b):
    for k in range(n):
      last = int(ok[i, k].sum()) - 1
      a, z = -1, last + 1  # the search, replayed from the outputs
      for rr in range(r):
        mid = min(max((a + z) // 2, 0), last)
        rows = [n + (rr * n + k) * c + j for j in range(c)]
        for row in rows:
          assert parent[i, row] == k and fork[i, row] == cuts[i, k, mid]
          p = fork[i, row]
          np.testing.assert_array_equal(tokens[i, row, :p], tokens[i, k, :p])
        won = any(rewards[i, row] >= 1.0 for row in rows)
        a, z = (mid, z) if won else (a, mid)
      assert (lo[i, k], hi[i, k]) == (a, z)
  # A tree the estimators read: the loop's tree from parent pointers builds without error.
  credit.validate(credit.Rollouts(tokens=s.tokens, mask=s.mask, rewards=jnp.asarray(rewards)))


def ref_elpo(tokens, mask, rewards):
  a = grpo_ref(rewards)
  out = np.zeros(mask.shape)
  for idx in np.ndindex(rewards.shape):
    grp = idx[:-1]
    n = int(mask[idx].sum())
    for t in range(n):
      pre = tuple(tokens[idx][:t + 1])
      won = any(rewards[grp + (j,)] >= 1.0 and mask[grp + (j,)][:t + 1].all()
                and tuple(tokens[grp + (j,)][:t + 1]) == pre
                for j in range(rewards.shape[-1]))
      out[idx][t] = 0.0 if (a[idx] < 0 and won) else a[idx]
  return out


@settings(max_examples=15, deadline=None)
@given(groups(sizes=(1, 3, 6), lengths=(5,), batch=(2,)))
def test_elpo_matches_reference(group):
  tokens, mask, rewards = group
  rewards = (rewards > 0.5).astype(np.float32)  # successes and failures
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards)
  np.testing.assert_allclose(estimate('elpo', r), ref_elpo(tokens, mask, rewards), atol=1e-5)


def test_elpo_without_shared_prefixes_is_grpo():
  tokens = np.arange(12, dtype=np.int32).reshape(1, 4, 3)  # every first token differs
  mask = np.ones((1, 4, 3), bool)
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=np.array([[1.0, 0.0, 0.0, 1.0]]))
  np.testing.assert_allclose(estimate('elpo', r), estimate('grpo', r), atol=1e-6)


def test_step_tree_forks_every_response_at_its_next_boundary(params):
  # The bisection test's B, N and C: its chains' and first forks' decode programs serve here.
  b, n, levels, c = 3, 3, 2, 2
  prompts, info = sample(jax.random.key(0), b)
  ends_fn = lambda t, m: loop.group_process_rewards(prompts, t, m, info, task=TASK)[1]
  s = step_forks.sample_step_tree(params, CFG, jax.random.key(3), prompts, n, levels, c,
                                  TASK.response_len, ends_fn=ends_fn,
                                  num_steps=TASK.reasoning_steps, eos_id=TASK.eos_id,
                                  pad_id=TASK.pad_id)
  g = step_forks.step_tree_size(n, levels, c)
  assert s.tokens.shape[1] == g == n * (1 + c) ** levels
  tokens, parent, fork = np.asarray(s.tokens), np.asarray(s.parent), np.asarray(s.fork)
  cuts, ok = (np.asarray(x) for x in cuts_of(ends_fn(s.tokens, s.mask), s.mask,
                                            TASK.reasoning_steps))
  size = n
  for level in range(1, levels + 1):  # rows [size, size (1 + c)) fork rows [0, size)
    for i in range(b):
      for src in range(size):
        for j in range(c):
          row = size + src * c + j
          assert parent[i, row] == src
          want = cuts[i, src, level] if ok[i, src, level] else 0
          assert fork[i, row] == want
          np.testing.assert_array_equal(tokens[i, row, :want], tokens[i, src, :want])
    size *= 1 + c
  assert (fork > 0).any()  # some responses had a boundary to fork at
  # The tree the loop builds from these pointers is consistent with the tokens.
  import trees
  trees.from_forks(s.tokens, s.mask, s.parent, s.fork)
  with pytest.raises(ValueError, match='num_levels'):
    step_forks.sample_step_tree(params, CFG, jax.random.key(3), prompts, n, 4, c,
                                TASK.response_len, ends_fn=ends_fn, num_steps=3)


def test_treeps_is_step_level_mc_values():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 2, (2, 4, 6)).astype(np.int32)
  mask = np.arange(6) < rng.integers(1, 7, (2, 4))[..., None]
  ends = (rng.random((2, 4, 6)) < 0.4) & mask
  rewards = rng.integers(0, 2, (2, 4)).astype(np.float32)
  r = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, step_ends=ends)
  np.testing.assert_allclose(estimate('treeps', r), estimate(
      'mc_values', r, granularity='step', scale_by_std=True), atol=1e-6)
