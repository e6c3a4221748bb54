"""Rollout-budget allocation (Knapsack RL, #59): groups of varying size within one batch.

Each step's B prompts share R = B·G rollouts (the i.i.d. sampler's budget). A pool prompt's
pass rate p (its success fraction at its last visit; `rl.prompt_pool` makes prompts recur)
sets the value of giving it n rollouts, the chance its group has both outcomes (a non-zero
GRPO gradient) times the paper's information gain p(1 − p)²:

    v(n, p) = (1 − pⁿ − (1 − p)ⁿ) · p (1 − p)²

and the allocation maximises Σ_i v(n_i, p_i) subject to Σ_i n_i = R, n_i in [min, max].
Reading of the paper's released allocator (`allocate`): a prompt never seen gets G; one
with p = 0 or 1 (no value) gets `min_rows`; one with 0 < p < 1 gets `min_rows` plus its
share of the rest. v is concave in n, so taking the largest marginal gains
v(n) − v(n − 1) first is the knapsack's optimum (the paper solves it by dynamic programming).
Budget that buys nothing (every prompt with 0 < p < 1 already at the number of rollouts
that sees both outcomes with probability `confidence`, ⌈log(1 − α) / log max(p, 1 − p)⌉)
goes first to the prompts with p = 0 (the hard ones, round robin up to `max_rows`); what no
live prompt can take goes to them, then to unseen prompts, last to the solved ones.

Layout: the R rollouts are decoded as R flat rows (the sampling cost of i.i.d. groups);
row j of prompt b draws its tokens from the same uniforms as response j of an i.i.d. group
(`sampling.row_uniforms`), so a uniform allocation of G is i.i.d. sampling token for
token. They are returned padded to [B, max_rows, L] with `row_mask` [B, max_rows] (padded
rows: no tokens); estimators registered with `rows=True` (grpo, dr_grpo, rloo) take their
group statistics over each group's rows. Packing (`train.packing`) gives the padded rows no
room in the update.
"""

import functools

import flax.struct as struct
import jax
import jax.numpy as jnp
import numpy as np

from experiments.rollouts import sampling


SUCCESS = 1.0  # a rollout with reward >= SUCCESS counts as a success (binary-reward tasks)


@struct.dataclass
class BudgetedSamples(sampling.Samples):
  """`sampling.Samples` [B, G_max, L] of groups of varying size; `row_mask` [B, G_max]."""
  row_mask: jax.Array


def value(n, p):
  """v(n, p) = (1 − pⁿ − (1 − p)ⁿ) · p (1 − p)² (numpy; 0 at p = 0 or 1)."""
  n, p = np.asarray(n, np.float64), np.asarray(p, np.float64)
  return (1.0 - p ** n - (1.0 - p) ** n) * p * (1.0 - p) ** 2


