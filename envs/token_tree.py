"""A synthetic token tree with exact state values, for checking advantage estimators.

Each prompt has a hidden key, D symbols out of K, and `num_decisive` (m)
decisive positions. Vocabulary: K symbols 'a', 'b', ..., '?', EOS, PAD.
Prompt (P = D): the key symbol at decisive positions and '?' elsewhere.
Response (R = D+1): D symbols then EOS. Reward (see `envs.base` for the
EOS/mask convention; a non-symbol among the first D tokens scores 0):
  graded=False: 1.0 iff the response equals the key at every decisive position;
  graded=True:  the fraction of decisive positions where it equals the key.

Reference policy (tabular, per prompt): the D positions are independent; at
position d it puts probability q_d = info["key_prob"][..., d] on key[d] and
(1 - q_d)/(K-1) on each other symbol, then emits EOS. q_d is drawn per prompt
and position uniformly from [key_prob - key_prob_spread, key_prob + key_prob_spread],
so the success rate is about key_prob^m. Under this policy the value of the
state s_t (the first t response tokens) is, for t <= D, with [.] = 1/0,

  binary: V(s_t) = [first t tokens are symbols] · Π_{decisive d<t} [y_d = key_d]
                   · Π_{decisive d>=t} q_d,
  graded: V(s_t) = [first t tokens are symbols] · (Σ_{decisive d<t} [y_d = key_d]
                   + Σ_{decisive d>=t} q_d) / m,

and V(s_R) = the reward (V(s_D) times [y_D = EOS]). The true advantage of
token t is V(s_{t+1}) - V(s_t); it is 0 at non-decisive positions.
"""

import dataclasses
import string

import jax
import jax.numpy as jnp

from envs import base


