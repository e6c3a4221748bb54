"""Column addition with a written scratchpad, e.g. (D = 4)
"0734+2958=" -> "4+8=12,3+5+1=09,7+9=16,1+0+2=3,3692<eos>".

Vocabulary (15 tokens): '0'..'9' (ids 0-9), '+', '=', ',', EOS, PAD.
Prompt (P = K(D+1); K = num_operands, D = num_digits): the K operands as D digits
each, most significant first, zero-padded, joined by '+', then '='. Operands are
uniform on [0, 10^D).
Response (R = D(2K+5) + D+2, the longest valid one): D column steps, least
significant column first, each closed by ',', then the answer, then EOS. Step i
(column i from the right, carry-in c_i, c_0 = 0) is "x_1+...+x_m=s", x_j single
digits; its total t_i = (column digits) + c_i, and c_{i+1} = t_i // 10.

The verifier accepts ANY valid scratchpad. Step i is valid iff it is well formed and
  - its terms are the column's K digits and the TRUE carry-in c_i, in any order,
    where zero terms may be left out (at least one term): as multisets, the nonzero
    terms equal the nonzero ones of those K+1 values, and there are at most as many
    zero terms as zeros among them ("3+4", "4+3+0", "0+4+3+0" for digits 3, 4, c=0);
  - s is t_i, as one or two digits ("7" or "07"; the tens digit is the carry-out).
The answer is 1 to D+1 digits, most significant first, whose value is the sum
(leading zeros allowed: "3692" or "03692").
Reward (outcome, `reward`): 1.0 iff all D steps are valid AND the answer is right,
and the response is exactly D steps, the answer and its first EOS (see
`envs.base`; tokens after the first EOS are ignored). A wrong carry makes the next
step invalid (its carry-in is wrong), so it scores 0 even when the answer is right.
Process reward (`token_rewards`): 1/(D+1) at the ',' closing each step of the
prefix of valid steps, and 1/(D+1) at the EOS iff the reward is 1; so the sum is
1.0 iff the reward is 1.0, else (number of leading valid steps)/(D+1).
"""

import dataclasses

import jax
import jax.numpy as jnp

from envs import _cot, base


