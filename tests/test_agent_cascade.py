"""The agent sampler's 'cascade' KV-cache layout (issue 41) against its 'rows' layout.

'cascade' prefills each group's first observation once into the prefixes of a
`decoder.CascadeCache` and keeps the rows' actions and later observations in their own
slots; 'rows' (the default, unchanged) runs the first observation in every row's cache.
With the same key both give identical tokens, masks, rewards, done flags, state ids and
tree fields, and log-probs within ATOL = 1e-5 (float32: the cascade merges two softmax
parts, so logits differ by rounding; about 1e-6 observed), for a multi-head and a
grouped-query policy, sampled (temperature 1) and greedy (temperature 0), i.i.d. and forked
at a turn > 0. A float tie could flip an inverse-CDF draw; with this key and these sizes
none does.
"""

import inspect

import jax
import numpy as np
import pytest

from experiments.models import decoder
from experiments.rollouts import agent_sampling as ags
from test_agent_sampling import KEY, MDP, tiny_policy  # noqa: E402 (tests/ is on sys.path)

ATOL = 1e-5  # log-probs (scale ~1), float32
# The shapes of test_agent_sampling's i.i.d. fixture and fork test, so that a suite run's
# persistent compilation cache shares their 'rows' programs.
B, G = 4, 8
N, C, FORK_TURN = 2, 4, 1  # G = N C; fork after the first of the MDP's 4 turns
EXACT = ("tokens", "policy_mask", "obs_mask", "span_mask", "token_turn", "turn_mask",
         "turn_rewards", "done", "state_ids", "success", "parent", "fork_turn")
IDS = (range(MDP.num_states), range(MDP.num_states, MDP.num_states + MDP.num_actions))


@pytest.fixture(scope="module")
def mha():
  return tiny_policy(MDP, *IDS)


@pytest.fixture(scope="module")
def gqa():  # 2 layers, 4 query heads over 2 kv heads
  return tiny_policy(MDP, *IDS, seed=1, num_layers=2, num_heads=4, num_kv_heads=2)


def check_same(got, want):
  """Episodes equal but for float rounding of the log-probs; returns the max |difference|."""
  for name in EXACT:
    np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                  np.asarray(getattr(want, name)), err_msg=name)
  diff = np.abs(np.asarray(got.logprobs) - np.asarray(want.logprobs))
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)
  assert np.all(np.asarray(got.logprobs)[~np.asarray(got.policy_mask)] == 0.0)
  return float(diff.max())


def check_varied(ep):
  """The comparison is not vacuous: episodes of different lengths, distinct trajectories."""
  lengths = np.asarray(ep.lengths)
  assert (lengths < MDP.max_turns).any() and (lengths > 1).any()
  assert len(np.unique(np.asarray(ep.tokens).reshape(-1, ep.tokens.shape[-1]), axis=0)) > B


# GQA here is slow-marked: the cascade attention's GQA path is tested in the suite by
# test_cascade_decode (the token samplers); this file's suite share is the agent sampler's own.
@pytest.mark.parametrize("policy", ["mha", pytest.param("gqa", marks=pytest.mark.slow)])
def test_sample_episodes_cascade_equals_rows(policy, request):
  params, pcfg = request.getfixturevalue(policy)
  rows = ags.sample_episodes(params, pcfg, MDP, KEY, B, G, temperature=1.0, layout="rows")
  cascade = ags.sample_episodes(params, pcfg, MDP, KEY, B, G, temperature=1.0, layout="cascade")
  check_varied(rows)
  print(f"{policy} sampled: max |logprob diff| = {check_same(cascade, rows):.2e}")
  size = ags.sample_episodes._cache_size()
  rows = ags.sample_episodes(params, pcfg, MDP, KEY, B, G, temperature=0.0, layout="rows")
  cascade = ags.sample_episodes(params, pcfg, MDP, KEY, B, G, temperature=0.0, layout="cascade")
  assert ags.sample_episodes._cache_size() == size  # temperature is traced in both layouts
  # Greedy: every trajectory of a group is the same.
  assert np.all(np.asarray(rows.tokens) == np.asarray(rows.tokens)[:, :1])
  print(f"{policy} greedy: max |logprob diff| = {check_same(cascade, rows):.2e}")


