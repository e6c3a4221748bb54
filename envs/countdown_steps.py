"""Countdown with written steps: "03,05,15,16,20=0026" -> "16+3=19,15+20=35,35/5=7,7+19=26<eos>".

Reach the target by combining the numbers two at a time, each step written out as
"a o b=r"; any valid path scores, e.g. also "16-15=1,20+5=25,25+1=26<eos>" (numbers
may be left unused unless use_all).

Vocabulary (18 tokens): '0'..'9' (ids 0-9), '+', '-', '*', '/', '=', ',', EOS, PAD.
Prompt (P = k(w+1) + V; k = num_numbers, w = digits of M = max_number, V =
max_digits): the k numbers (uniform on 1..M, repeats allowed) in ascending order
as w zero-padded digits, joined by ',', then '=' and the target as V zero-padded digits.
Response (R = (k-1)(3V+3), the longest valid one): S steps joined by ',', then EOS,
1 <= S <= k-1 (S = k-1 with use_all=True). A step is "a o b=r", where a, b, r are
numbers of 1..V digits without leading zeros ("0" is a number) and o is + - * /.
Step j is valid iff it is well formed and
  - a and b are two available numbers: each prompt number and each earlier step's
    result r can be used at most once (as a multiset, so equal values are
    interchangeable); unused ones may be left over (unless use_all);
  - r = a o b exactly, a non-negative integer below 10^V: '-' needs a >= b, '/' needs
    b > 0 dividing a.
The verifier accepts any such path (any order, either operand order, any tree).
Reward (outcome, `reward`): 1.0 iff all S steps are valid AND the last step's r is
the target (see `envs.base`; tokens after the first EOS are ignored).
Process reward (`token_rewards`): 1/(k-1) at the ',' closing each step of the prefix
of valid steps (at most k-2 of them), and at the EOS, iff the reward is 1, the rest:
1 - (S-1)/(k-1). So the sum is 1.0 iff the reward is 1.0, else (leading valid
steps)/(k-1) < 1.
Targets are the result of a random valid path using all k numbers (random pairs,
random ops, falling back to '+' or '-' where an op is not exact or too large), so a
solution always exists (the demonstration); there are usually many.
"""

import dataclasses

import jax
import jax.numpy as jnp

from envs import _cot, base

_OPS = ("+", "-", "*", "/")