@dataclasses.dataclass(frozen=True)
class ScratchpadAddition(base.Task):
  """K-operand, D-digit column addition with per-column carry steps."""
  capabilities = frozenset({'reasoning_steps', 'process_rewards', 'interventions'})

  num_digits: int = 5
  num_operands: int = 2

  name = "scratch_add"

  def validate(self):
    d, k = self.num_digits, self.num_operands
    if not (isinstance(d, int) and 1 <= d <= 8):
      raise ValueError(f"num_digits must be an int in [1, 8]; got {d!r}.")
    if not (isinstance(k, int) and 2 <= k <= 10):
      raise ValueError(f"num_operands must be an int in [2, 10]; got {k!r}.")

  @property
  def vocab(self):
    return tuple("0123456789+=,") + (base.EOS, base.PAD)

  @property
  def prompt_len(self):
    return self.num_operands * (self.num_digits + 1)

  @property
  def step_width(self) -> int:
    """The longest step without its ',': K+1 terms, K '+', '=', 2 digits."""
    return 2 * self.num_operands + 4

  @property
  def reasoning_steps(self) -> int:
    """The steps before the answer in every valid response: the D column steps (the
    gold-continuation probes of `experiments/training/probes.py` sit after each)."""
    return self.num_digits

  @property
  def response_len(self):
    d = self.num_digits
    return d * (self.step_width + 1) + d + 2

  # --- sampling and demonstrations -------------------------------------------------------------

  def sample(self, key, n):
    """Returns prompts int32 [n, P] and info with, per prompt,

    "operands": int32 [n, K, D], the digits, most significant first (as in the prompt);
    "style": float32 [n, D+1, 2K+3], uniforms choosing the demonstration's path.
    """
    k, d = self.num_operands, self.num_digits
    k1, k2 = jax.random.split(key)
    operands = jax.random.randint(k1, (n, k, d), 0, 10, jnp.int32)
    style = jax.random.uniform(k2, (n, d + 1, 2 * k + 3))
    plus = jnp.full((n, k, 1), self.token_id("+"), jnp.int32).at[:, -1].set(self.token_id("="))
    prompts = jnp.concatenate([operands, plus], axis=-1).reshape(n, self.prompt_len)
    return prompts, {"operands": operands, "style": style}

  def columns(self, operands):
    """Per column, least significant first: (digits int32 [..., D, K], carry_in [..., D],
    total [..., D]) of operands [..., K, D]; and the sum's value int32 [...]."""
    digits = jnp.swapaxes(operands[..., ::-1], -1, -2)
    carry, carries, totals = jnp.zeros(digits.shape[:-2], jnp.int32), [], []
    for i in range(self.num_digits):  # D is static
      total = jnp.sum(digits[..., i, :], axis=-1) + carry
      carries.append(carry)
      totals.append(total)
      carry = total // 10
    powers = 10 ** jnp.arange(self.num_digits - 1, -1, -1)
    value = jnp.sum(operands * powers, axis=(-1, -2)).astype(jnp.int32)
    return digits, jnp.stack(carries, -1), jnp.stack(totals, -1), value

  def demonstrations(self, prompts, info):
    """A valid scratchpad then EOS: int32 [n, R] (pad_id after EOS) and its mask bool [n, R].

    info["style"] picks the path: the term order, which zero terms to leave out,
    whether totals below 10 get a leading zero, and whether a zero leading answer
    digit is written.
    """
    batch = info["operands"].shape[:-2]
    return _cot.over_batch(self._demo_one, batch, info["operands"], info["style"])

  def _demo_one(self, operands, style):
    d = self.num_digits
    digits, carry, total, value = self.columns(operands)
    terms = jnp.concatenate([digits, carry[:, None]], -1)  # [D, K+1]
    tokens, lengths = jax.vmap(self._demo_step)(terms, total, style[:d])
    pieces = [(tokens[i], lengths[i]) for i in range(d)]
    answer, length = _cot.number_tokens(value, d + 1)
    lead_zero = (length <= d) & (style[d, 0] < 0.5)  # "03692" as well as "3692"
    answer = jnp.where(lead_zero, jnp.concatenate([jnp.zeros(1, jnp.int32), answer[:-1]]), answer)
    pieces.append((answer, length + lead_zero))
    pieces.append((jnp.array([self.eos_id]), 1))
    tokens, total_len = _cot.concat(pieces, self.response_len, self.pad_id)
    return tokens, jnp.arange(self.response_len) < total_len

  def _demo_step(self, terms, total, style):
    """One column's step and its ',' (int32 [W+1], length) from its K+1 terms and total."""
    k = self.num_operands
    order_key, drop, lead = style[:k + 1], style[k + 1:2 * k + 2] < 0.5, style[-1]
    keep = (terms != 0) | ~drop
    keep = keep | (~jnp.any(keep) & (jnp.arange(k + 1) == jnp.argmin(order_key)))
    terms = terms[jnp.argsort(order_key + 2.0 * ~keep)]  # kept terms first, shuffled
    m = jnp.sum(keep)
    two = (total >= 10) | (lead < 0.5)
    ls = 1 + two.astype(jnp.int32)
    s = jnp.where(two, jnp.stack([total // 10, total % 10]), jnp.stack([total, 0]))
    t = jnp.arange(self.step_width + 1)
    tok = jnp.where(t % 2 == 0, terms[jnp.clip(t // 2, 0, k)], self.token_id("+"))
    tok = jnp.where(t == 2 * m - 1, self.token_id("="), tok)
    tok = jnp.where(t >= 2 * m, s[jnp.clip(t - 2 * m, 0, 1)], tok)
    tok = jnp.where(t == 2 * m + ls, self.token_id(","), tok)
    return tok.astype(jnp.int32), 2 * m + ls + 1

  # --- verification ----------------------------------------------------------------------------

  def verify(self, responses, mask, info):
    """Parses responses int32 [..., R] (mask [..., R]) against info["operands"] [..., K, D].

    Returns a dict of arrays over the leading dims: "step_valid" bool [..., D] (step i
    is present, closed by ',', and valid), "step_end" int32 [..., D] (its ',' position),
    "answer_ok" bool [...] (exactly D steps then a right answer then EOS), "eos" int32
    [...] (the first EOS position, R if none).
    """
    batch = responses.shape[:-1]
    return _cot.over_batch(self._verify_one, batch, responses, mask, info["operands"])

  def _verify_one(self, responses, mask, operands):
    k, d, r, w = self.num_operands, self.num_digits, self.response_len, self.step_width
    digits, carry, total, value = self.columns(operands)
    tokens, has_eos, e = _cot.read(responses, mask, self.eos_id)
    comma = (tokens == self.token_id(",")) & (jnp.arange(r) < e)
    ends = jnp.nonzero(comma, size=d, fill_value=r)[0].astype(jnp.int32)  # [D]
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1] + 1])
    lengths = ends - starts
    win = _cot.windows(tokens, starts, w)  # [D, W]
    t = jnp.arange(w)
    in_seg = t < lengths[:, None]
    is_eq = (win == self.token_id("=")) & in_seg
    q = jnp.argmax(is_eq, axis=-1)  # the '=' position
    num_terms = (q + 1) // 2
    ls = lengths - q - 1  # the total's digit count
    before, after = t < q[:, None], (t > q[:, None]) & in_seg
    digit = _cot.is_digit(win)
    form = (ends < r) & (lengths <= w) & jnp.any(is_eq, -1) & (q % 2 == 1)
    form &= (num_terms <= k + 1) & (ls >= 1) & (ls <= 2)
    form &= jnp.all(jnp.where(before & (t % 2 == 0), digit, True), -1)
    form &= jnp.all(jnp.where(before & (t % 2 == 1), win == self.token_id("+"), True), -1)
    form &= jnp.all(jnp.where(after, digit, True), -1)
    onehot = jax.nn.one_hot(win, 10, dtype=jnp.int32)  # -1 and non-digits: all zero
    written = jnp.sum(onehot * (before & (t % 2 == 0))[..., None], axis=-2)  # [D, 10]
    expected = jnp.sum(jax.nn.one_hot(jnp.concatenate([digits, carry[:, None]], -1), 10,
                                      dtype=jnp.int32), axis=-2)
    terms_ok = jnp.all(written[:, 1:] == expected[:, 1:], -1) & (written[:, 0] <= expected[:, 0])
    s = _cot.digits_value(win, q + 1, lengths)
    step_valid = form & terms_ok & (s == total)

    start = ends[-1] + 1  # the answer: after the D-th ','
    ans = _cot.windows(tokens, start[None], d + 1)[0]
    la = e - start
    answer_ok = has_eos & (jnp.sum(comma) == d) & (la >= 1) & (la <= d + 1)
    answer_ok &= jnp.all(jnp.where(jnp.arange(d + 1) < la, _cot.is_digit(ans), True))
    answer_ok &= _cot.digits_value(ans, jnp.zeros((), jnp.int32), la) == value
    return {"step_valid": step_valid, "step_end": ends, "answer_ok": answer_ok, "eos": e}

  def reward(self, prompts, responses, mask, info):
    """float32 [n]: 1.0 iff all D steps are valid and the answer is right (module docstring)."""
    v = self.verify(responses, mask, info)
    return (jnp.all(v["step_valid"], -1) & v["answer_ok"]).astype(jnp.float32)

  def interventions(self, prompts, responses, mask, info):
    """InT's single-step interventions (#131): (tokens int32 [n, R], loss_mask bool [n, R],
    ok bool [n]) for responses [n, R]. A response that is not fully right keeps its
    leading valid steps and gets, in place of its first wrong step, the demonstration's
    step for the same column (the same carry in, so it continues a valid prefix), or, when
    every step is valid, the demonstration's answer and EOS; `loss_mask` is on those tokens
    only (the prefix is context). ok is False for right responses."""
    v = self.verify(responses, mask, info)
    demo, dmask = self.demonstrations(prompts, info)
    dv = self.verify(demo, dmask, info)
    return _cot.over_batch(self._intervene_one, responses.shape[:-1], responses,
                           v["step_valid"], v["step_end"], v["answer_ok"], demo,
                           dv["step_end"], dv["eos"])

  def _intervene_one(self, response, step_valid, step_end, answer_ok, demo, d_end, d_eos):
    d, r = self.num_digits, self.response_len
    k = jnp.sum(jnp.cumprod(step_valid.astype(jnp.int32)))  # leading valid steps
    ends = jnp.append(step_end, r)
    d_ends = jnp.append(d_end, d_eos)  # the demonstration's step ends, then its EOS
    keep = jnp.where(k > 0, ends[jnp.maximum(k - 1, 0)] + 1, 0)  # the valid prefix
    src0 = jnp.where(k > 0, d_ends[jnp.maximum(k - 1, 0)] + 1, 0)
    seg = d_ends[k] + 1 - src0  # step k of the demonstration (k = D: its answer and EOS)
    t = jnp.arange(r)
    gold = demo[jnp.clip(src0 + t - keep, 0, r - 1)]
    inside = (t >= keep) & (t < keep + seg)
    tokens = jnp.where(t < keep, response, jnp.where(inside, gold, self.pad_id))
    ok = ~((k == d) & answer_ok) & (keep + seg <= r)
    return tokens, inside & ok, ok

  def token_rewards(self, prompts, responses, mask, info):
    """float32 [n, R] process rewards: 1/(D+1) at the ',' of each step in the prefix of
    valid steps, and 1/(D+1) at the first EOS iff the reward is 1. Sums to 1 iff reward 1."""
    v = self.verify(responses, mask, info)
    r = self.response_len

    def one(step_valid, step_end, answer_ok, eos):
      prefix = jnp.cumprod(step_valid.astype(jnp.int32)).astype(bool)
      correct = prefix[-1] & answer_ok
      pos = jnp.append(jnp.where(prefix, step_end, r), jnp.where(correct, eos, r))
      return _cot.scatter_credit(jnp.full(pos.shape, 1.0 / (self.num_digits + 1)), pos, r)

    return _cot.over_batch(one, responses.shape[:-1], v["step_valid"], v["step_end"],
                           v["answer_ok"], v["eos"])

  def step_ends(self, prompts, responses, mask, info):
    """bool [n, R]: the tokens that close a step (the ',' of each step, and the first EOS)."""
    v = self.verify(responses, mask, info)
    pos = jnp.concatenate([v["step_end"], v["eos"][..., None]], axis=-1)
    return jnp.any(pos[..., None] == jnp.arange(self.response_len), axis=-2)
