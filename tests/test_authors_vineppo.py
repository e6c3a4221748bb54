"""`mc_values` against a plain-Python transcription of VinePPO's released code.

Read (not copied, not run): github McGill-NLP/VinePPO at commit
efe7228469f21bad8cc8d4e44a3f688ed8cc6aac (2024-11-10),
`src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py`:
`_create_value_estimation_requests` (a value request at the query and after every step but the
last, up to `max_step_for_value_estimation`), `_compute_mc_value` (the mean reward of the K
rollouts sampled from that prefix, 0 if none), `_compute_step_advantages` (values[K] = 0, missing
trailing values filled backwards as r_k + V_{k+1}, a_k = r_k + V_{k+1} − V_k with the outcome as
the last step's reward) and `_compute_token_advantages` (a token gets the advantage of the step
holding its first character; EOS copies the last token's). `ppo_trainer.py` then whitens the
precomputed advantages over the batch (`whiten_advantages=True`, Bessel variance, eps inside the
root): the trainer's, not the estimator's.

The project takes the MC values from the group's own responses through a prefix (a tree
sampler's forks), the trajectory's own outcome included; the authors sample K separate rollouts
that are not trained. The transcription takes the rollouts' rewards at each prefix as an
argument, so the test can give it either set.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import credit

G, L = 5, 6  # one shape for every example (eager JAX compiles per shape)
EOS = 9


def mc_value(rewards):
  """`_compute_mc_value`: the mean of the rollouts' rewards, 0 when there are none."""
  return sum(rewards) / len(rewards) if rewards else 0.0


def step_advantages(step_rewards, values):
  """`_compute_step_advantages`: values has one entry per state (K + 1), None where no value
  was estimated; the terminal one is 0, trailing missing ones are filled backwards."""
  values = list(values)
  values[-1] = 0.0
  for i in range(len(values) - 2, -1, -1):
    if values[i] is not None:
      break
    values[i] = step_rewards[i] + values[i + 1]
  return [step_rewards[i] + values[i + 1] - values[i] for i in range(len(step_rewards))]


def vineppo_authors(bounds, reward, rollouts_at, max_steps=None):
  """One trajectory's token advantages. `bounds` = [0, b_1, ..., b_K]: its K steps end after
  tokens b_1 < ... < b_K (the response's length); `rollouts_at(b)` gives the rewards of the MC
  rollouts sampled after its first b tokens. Values are requested at the query and after steps
  1..K−1, only up to `max_steps` steps (`max_step_for_value_estimation`)."""
  k = len(bounds) - 1
  last = k - 2 if max_steps is None else min(k - 2, max_steps - 1)
  values = [mc_value(rollouts_at(0))] + [None] * k
  for step in range(last + 1):
    values[step + 1] = mc_value(rollouts_at(bounds[step + 1]))
  adv = step_advantages([0.0] * (k - 1) + [reward], values)
  out = []
  for s in range(k):
    out += [adv[s]] * (bounds[s + 1] - bounds[s])
  return out


def through(tokens, lengths, rewards, i, b, own=True):
  """The rewards of the responses that share response i's first b tokens (a prefix's MC
  rollouts as the project reads them); `own=False` leaves response i out."""
  return [float(rewards[j]) for j in range(len(rewards))
          if lengths[j] >= b and list(tokens[j][:b]) == list(tokens[i][:b]) and (own or j != i)]


def bounds_of(step_ends, length):
  ends = [t + 1 for t in range(length - 1) if step_ends[t]]
  return [0] + ends + [length]


def project(tokens, lengths, rewards, step_ends=None, **hparams):
  mask = np.arange(L)[None] < np.asarray(lengths)[:, None]
  r = credit.Rollouts(tokens=np.asarray(tokens, np.int32), mask=mask,
                      rewards=np.asarray(rewards, np.float32),
                      step_ends=None if step_ends is None else np.asarray(step_ends, bool) & mask)
  return np.asarray(credit.get('mc_values')(r, **hparams)), mask


@st.composite
def groups(draw):
  """G responses over tokens {1, 2} ending in EOS (so none is a strict prefix of another);
  rewards a function of the tokens (equal responses, equal rewards); random step ends."""
  lengths = [draw(st.integers(2, L)) for _ in range(G)]
  tokens = np.zeros((G, L), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, :n - 1] = [draw(st.integers(1, 2)) for _ in range(n - 1)]
    tokens[i, n - 1] = EOS
  table = {}
  rewards = []
  for i, n in enumerate(lengths):
    key = tuple(tokens[i, :n])
    if key not in table:
      table[key] = draw(st.integers(-4, 4)) / 4
    rewards.append(table[key])
  ends = np.array([[draw(st.booleans()) for _ in range(L)] for _ in range(G)])
  return tokens, lengths, rewards, ends


@settings(max_examples=25, deadline=None)
@given(groups())
def test_step_credit_is_the_authors_with_the_groups_responses_as_rollouts(group):
  tokens, lengths, rewards, ends = group
  got, mask = project(tokens, lengths, rewards, ends, granularity='step')
  for i in range(G):
    want = vineppo_authors(bounds_of(ends[i], lengths[i]), rewards[i],
                           lambda b: through(tokens, lengths, rewards, i, b))
    np.testing.assert_allclose(got[i, :lengths[i]], want, atol=1e-6)
  assert np.all(got[~mask] == 0)