def allocate(pass_rate, total: int, *, default: int, min_rows: int, max_rows: int,
             confidence: float = 0.9) -> np.ndarray:
  """int32 [B] rollouts per prompt, summing to `total` (module docstring).

  pass_rate: [B] float, a prompt's success fraction at its last visit, < 0 if never seen.
  Ties in marginal gain go to the earlier prompt.
  """
  p = np.asarray(pass_rate, np.float64)
  b = p.shape[0]
  if not min_rows <= default <= max_rows or total > b * max_rows or total < b * min_rows:
    raise ValueError(f'knapsack allocation: need min_rows <= G <= max_rows and B·min_rows <= '
                     f'R <= B·max_rows; got min {min_rows}, G {default}, max {max_rows}, '
                     f'B {b}, R {total}')
  seen = p >= 0
  live = seen & (p > 0) & (p < 1)
  n = np.where(seen, min_rows, default).astype(np.int64)
  left = total - int(n.sum())
  if left < 0:  # unseen prompts at G and the rest at the floor exceed R: trim the unseen
    for i in np.flatnonzero(~seen)[::-1]:
      cut = min(-left, n[i] - min_rows)
      n[i] -= cut
      left += cut
  # The useful cap of a live prompt: rollouts enough to see both outcomes with probability α.
  q = np.clip(np.maximum(p, 1.0 - p), 1e-12, 1.0 - 1e-12)
  useful = np.clip(np.ceil(np.log(1.0 - confidence) / np.log(q)), min_rows, max_rows)
  spare = left - int(np.sum(np.where(live, useful - min_rows, 0)))
  hard = np.flatnonzero(seen & (p == 0))
  if spare > 0 and hard.size:  # the paper's fallback: surplus to the prompts never solved
    give = _round_robin(max_rows - n[hard], spare)
    n[hard] += give
    left -= int(give.sum())
  if left > 0 and live.any():  # greedy on marginal gains = the concave knapsack's optimum
    ks = np.arange(1, max_rows + 1)
    gains = value(ks[None, :], p[live, None]) - value(ks[None, :] - 1, p[live, None])
    gains = np.where((ks[None, :] > n[live, None]) & (ks[None, :] <= max_rows), gains, -np.inf)
    flat = gains.ravel()
    take = np.argsort(-flat, kind='stable')[:left]
    take = take[np.isfinite(flat[take])]
    n[np.flatnonzero(live)] += np.bincount(take // max_rows, minlength=int(live.sum()))
    left = total - int(n.sum())
  for group in (hard, np.flatnonzero(~seen), np.flatnonzero(p >= 1)):  # what is still over
    if left > 0 and group.size:
      give = _round_robin(max_rows - n[group], left)
      n[group] += give
      left -= int(give.sum())
  return n.astype(np.int32)


def _round_robin(room, amount: int):
  """int [K]: `amount` units (at most the room there is) dealt one at a time over the slots
  with room left."""
  give = np.zeros_like(room)
  amount = min(int(amount), int(np.sum(room)))
  while amount > 0:
    open_ = np.flatnonzero(give < room)
    k = min(amount, open_.size)
    give[open_[:k]] += 1
    amount -= k
  return give


def update_pass_rates(pass_rate, prompt_ids, rewards, row_mask):
  """pass_rate [N] with each drawn prompt's success fraction over its rows (jnp)."""
  ok = (rewards >= SUCCESS) & row_mask
  rate = jnp.sum(ok, -1) / jnp.maximum(jnp.sum(row_mask, -1), 1)
  return pass_rate.at[prompt_ids].set(rate.astype(pass_rate.dtype))


def signal(rewards, row_mask=None):
  """(fraction of groups, fraction of rollouts) in groups whose rows' rewards differ (the
  ones with a non-zero GRPO gradient; numpy)."""
  r = np.asarray(rewards)
  m = np.ones(r.shape, bool) if row_mask is None else np.asarray(row_mask)
  differs = np.where(m, r, -np.inf).max(-1) > np.where(m, r, np.inf).min(-1)
  return float(np.mean(differs)), float(np.sum(m * differs[..., None]) / np.sum(m))


def sample_budgeted(params, cfg, key, prompts, sizes, max_rows: int, max_new_tokens: int, *,
                    temperature=1.0, top_p=1.0, top_k=0, eos_id=None, pad_id: int = 0,
                    prompt_len=None, prompt_ids=None) -> BudgetedSamples:
  """Responses 0 .. sizes[b] − 1 of each prompt b (sizes: host ints, sum R fixed per run so
  the decode compiles once) -> `BudgetedSamples` [B, max_rows, L]."""
  sizes = np.asarray(sizes, np.int64)
  b = prompts.shape[0]
  if sizes.shape != (b,) or sizes.min() < 0 or sizes.max() > max_rows:
    raise ValueError(f'sizes must be [B] = [{b}] in [0, {max_rows}]; got {sizes}')
  owner = np.repeat(np.arange(b), sizes).astype(np.int32)        # [R] the row's prompt
  slot = (np.arange(owner.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)).astype(np.int32)
  prompts, prompt_len, prompt_ids, knobs = sampling._inputs(
      cfg, max_new_tokens, prompts, prompt_len, prompt_ids, temperature, top_k, top_p)
  u = _row_uniforms(key, prompt_ids[owner], jnp.asarray(slot), length=max_new_tokens)[:, None]
  state = sampling._start(params, prompts[owner], u, prompt_len[owner], cfg=cfg, pad_id=pad_id)
  state = sampling._decode(params, state, max_new_tokens, knobs, cfg=cfg, eos_id=eos_id)
  flat = sampling._to_samples(state, owner.size)                  # [R, 1, L]
  return _pad(flat, jnp.asarray(owner * max_rows + slot), b=b, g=max_rows, pad_id=pad_id)


_row_uniforms = jax.jit(sampling.row_uniforms, static_argnames='length')


@functools.partial(jax.jit, static_argnames=('b', 'g', 'pad_id'))
def _pad(flat, where, *, b: int, g: int, pad_id: int):
  """Scatters the flat rows [R, 1, L] to [B, G_max, L] at `where` = b·G_max + slot."""

  def put(x, fill):
    out = jnp.full((b * g,) + x.shape[2:], fill, x.dtype)
    return out.at[where].set(x[:, 0]).reshape((b, g) + x.shape[2:])

  rows = jnp.zeros((b * g,), bool).at[where].set(True).reshape(b, g)
  return BudgetedSamples(tokens=put(flat.tokens, pad_id), logprobs=put(flat.logprobs, 0.0),
                         entropy=put(flat.entropy, 0.0), mask=put(flat.mask, False),
                         parent=jnp.full((b, g), -1, jnp.int32),
                         fork=jnp.zeros((b, g), jnp.int32), row_mask=rows)

