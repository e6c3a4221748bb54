"""n-digit addition: "a+b=" -> the digits of a+b.

Vocabulary (14 tokens): '0'..'9' (ids 0-9), '+', '=', EOS, PAD.
Prompt (P = 2D+2, D = num_digits): the operands' D digits each, most significant
first, zero-padded: "007+345=". Operands are uniform on [0, 10^D).
Answer: a+b as exactly D+1 digits, zero-padded, most significant first
("0352"); with `reverse=True`, least significant first ("2530").
Response (R = D+2): the answer digits then EOS. Reward 1.0 iff the response is
exactly that (see `envs.base` for the EOS/mask convention), else 0.0.
"""

import dataclasses

import jax
import jax.numpy as jnp

from envs import base


@dataclasses.dataclass(frozen=True)
class Addition(base.Task):
  """n-digit addition with a fixed-width answer."""

  num_digits: int = 3
  reverse: bool = False

  name = "addition"

  def validate(self):
    if not (isinstance(self.num_digits, int) and self.num_digits >= 1):
      raise ValueError(f"num_digits must be an int >= 1; got {self.num_digits!r}.")

  @property
  def vocab(self):
    return tuple("0123456789+=") + (base.EOS, base.PAD)

  @property
  def prompt_len(self):
    return 2 * self.num_digits + 2

  @property
  def response_len(self):
    return self.num_digits + 2

  def sample(self, key, n):
    """Returns prompts int32 [n, P] and info {"answer": int32 [n, D+1]} (answer digits)."""
    d = self.num_digits
    a, b = jnp.split(jax.random.randint(key, (n, 2 * d), 0, 10, jnp.int32), 2, axis=-1)
    col = lambda token: jnp.full((n, 1), self.token_id(token), jnp.int32)
    prompts = jnp.concatenate([a, col("+"), b, col("=")], axis=-1)
    return prompts, {"answer": self.answer(prompts)}

  def answer(self, prompts):
    """The answer digits int32 [..., D+1] of prompts [..., P] (in response order)."""
    d = self.num_digits
    a, b = prompts[..., :d], prompts[..., d + 1:2 * d + 1]
    carry, digits = jnp.zeros(prompts.shape[:-1], jnp.int32), []
    for i in reversed(range(d)):  # least significant first; D is static
      total = a[..., i] + b[..., i] + carry
      digits.append(total % 10)
      carry = total // 10
    digits.append(carry)
    return jnp.stack(digits if self.reverse else digits[::-1], axis=-1).astype(jnp.int32)

  def reward(self, prompts, responses, mask, info):
    """float32 [n]: 1.0 iff responses [n, R] (mask [n, R]) are info["answer"] then EOS."""
    tokens, ok = self._read(responses, mask)
    correct = ok & jnp.all(tokens[..., :-1] == info["answer"], axis=-1)
    return correct.astype(jnp.float32)

  def demonstrations(self, prompts, info):
    """The answer then EOS: int32 [n, R] and an all-True mask bool [n, R]."""
    return self._finish(info["answer"])