@dataclasses.dataclass(frozen=True)
class CountdownSteps(base.Task):
  """Countdown over k numbers with written, checked arithmetic steps."""
  capabilities = frozenset({'reasoning_steps', 'process_rewards'})

  num_numbers: int = 5
  max_number: int = 20
  max_digits: int = 4
  use_all: bool = False

  name = "countdown_steps"

  def validate(self):
    k, m, v = self.num_numbers, self.max_number, self.max_digits
    if not (isinstance(k, int) and 2 <= k <= 8):
      raise ValueError(f"num_numbers must be an int in [2, 8]; got {k!r}.")
    if not (isinstance(m, int) and m >= 1):
      raise ValueError(f"max_number must be an int >= 1; got {m!r}.")
    if not (isinstance(v, int) and len(str(m)) <= v <= 9):
      raise ValueError(f"max_digits must be an int in [digits of max_number, 9]; got {v!r}.")

  @property
  def vocab(self):
    return tuple("0123456789") + _OPS + ("=", ",", base.EOS, base.PAD)

  @property
  def number_width(self) -> int:
    """w, the digits of each prompt number."""
    return len(str(self.max_number))

  @property
  def prompt_len(self):
    return self.num_numbers * (self.number_width + 1) + self.max_digits

  @property
  def step_width(self) -> int:
    """The longest step without its ',' or EOS: three V-digit numbers, op and '='."""
    return 3 * self.max_digits + 2

  @property
  def reasoning_steps(self) -> int:
    """The steps before the last one (which reaches the target, closed by EOS) in a
    demonstration: k − 2 (the gold-continuation probes of `experiments/training/probes.py`
    sit after each)."""
    return self.num_numbers - 2

  @property
  def response_len(self):
    return (self.num_numbers - 1) * (self.step_width + 1)

  # --- sampling and demonstrations -------------------------------------------------------------

  def sample(self, key, n):
    """Returns prompts int32 [n, P] and info with, per prompt,

    "numbers": int32 [n, k] (ascending); "target": int32 [n];
    "steps": int32 [n, k-1, 4], a solving path, rows (a, op token id, b, r).
    """
    k = self.num_numbers
    k1, k2, k3 = jax.random.split(key, 3)
    numbers = jnp.sort(jax.random.randint(k1, (n, k), 1, self.max_number + 1, jnp.int32), -1)
    pick = jax.random.uniform(k2, (n, k - 1, 2 * k - 1))
    choice = jax.random.randint(k3, (n, k - 1, 2), 0, 4, jnp.int32)  # op, operand swap
    steps = jax.vmap(self._path)(numbers, pick, choice)
    target = steps[:, -1, 3]

    w, v = self.number_width, self.max_digits
    col = lambda token: jnp.full((n, k, 1), self.token_id(token), jnp.int32)
    digits = numbers[..., None] // 10 ** jnp.arange(w - 1, -1, -1) % 10  # [n, k, w]
    seps = col(",").at[:, -1].set(self.token_id("="))
    tdigits = target[:, None] // 10 ** jnp.arange(v - 1, -1, -1) % 10
    prompts = jnp.concatenate([jnp.concatenate([digits, seps], -1).reshape(n, -1), tdigits], -1)
    return prompts.astype(jnp.int32), {"numbers": numbers, "target": target, "steps": steps}

  def _path(self, numbers, pick, choice):
    """A random valid path over numbers [k]: steps int32 [k-1, 4] (a, op id, b, r)."""
    k, big = self.num_numbers, 10**self.max_digits
    pool = jnp.zeros(2 * k - 1, jnp.int32).at[:k].set(numbers)
    avail = jnp.arange(2 * k - 1) < k
    steps = []
    for j in range(k - 1):  # k is static
      score = jnp.where(avail, pick[j], -1.0)
      i1 = jnp.argmax(score)
      i2 = jnp.argmax(score.at[i1].set(-1.0))
      x, y = pool[i1], pool[i2]
      hi, lo = jnp.maximum(x, y), jnp.minimum(x, y)
      ok = jnp.stack([x + y < big, hi != lo, hi <= (big - 1) // jnp.maximum(lo, 1),
                      (lo > 1) & (hi % jnp.maximum(lo, 1) == 0)])
      op = jnp.where(ok[choice[j, 0]], choice[j, 0], jnp.where(ok[0], 0, 1))
      swap = (choice[j, 1] % 2 == 1) & (op % 2 == 0)  # + and * commute
      a, b = jnp.where(swap, lo, hi), jnp.where(swap, hi, lo)
      r = jnp.stack([a + b, a - b, a * b, a // jnp.maximum(b, 1)])[op]
      steps.append(jnp.stack([a, self.token_id(_OPS[0]) + op, b, r]))
      pool = pool.at[k + j].set(r)
      avail = avail.at[i1].set(False).at[i2].set(False).at[k + j].set(True)
    return jnp.stack(steps).astype(jnp.int32)

  def demonstrations(self, prompts, info):
    """info["steps"] written out then EOS: int32 [n, R] (pad_id after EOS), mask bool [n, R]."""
    return _cot.over_batch(self._demo_one, info["steps"].shape[:-2], info["steps"])

  def _demo_one(self, steps):
    v, pieces = self.max_digits, []
    for j in range(self.num_numbers - 1):
      a, op, b, r = steps[j]
      sep = self.token_id(",") if j < self.num_numbers - 2 else self.eos_id
      pieces += [_cot.number_tokens(a, v), (op[None], 1), _cot.number_tokens(b, v),
                 (jnp.array([self.token_id("=")]), 1), _cot.number_tokens(r, v),
                 (jnp.array([sep]), 1)]
    tokens, length = _cot.concat(pieces, self.response_len, self.pad_id)
    return tokens, jnp.arange(self.response_len) < length

  # --- verification ----------------------------------------------------------------------------

  def verify(self, responses, mask, info):
    """Parses and checks responses int32 [..., R] (mask [..., R]) against info["numbers"].

    Returns a dict over the leading dims: "step_valid" bool [..., k-1] (step j is
    present and valid given the earlier steps), "step_end" int32 [..., k-1] (the
    position of its closing ',' or EOS; R if absent), "num_steps" int32 [...] (S, the
    number of steps before the first EOS; 0 if there is no EOS or more than k-1
    steps), "result" int32 [...] (the last step's r, -1 if S = 0).
    """
    batch = responses.shape[:-1]
    return _cot.over_batch(self._verify_one, batch, responses, mask, info["numbers"])

  def _verify_one(self, responses, mask, numbers):
    k, v, r, w = self.num_numbers, self.max_digits, self.response_len, self.step_width
    tokens, has_eos, e = _cot.read(responses, mask, self.eos_id)
    pos = jnp.arange(r)
    comma = (tokens == self.token_id(",")) & (pos < e)
    sep = comma | (has_eos & (pos == e))
    ends = jnp.nonzero(sep, size=k - 1, fill_value=r)[0].astype(jnp.int32)  # [k-1]
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1] + 1])
    lengths = ends - starts
    win = _cot.windows(tokens, starts, w)
    t = jnp.arange(w)
    in_seg = t < lengths[:, None]
    digit = _cot.is_digit(win)
    is_op = in_seg & (win >= self.token_id(_OPS[0])) & (win <= self.token_id(_OPS[-1]))
    is_eq = in_seg & (win == self.token_id("="))
    p, q = jnp.argmax(is_op, -1), jnp.argmax(is_eq, -1)
    la, lb, lr = p, q - p - 1, lengths - q - 1
    fits = lambda n: (n >= 1) & (n <= v)
    form = (ends < r) & (lengths <= w) & jnp.any(is_op, -1) & jnp.any(is_eq, -1)
    form &= fits(la) & fits(lb) & fits(lr) & (jnp.sum(in_seg & ~digit, -1) == 2)
    at = lambda i: jnp.take_along_axis(win, i[:, None], -1)[:, 0]
    for lo, n in ((jnp.zeros_like(p), la), (p + 1, lb), (q + 1, lr)):  # no leading zeros
      form &= (n == 1) | (at(jnp.clip(lo, 0, w - 1)) != 0)
    a = _cot.digits_value(win, jnp.zeros_like(p), p)
    b = _cot.digits_value(win, p + 1, q)
    res = _cot.digits_value(win, q + 1, lengths)
    op = at(p) - self.token_id(_OPS[0])
    sb = jnp.maximum(b, 1)
    exact = jnp.stack([res - a == b, a - b == res,
                       jnp.where(b == 0, res == 0, (res % sb == 0) & (res // sb == a)),
                       (b > 0) & (a % sb == 0) & (a // sb == res)], -1)
    arith = jnp.take_along_axis(exact, jnp.clip(op, 0, 3)[:, None], -1)[:, 0]

    pool = jnp.zeros(2 * k - 1, jnp.int32).at[:k].set(numbers)
    avail = jnp.arange(2 * k - 1) < k
    valid = []
    for j in range(k - 1):  # k is static; a step's result is available from the next step
      found = []
      for x in (a[j], b[j]):
        hit = avail & (pool == x)
        i = jnp.argmax(hit)
        found.append(jnp.any(hit))
        avail = avail.at[i].set(avail[i] & ~hit[i])
      valid.append(form[j] & arith[j] & found[0] & found[1])
      pool = pool.at[k + j].set(res[j])
      avail = avail.at[k + j].set(True)
    step_valid = jnp.stack(valid)

    num_eos = jnp.sum(has_eos & (ends == e))  # the EOS closes one of the first k-1 steps
    num_steps = jnp.where(num_eos > 0, jnp.sum(comma) + 1, 0).astype(jnp.int32)
    last = jnp.clip(num_steps - 1, 0, k - 2)
    result = jnp.where(num_steps > 0, res[last], -1)
    return {"step_valid": step_valid, "step_end": ends, "num_steps": num_steps, "result": result}

  def _correct(self, v, target):
    """bool [...]: all S steps valid, S >= 1 (= k-1 if use_all), last result == target."""
    s = v["num_steps"]
    k = self.num_numbers
    upto = jnp.arange(k - 1) < s[..., None]
    ok = (s >= 1) & jnp.all(v["step_valid"] | ~upto, -1) & (v["result"] == target)
    return ok & (s == k - 1) if self.use_all else ok

  def reward(self, prompts, responses, mask, info):
    """float32 [n]: 1.0 iff every step is valid and the last result is info["target"]."""
    return self._correct(self.verify(responses, mask, info), info["target"]).astype(jnp.float32)

  def token_rewards(self, prompts, responses, mask, info):
    """float32 [n, R] process rewards: 1/(k-1) at the ',' of each step in the prefix of
    valid steps, and 1 - (S-1)/(k-1) at the EOS iff the reward is 1 (module docstring)."""
    v = self.verify(responses, mask, info)
    correct = self._correct(v, info["target"])
    k, r = self.num_numbers, self.response_len

    def one(step_valid, step_end, num_steps, correct):
      j = jnp.arange(k - 1)
      prefix = jnp.cumprod(step_valid.astype(jnp.int32)).astype(bool)
      by_comma = prefix & (j < num_steps - 1) | prefix & (num_steps == 0) & (j < k - 2)
      credit = jnp.where(by_comma, 1.0 / (k - 1), 0.0)
      last = correct & (j == num_steps - 1)
      credit = jnp.where(last, 1.0 - (num_steps - 1) / (k - 1), credit)
      return _cot.scatter_credit(credit, jnp.where(by_comma | last, step_end, r), r)

    return _cot.over_batch(one, responses.shape[:-1], v["step_valid"], v["step_end"],
                           v["num_steps"], correct)

  def step_ends(self, prompts, responses, mask, info):
    """bool [n, R]: the tokens that close a step (its ',' or the first EOS)."""
    v = self.verify(responses, mask, info)
    return jnp.any(v["step_end"][..., None] == jnp.arange(self.response_len), axis=-2)
