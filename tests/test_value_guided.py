"""Value-guided decoding (experiments/rollouts/value_guided.py): K = 1 is i.i.d. sampling token
for token, one block is best-of-K reranking by the scorer, and the script runs end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.scratchpad_addition import ScratchpadAddition
from experiments.models import decoder
from experiments.rollouts import sampling, value_guided

TASK = ScratchpadAddition(num_digits=2)
CFG = decoder.PolicyConfig(vocab_size=TASK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                           d_ff=32, max_len=TASK.prompt_len + TASK.response_len)
KW = dict(eos_id=TASK.eos_id, pad_id=TASK.pad_id)


def _value(tokens, mask):  # a scorer: the running count of token 3 (any function will do)
  return jnp.cumsum(jnp.where(mask, tokens == 3, 0), -1).astype(jnp.float32)


@pytest.mark.parametrize('block_len', [3, 7, TASK.response_len])
def test_one_candidate_is_iid_sampling(block_len):
  params = decoder.init_params(jax.random.PRNGKey(0), CFG)
  prompts, _ = TASK.sample(jax.random.key(0), 3)
  l = TASK.response_len
  got = value_guided.sample_value_guided(params, CFG, jax.random.key(1), prompts, 2, 1,
                                         block_len, l, value_fn=_value, **KW)
  want = sampling.sample_iid(params, CFG, jax.random.key(1), prompts, 2, l, **KW)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)


def test_one_block_keeps_the_candidate_the_scorer_values_most():
  params = decoder.init_params(jax.random.PRNGKey(0), CFG)
  prompts, _ = TASK.sample(jax.random.key(0), 4)
  g, k, l = 2, 3, TASK.response_len
  got = value_guided.sample_value_guided(params, CFG, jax.random.key(2), prompts, g, k, l, l,
                                         value_fn=_value, **KW)
  cands = sampling.sample_iid(params, CFG, jax.random.key(2), prompts, g * k, l, **KW)
  tokens, mask = np.asarray(cands.tokens), np.asarray(cands.mask)
  for b in range(4):
    for j in range(g):
      rows = range(j * k, (j + 1) * k)
      def score(r):
        n = mask[b, r].sum()
        done = n < l or tokens[b, r, n - 1] == TASK.eos_id
        pos = min(max(n - 1 if done else n, 0), l - 1)  # before EOS, or after the last token
        return np.asarray(_value(jnp.asarray(tokens[b, r]), jnp.asarray(mask[b, r])))[pos]
      best = max(rows, key=lambda r: (score(r), -r))  # ties: the first
      np.testing.assert_array_equal(np.asarray(got.tokens)[b, j], tokens[b, best])


def test_best_rows():
  scores = jnp.array([[[0.1, 0.9], [0.5, 0.2]]])  # [B=1, G=2, K=2]
  assert list(np.asarray(value_guided.best_rows(scores))) == [1, 1, 2, 2]


@pytest.mark.slow  # ~50 s: an SFT start, a critic, every decoding procedure
def test_value_decoding_script_runs(tmp_path):
  from experiments import value_decoding
  out = value_decoding.main(['--quick', '--seeds', '1', '--sft_workdir', str(tmp_path),
                             '--workdir', str(tmp_path)])
  assert set(out['summary']) == {'sample', 'vgd_b4', 'vgd_b8', 'rerank', 'oracle'}
  s = out['summary']
  # The oracle picks among the same K draws as `rerank`, the first of which is `sample`'s.
  assert s['oracle']['acc_mean'] >= max(s['sample']['acc_mean'], s['rerank']['acc_mean'])
  assert all(0.0 <= v['acc_mean'] <= 1.0 for v in s.values())
  assert s['vgd_b4']['tokens'] > 2 * s['sample']['tokens']