@settings(max_examples=25, deadline=None)
@given(groups())
def test_token_credit_is_the_authors_with_one_token_steps(group):
  tokens, lengths, rewards, _ = group
  got, _ = project(tokens, lengths, rewards)
  for i in range(G):
    want = vineppo_authors(list(range(lengths[i] + 1)), rewards[i],
                           lambda b: through(tokens, lengths, rewards, i, b))
    np.testing.assert_allclose(got[i, :lengths[i]], want, atol=1e-6)


def test_difference_the_trajectorys_own_outcome_is_one_of_its_mc_samples():
  """Three responses share their first step (rewards 1, 0, 0). The authors' V(after step 1)
  averages rollouts other than the trajectory; with the two other responses as those rollouts
  it is 0, and response 0's second step gets R − V = 1. The project averages all three: 2/3."""
  tokens = np.array([[1, 2, 3, EOS, 0, 0], [1, 2, 4, EOS, 0, 0], [1, 2, 5, EOS, 0, 0]])
  lengths, rewards = [4, 4, 4], [1.0, 0.0, 0.0]
  ends = np.zeros((3, L), bool)
  ends[:, 1] = True
  got, _ = project(tokens, lengths, rewards, ends, granularity='step')
  bounds = bounds_of(ends[0], 4)
  own = vineppo_authors(bounds, 1.0, lambda b: through(tokens, lengths, rewards, 0, b))
  others = vineppo_authors(bounds, 1.0,
                           lambda b: through(tokens, lengths, rewards, 0, b, own=False))
  np.testing.assert_allclose(got[0, :4], [0, 0, 2 / 3, 2 / 3], atol=1e-6)
  np.testing.assert_allclose(own, [0, 0, 2 / 3, 2 / 3], atol=1e-12)
  np.testing.assert_allclose(others, [0, 0, 1, 1], atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(groups())
def test_leave_one_out_is_the_authors_with_the_other_responses_as_rollouts(group):
  """`leave_one_out=True`: the rollouts at a prefix are the other responses through it (where
  none is, the trajectory's own outcome: no credit after its last fork); along a response the
  token credit telescopes to R_i minus the others' mean (RLOO)."""
  tokens, lengths, rewards, ends = group
  step, mask = project(tokens, lengths, rewards, ends, granularity='step', leave_one_out=True)
  token, _ = project(tokens, lengths, rewards, leave_one_out=True)
  for i in range(G):
    rollouts = lambda b: through(tokens, lengths, rewards, i, b, own=False) or [rewards[i]]
    np.testing.assert_allclose(step[i, :lengths[i]], vineppo_authors(
        bounds_of(ends[i], lengths[i]), rewards[i], rollouts), atol=1e-6)
    np.testing.assert_allclose(token[i, :lengths[i]], vineppo_authors(
        list(range(lengths[i] + 1)), rewards[i], rollouts), atol=1e-6)
    rloo = rewards[i] - np.mean([r for j, r in enumerate(rewards) if j != i])
    np.testing.assert_allclose(token[i].sum(), rloo, atol=1e-5)
  assert np.all(step[~mask] == 0) and np.all(token[~mask] == 0)


def test_leave_one_out_gives_the_authors_value_on_the_minimal_case():
  """The case above with `leave_one_out=True`: response 0's second step gets 1, as the
  authors' code gives it with the two other responses as rollouts."""
  tokens = np.array([[1, 2, 3, EOS, 0, 0], [1, 2, 4, EOS, 0, 0], [1, 2, 5, EOS, 0, 0]])
  ends = np.zeros((3, L), bool)
  ends[:, 1] = True
  got, _ = project(tokens, [4, 4, 4], [1.0, 0.0, 0.0], ends, granularity='step',
                   leave_one_out=True)
  np.testing.assert_allclose(got[0, :4], [0, 0, 1, 1], atol=1e-6)  # V(root) = V(step 1) = 0
  np.testing.assert_allclose(got[1, :4], [0, 0, -0.5, -0.5], atol=1e-6)  # V = 1/2, 1/2


def test_convention_the_authors_cap_the_steps_that_get_a_value():
  """The GSM8K configs set `max_step_for_value_estimation` = 25: past it no value is estimated,
  the filled values equal R, the step at the cap gets R − V and later steps 0. The project has
  no cap. Three one-token steps, V = 0.5 (query), 0.25 (after step 1), 0.75 (after step 2),
  R = 1: cap 1 gives [0.25 − 0.5, 1 − 0.25, 0], no cap [−0.25, 0.5, 0.25]."""
  values = {0: [0.5], 1: [0.25], 2: [0.75]}
  capped = vineppo_authors([0, 1, 2, 3], 1.0, values.get, max_steps=1)
  full = vineppo_authors([0, 1, 2, 3], 1.0, values.get)
  assert capped == [-0.25, 0.75, 0.0]
  assert full == [-0.25, 0.5, 0.25]
