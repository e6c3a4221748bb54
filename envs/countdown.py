"""Countdown: combine the given numbers with + - * to hit a target.

Vocabulary: one token per integer 0..max(9, M) (M = max_number; the digits
0-9 double as target digits), then '+', '-', '*', '=', EOS, PAD. Default: 16.
Prompt (P = k+2+W): the k numbers (uniform on 1..M, repeats allowed) in
ascending order, '=', the target's sign ('+' or '-') and its |value| as W
zero-padded digits, most significant first, where W is the digit count of
(M+1)^k - 1, a bound on |value|. E.g. "3 5 7 = + 0 2 8".
Response (R = 2k): `x_1 o_1 x_2 ... o_{k-1} x_k EOS`, the x_i a reordering of
the prompt numbers (each used exactly once, as a multiset) and o_i in + - *,
evaluated strictly left to right: ((x_1 o_1 x_2) o_2 x_3) ... (no precedence).
"7 * 5 - 3 <eos>" = 32. Reward 1.0 iff the response has this form (see
`envs.base` for the EOS/mask convention) and its value equals the target.
Targets are the value of a random expression (numbers and operators uniform),
so a solution always exists (it is the demonstration); often there are several.
"""

import dataclasses

import jax
import jax.numpy as jnp

from envs import base

_OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class Countdown(base.Task):
  """Left-to-right Countdown over k small numbers."""

  num_numbers: int = 3
  max_number: int = 9

  name = "countdown"
  separator = " "

  def validate(self):
    k, m = self.num_numbers, self.max_number
    if not (isinstance(k, int) and k >= 1):
      raise ValueError(f"num_numbers must be an int >= 1; got {k!r}.")
    if not (isinstance(m, int) and m >= 1):
      raise ValueError(f"max_number must be an int >= 1; got {m!r}.")
    if (m + 1) ** k > 2**31 - 1:
      raise ValueError(f"values may overflow int32: (max_number+1)^num_numbers = {(m + 1) ** k}.")

  @property
  def vocab(self):
    numbers = tuple(str(i) for i in range(max(10, self.max_number + 1)))
    return numbers + _OPS + ("=", base.EOS, base.PAD)

  @property
  def target_width(self) -> int:
    """W, the number of target digits."""
    return len(str((self.max_number + 1) ** self.num_numbers - 1))

  @property
  def prompt_len(self):
    return self.num_numbers + 2 + self.target_width

  @property
  def response_len(self):
    return 2 * self.num_numbers

  def sample(self, key, n):
    """Returns prompts int32 [n, P] and info with, per prompt,

    "numbers": int32 [n, k]; "target": int32 [n];
    "solution": int32 [n, R-1], a solving expression (without EOS).
    """
    k = self.num_numbers
    # One draw for the solution: k numbers in 1..M, then k-1 operator indices in 0..2.
    high = jnp.array([self.max_number] * k + [len(_OPS)] * (k - 1), jnp.int32)
    draws = jax.random.randint(key, (n, 2 * k - 1), 0, high, jnp.int32)
    xs = draws[:, :k] + 1
    ops = self.token_id(_OPS[0]) + draws[:, k:]  # the op tokens are consecutive
    target = self._fold(xs, ops)
    numbers = jnp.sort(xs, axis=-1)  # the prompt shows them sorted
    solution = jnp.zeros((n, 2 * k - 1), jnp.int32).at[:, 0::2].set(xs).at[:, 1::2].set(ops)

    w = self.target_width
    powers = jnp.array([10**i for i in reversed(range(w))], jnp.int32)
    digits = jnp.abs(target)[:, None] // powers % 10
    sign = jnp.where(target < 0, self.token_id("-"), self.token_id("+"))
    eq = jnp.full((n, 1), self.token_id("="), jnp.int32)
    prompts = jnp.concatenate([numbers, eq, sign[:, None], digits], axis=-1).astype(jnp.int32)
    return prompts, {"numbers": numbers, "target": target, "solution": solution}

  def _fold(self, xs, ops):
    """Left-to-right value int32 [...] of numbers xs [..., k] joined by op tokens ops [..., k-1]."""
    value = xs[..., 0]
    for i in range(1, self.num_numbers):  # k is static
      x, op = xs[..., i], ops[..., i - 1]
      value = jnp.where(op == self.token_id("+"), value + x,
                        jnp.where(op == self.token_id("-"), value - x, value * x))
    return value

  def evaluate(self, responses, mask):
    """Parses and evaluates responses int32 [..., R] (mask bool [..., R]).

    Returns (well_formed bool [...], value int32 [...]): well_formed iff the
    response is `x o x ... o x EOS` with x number tokens in 1..M and o in + - *
    (it does not check which numbers are used); value is the left-to-right
    value, 0 where not well formed.
    """
    tokens, ok = self._read(responses, mask)
    xs, ops = tokens[..., 0:-1:2], tokens[..., 1:-1:2]
    ok &= jnp.all((xs >= 1) & (xs <= self.max_number), axis=-1)
    ok &= jnp.all((ops >= self.token_id(_OPS[0])) & (ops <= self.token_id(_OPS[-1])), axis=-1)
    return ok, jnp.where(ok, self._fold(xs, ops), 0).astype(jnp.int32)

  def reward(self, prompts, responses, mask, info):
    """float32 [n]: 1.0 iff well formed, uses info["numbers"] exactly, and hits info["target"]."""
    ok, value = self.evaluate(responses, mask)
    count = lambda x: jnp.sum(jax.nn.one_hot(x, self.vocab_size, dtype=jnp.int32), axis=-2)
    xs = jnp.where(mask, responses, 0)[..., 0:-1:2]
    same_numbers = jnp.all(count(xs) == count(info["numbers"]), axis=-1)
    return (ok & same_numbers & (value == info["target"])).astype(jnp.float32)

  def demonstrations(self, prompts, info):
    """info["solution"] then EOS: int32 [n, R] and an all-True mask bool [n, R]."""
    return self._finish(info["solution"])
