"""APPO's Branching Score (#35): where a tree sampler forks a chain.

APPO forks at positions whose Branching Score combines the token's uncertainty with the
"policy-induced likelihood gain of subsequent continuations", so that high-entropy positions
whose choice does not matter downstream are not branched. The authors' code (AMAP-ML/APPO,
`build_appo_branch_request`) scores z(H_t)·z(Ω_t), z-scores within each rollout, with Ω_t =
clip(exp(Σ_{j≥t} γ^{j−t} log(π_θ / π_behaviour)(y_j)), 1 ± 0.2): the importance ratio between
the trainer's recomputed log-probs and the rollout engine's. Our sampler's behaviour policy is
the current one exactly, so there Ω ≡ 1 and z(Ω) = 0 everywhere (that score would fall back
to the first tokens of each prompt's first rollout); we keep our reading of the gain, the
counterfactual one: the gain at position t is how much the sampled token makes the chain's own continuation
more likely than the policy's best alternative token would,

  g_t = mean over the next `window` generated tokens j of
        log π(y_j | x, y_<t, y_t, y_(t,j)) − log π(y_j | x, y_<t, a'_t, y_(t,j)),

a'_t = the most likely token at t other than y_t (one counterfactual teacher-forced pass per
probed position), and the score is S_t = H_t · |g_t|, H_t the policy's entropy at t: large
where the policy was unsure and the choice changes what follows (in either direction). Only
the `candidates` highest-entropy positions of each chain are probed (the others score −inf),
so a chain costs `candidates` extra forward passes. `BranchingForks` is a fork policy for
`sampling.sample_tree_forks` (sampler 'tree_branching'); the forks are the `num_forks`
best-scoring probed positions, as `sampling.EntropyForks` takes the highest-entropy ones
(the authors' code takes the top B over all of a prompt's rollouts). APPO's credit on this
tree is the estimator `appo` (credit/tree_search.py).
"""

import dataclasses

import jax
import jax.numpy as jnp

from experiments.models import decoder
from experiments.rollouts.sampling import _fork_at


def branching_scores(params, cfg: decoder.PolicyConfig, prompts, prompt_len, chains, *,
                     candidates: int, window: int):
  """float32 [B, N, L]: S_t = H_t·|g_t| at each chain's `candidates` highest-entropy generated
  positions, −inf elsewhere. prompts [B, P] (prompt_len [B] or None), chains: `Samples`
  [B, N, L] (their log-probs are the factual term of g)."""
  b, n, l = chains.tokens.shape
  m = min(candidates, l)
  entropy = jnp.where(chains.mask, chains.entropy, -jnp.inf)
  _, cand = jax.lax.top_k(entropy, m)  # [B, N, M]
  r = b * n
  resp = chains.tokens.reshape(r, l).astype(jnp.int32)
  cand = cand.reshape(r, m)
  pr = jnp.repeat(prompts, n, axis=0)
  pl = None if prompt_len is None else jnp.repeat(prompt_len, n, axis=0)
  h = decoder.response_hidden(params, cfg, pr, resp, pl)  # [R, L, D]
  h_at = jnp.take_along_axis(h, cand[..., None], axis=1)  # [R, M, D]
  logits = decoder.model(cfg).apply({'params': params}, h_at, method='logits')  # [R, M, V]
  sampled = jnp.take_along_axis(resp, cand, axis=1)
  logits = jnp.where(jnp.arange(logits.shape[-1]) == sampled[..., None], -jnp.inf, logits)
  alt = jnp.argmax(logits, -1).astype(jnp.int32)  # [R, M]: the best other token
  factual = chains.logprobs.reshape(r, l)
  on = chains.mask.reshape(r, l)
  idx = jnp.arange(l)

  def gain(_, j):  # candidate j of every row
    t = cand[:, j]
    lp, _ = decoder.token_logprobs(params, cfg, pr, resp.at[jnp.arange(r), t].set(alt[:, j]),
                                   pl)
    win = on & (idx > t[:, None]) & (idx <= t[:, None] + window)
    g = jnp.sum(jnp.where(win, factual - lp, 0.0), -1) / jnp.maximum(jnp.sum(win, -1), 1)
    return None, g

  _, g = jax.lax.scan(gain, None, jnp.arange(m))  # [M, R]
  ent = jnp.take_along_axis(chains.entropy.reshape(r, l), cand, axis=1)
  valid = jnp.take_along_axis(on, cand, axis=1)
  score = jnp.where(valid, ent * jnp.abs(g.T), -jnp.inf)
  out = jnp.full((r, l), -jnp.inf).at[jnp.arange(r)[:, None], cand].set(score)
  return out.reshape(b, n, l)


@dataclasses.dataclass(frozen=True)
class BranchingForks:
  """Forks each chain at its `num_forks` best Branching Score positions (APPO #35; module
  docstring), probing its `candidates` highest-entropy positions (0: 4 per fork) with a
  continuation window of `window` tokens. Children are ordered as in `EntropyForks` (chain,
  fork by decreasing score, continuation); a chain with fewer valid probed positions than
  forks repeats its best one."""
  num_forks: int
  num_continuations: int
  window: int = 8
  candidates: int = 0
  reads_model = True  # `sample_tree_forks` calls `with_model` (params and prompts) instead

  def __post_init__(self):
    if self.window < 1 or self.candidates < 0:
      raise ValueError(f'BranchingForks needs window >= 1 and candidates >= 0; got '
                       f'window={self.window}, candidates={self.candidates}.')

  def with_model(self, params, cfg, prompts, prompt_len, chains):
    l = chains.tokens.shape[-1]
    m = self.candidates or 4 * self.num_forks
    if self.num_forks > min(m, l):
      raise ValueError(f'num_forks={self.num_forks} > the probed positions min(candidates, '
                       f'max_new_tokens) = {min(m, l)}')
    score = branching_scores(params, cfg, prompts, prompt_len, chains, candidates=m,
                             window=self.window)
    best, pos = jax.lax.top_k(score, self.num_forks)  # [B, N, F]
    return _fork_at(jnp.where(best > -jnp.inf, pos, pos[..., :1]), self.num_continuations)