@dataclasses.dataclass(frozen=True)
class TokenTree(base.Task):
  """Match a hidden key at a few decisive positions; exact values under a tabular policy."""

  num_symbols: int = 4
  depth: int = 6
  num_decisive: int = 3
  key_prob: float = 0.7
  key_prob_spread: float = 0.2
  graded: bool = False

  name = "token_tree"

  def validate(self):
    k, d, m = self.num_symbols, self.depth, self.num_decisive
    if not (isinstance(k, int) and 2 <= k <= 26):
      raise ValueError(f"num_symbols must be an int in [2, 26]; got {k!r}.")
    if not (isinstance(d, int) and d >= 1):
      raise ValueError(f"depth must be an int >= 1; got {d!r}.")
    if not (isinstance(m, int) and 1 <= m <= d):
      raise ValueError(f"num_decisive must be an int in [1, depth={d}]; got {m!r}.")
    lo, hi = self.key_prob - self.key_prob_spread, self.key_prob + self.key_prob_spread
    if not (self.key_prob_spread >= 0 and 0 <= lo and hi <= 1):
      raise ValueError("need 0 <= key_prob - key_prob_spread <= key_prob + key_prob_spread <= 1; "
                       f"got key_prob={self.key_prob}, key_prob_spread={self.key_prob_spread}.")

  @property
  def vocab(self):
    return tuple(string.ascii_lowercase[:self.num_symbols]) + ("?", base.EOS, base.PAD)

  @property
  def prompt_len(self):
    return self.depth

  @property
  def response_len(self):
    return self.depth + 1

  def sample(self, key, n):
    """Returns prompts int32 [n, D] and info with, per prompt,

    "key": int32 [n, D] symbols; "decisive": bool [n, D] (m True);
    "key_prob": float32 [n, D], the reference policy's probability of key[d].
    """
    k_key, k_unif = jax.random.split(key)
    shape = (n, self.depth)
    hidden = jax.random.randint(k_key, shape, 0, self.num_symbols, jnp.int32)
    u_dec, u_prob = jax.random.uniform(k_unif, (2,) + shape)
    decisive = jnp.argsort(jnp.argsort(u_dec, axis=-1), axis=-1) < self.num_decisive
    lo, hi = self.key_prob - self.key_prob_spread, self.key_prob + self.key_prob_spread
    key_prob = lo + (hi - lo) * u_prob
    prompts = jnp.where(decisive, hidden, self.token_id("?")).astype(jnp.int32)
    return prompts, {"key": hidden, "decisive": decisive, "key_prob": key_prob}

  def _matches(self, symbols, info):
    """(is_symbol, hit) bool [..., D] for symbols [..., D] with info broadcastable to it."""
    is_symbol = (symbols >= 0) & (symbols < self.num_symbols)
    return is_symbol, symbols == info["key"]

  def _score(self, hit, decisive):
    """Reward of a well-formed response from hit, decisive bool [..., D]."""
    if self.graded:
      return jnp.sum(hit & decisive, axis=-1) / self.num_decisive
    return jnp.all(hit | ~decisive, axis=-1).astype(jnp.float32)

  def reward(self, prompts, responses, mask, info):
    """float32 [n]: binary or graded key match of responses [n, R] (mask [n, R])."""
    tokens, ok = self._read(responses, mask)
    is_symbol, hit = self._matches(tokens[..., :-1], info)
    ok &= jnp.all(is_symbol, axis=-1)
    return jnp.where(ok, self._score(hit, info["decisive"]), 0.0).astype(jnp.float32)

  def demonstrations(self, prompts, info):
    """The hidden key then EOS: int32 [n, R] and an all-True mask bool [n, R]."""
    return self._finish(info["key"])

  # --- the tabular reference policy -------------------------------------------------------------

  def policy_logits(self, info):
    """float32 [n, D, K]: log-probabilities of the reference policy at each position."""
    q = info["key_prob"][..., None]
    on_key = jax.nn.one_hot(info["key"], self.num_symbols, dtype=bool)
    return jnp.where(on_key, jnp.log(q), jnp.log((1 - q) / (self.num_symbols - 1)))

  def sample_policy(self, key, info, group_size):
    """Samples G responses per prompt from the reference policy.

    Returns responses int32 [n, G, R] (D symbols then EOS) and mask bool [n, G, R] (all True).
    """
    logits = self.policy_logits(info)[..., None, :, :]  # [n, 1, D, K]
    shape = logits.shape[:-3] + (group_size, self.depth)
    symbols = jax.random.categorical(key, logits, axis=-1, shape=shape).astype(jnp.int32)
    return self._finish(symbols)

  def policy_log_probs(self, info, responses):
    """float32 [n, G, R]: log π(y_t | s_t) of responses [n, G, R] (0 for the EOS at t = D)."""
    symbols = jnp.clip(responses[..., :-1], 0, self.num_symbols - 1)
    logits = jnp.broadcast_to(self.policy_logits(info)[..., None, :, :],
                              symbols.shape + (self.num_symbols,))
    logp = jnp.take_along_axis(logits, symbols[..., None], axis=-1)[..., 0]
    is_symbol = (responses[..., :-1] >= 0) & (responses[..., :-1] < self.num_symbols)
    logp = jnp.where(is_symbol, logp, -jnp.inf)
    last = jnp.where(responses[..., -1:] == self.eos_id, 0.0, -jnp.inf)
    return jnp.concatenate([logp, last], axis=-1)

  def state_values(self, info, responses):
    """Exact V(s_t), t = 0..R, under the reference policy: float32 [n, G, R+1].

    responses: int32 [n, G, R], read in full (no mask; prefixes the policy
    cannot produce are valued by the formulas in the module docstring, so a
    non-symbol makes the rest 0). V[..., 0] is the expected reward of the
    prompt, V[..., R] is the reward of the response.
    """
    info = jax.tree.map(lambda x: x[..., None, :], info)  # [n, 1, D]: broadcast over G
    is_symbol, hit = self._matches(responses[..., :-1], info)
    decisive = jnp.broadcast_to(info["decisive"], hit.shape)
    q = jnp.broadcast_to(info["key_prob"], hit.shape)
    ones = jnp.ones(hit.shape[:-1] + (1,), jnp.float32)
    zeros = jnp.zeros_like(ones)
    # valid[t] = [first t tokens are symbols], t = 0..D.
    valid = jnp.concatenate([ones, jnp.cumprod(is_symbol, axis=-1, dtype=jnp.float32)], axis=-1)
    suffix = lambda fn, x: jnp.flip(fn(jnp.flip(x, -1), axis=-1), -1)  # Σ/Π over d >= t
    if self.graded:
      done = jnp.cumsum(hit & decisive, axis=-1, dtype=jnp.float32)
      todo = suffix(jnp.cumsum, jnp.where(decisive, q, 0.0))
      values = (jnp.concatenate([zeros, done], -1) + jnp.concatenate([todo, zeros], -1))
      values = values / self.num_decisive
    else:
      done = jnp.cumprod(hit | ~decisive, axis=-1, dtype=jnp.float32)
      todo = suffix(jnp.cumprod, jnp.where(decisive, q, 1.0))
      values = jnp.concatenate([ones, done], -1) * jnp.concatenate([todo, ones], -1)
    values = valid * values
    final = values[..., -1:] * (responses[..., -1:] == self.eos_id)
    return jnp.concatenate([values, final], axis=-1).astype(jnp.float32)