def test_fork_episodes_cascade_equals_rows(mha):
  params, pcfg = mha
  rows = ags.fork_episodes(params, pcfg, MDP, KEY, B, N, C, FORK_TURN, layout="rows")
  cascade = ags.fork_episodes(params, pcfg, MDP, KEY, B, N, C, FORK_TURN, layout="cascade")
  check_varied(rows)
  # Forks sample their own continuations after the fork turn (some of the C differ).
  cut = MDP.obs_len + FORK_TURN * (MDP.action_len + MDP.obs_len)
  tail = np.asarray(rows.tokens)[:, :, cut:].reshape(B, N, C, -1)
  assert np.any(tail != tail[:, :, :1])
  assert np.all(np.asarray(rows.fork_turn)[:, 1] == FORK_TURN)
  print(f"fork: max |logprob diff| = {check_same(cascade, rows):.2e}")


def test_cascade_cache_holds_obs0_once_per_group(mha):
  params, pcfg = mha
  o, t = MDP.obs_len, ags.sequence_length(MDP)
  start = lambda layout: lambda p: ags._start(MDP, pcfg, KEY, B, G, layout=layout, params=p)[0]
  cache = jax.eval_shape(start("cascade"), params)[1]
  assert isinstance(cache, decoder.CascadeCache) and cache.window is None
  own = (pcfg.num_layers, B * G, t - o, pcfg.kv_heads, pcfg.head_dim)
  assert cache.prefix_k.shape == cache.prefix_v.shape == (pcfg.num_layers, B, o, pcfg.kv_heads,
                                                          pcfg.head_dim)
  assert cache.k.shape == cache.v.shape == own
  rows_cache = jax.eval_shape(start("rows"), params)[1]
  assert rows_cache.k.shape == (pcfg.num_layers, B * G, pcfg.max_len, pcfg.kv_heads,
                                pcfg.head_dim)
  # The prefixes are obs0's keys and values (group b's at b), the own slots still empty,
  # and the carried logits the prefill's last position's, repeated to each group's rows.

  @jax.jit
  def run(params):
    (_, cache, logits), obs0, _ = ags._start(MDP, pcfg, KEY, B, G, layout="cascade",
                                             params=params)
    return cache, logits, decoder.prefill(params, pcfg, obs0[::G])

  cache, logits, (want_logits, want) = run(params)
  np.testing.assert_allclose(cache.prefix_k, want.k[:, :, :o], atol=1e-6, rtol=0)
  np.testing.assert_allclose(cache.prefix_v, want.v[:, :, :o], atol=1e-6, rtol=0)
  assert np.abs(np.asarray(cache.prefix_k)).max() > 0.1
  assert not np.asarray(cache.k).any() and not np.asarray(cache.v).any()
  np.testing.assert_allclose(logits, np.repeat(want_logits[:, -1], G, axis=0), atol=1e-5,
                             rtol=0)


def test_unknown_layout_raises(mha):
  params, pcfg = mha
  for call in (lambda: ags.sample_episodes(params, pcfg, MDP, KEY, 1, 1, layout="paged"),
               lambda: ags.fork_episodes(params, pcfg, MDP, KEY, 1, 1, 2, 1, layout="paged")):
    with pytest.raises(ValueError, match=r"\('rows', 'cascade'\).*'paged'"):
      call()
  assert ags.LAYOUTS == ("rows", "cascade")


def test_default_layout_is_cascade():
  for sampler in (ags.sample_episodes, ags.fork_episodes):
    assert inspect.signature(sampler).parameters["layout"].default == "cascade"
