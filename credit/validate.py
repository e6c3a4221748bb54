"""Host-side checks of a `Rollouts` batch, with errors that name the problem."""

import jax
import jax.numpy as jnp
import numpy as np

from credit.rollouts import Rollouts
from credit.turns import validate_turns
from trees import explicit
from trees.prefix_tree import as_tokens_and_mask

_PER_TOKEN = ("logprobs", "old_logprobs", "ref_logprobs", "token_rewards", "values", "entropy",
              "context_logprobs", "saliency", "hindsight_logprobs")


def _array(x):
  """jax arrays (tracers included) as they are, anything else through numpy."""
  return x if isinstance(x, jax.Array) else np.asarray(x)


def _concrete(x) -> bool:
  """Values readable here: not a tracer (jit), not sharded over several processes."""
  return not isinstance(x, jax.core.Tracer) and getattr(x, 'is_fully_addressable', True)


def _is_real(dtype, allow_bool: bool) -> bool:
  """Integers or floats (bfloat16 included: jnp.issubdtype knows it, np.issubdtype does not)."""
  return (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
          or (allow_bool and dtype == jnp.bool_))


def validate(rollouts: Rollouts) -> Rollouts:
  """Raises ValueError on malformed rollouts; returns them unchanged otherwise.

  Checks: tokens are integers (fitting int32) and mask boolean, of one shape
  [..., G, L] with G > 0; the mask is one run from position 0; rewards are
  [..., G] real numbers (bool, int or float) and finite in float32; optional
  per-token fields (log-probs, token rewards, values, entropy, context and hindsight
  log-probs, saliency) are int or float of the tokens' shape, finite in float32 on unmasked tokens;
  prompt_logprobs is [..., P] real, finite on `prompt_mask` (bool [..., P]; all of P
  without one); a policy_mask is boolean, of the tokens' shape and inside mask; a row_mask
  is boolean [..., G] and False only on rows with no tokens; prompt_ids are integers [...]
  (one per group), not negative; ref_rewards are [...] real numbers, finite in float32;
  hidden_states are real [..., G, L, D], finite on unmasked tokens; an explicit tree has the tokens' mask; fork edges (parent, fork) come together, integers
  [..., G], each response forked from an earlier one and copying its tokens; step_probes
  are [..., G, S+1] (S >= 1), log-probs and entropies real and finite where their boolean
  mask is True; `turns` (multi-turn trajectories) pass `credit.validate_turns` against the
  tokens. Values are checked only when concrete
  (under jit, or sharded over several hosts: shapes and dtypes only).
  """
  tokens, mask = as_tokens_and_mask(rollouts.tokens, rollouts.mask)
  rewards = _array(rollouts.rewards)
  if rewards.shape != tokens.shape[:-1]:
    raise ValueError(f"rewards must be [..., G] = {tokens.shape[:-1]} to match tokens "
                     f"{tokens.shape}; got {rewards.shape}.")
  if not _is_real(rewards.dtype, allow_bool=True):
    raise ValueError(f"rewards must be real numbers; got dtype {rewards.dtype}.")
  concrete = _concrete(mask)
  if concrete and _concrete(rewards):
    with np.errstate(over='ignore'):  # 1e300 -> inf is the point of the check
      r = np.asarray(rewards, np.float32)  # what the estimators compute with
    if not np.all(np.isfinite(r)):
      bad = tuple(int(i) for i in np.argwhere(~np.isfinite(r))[0])
      raise ValueError(f"rewards must be finite (in float32); rewards{list(bad)} = "
                       f"{np.asarray(rewards)[bad]}.")
  for name in _PER_TOKEN:
    value = getattr(rollouts, name)
    if value is None:
      continue
    value = _array(value)
    if value.shape != tokens.shape:
      raise ValueError(f"{name} must have the tokens' shape {tokens.shape}; got {value.shape}.")
    if not _is_real(value.dtype, allow_bool=False):
      raise ValueError(f"{name} must be real numbers (int or float); got dtype {value.dtype}.")
    if concrete and _concrete(value):
      with np.errstate(over='ignore'):
        finite = np.isfinite(np.asarray(value, np.float32))
      if not np.all(finite | ~np.asarray(mask)):
        raise ValueError(f"{name} has non-finite values on unmasked tokens.")
  _check_prompt(rollouts, tokens.shape[:-2], concrete)
  _check_probes(rollouts.step_probes, tokens.shape[:-1], concrete)
  if rollouts.policy_mask is not None:
    policy = _array(rollouts.policy_mask)
    if policy.shape != tokens.shape or policy.dtype != jnp.bool_:
      raise ValueError(f"policy_mask must be boolean of the tokens' shape {tokens.shape}; got "
                       f"{policy.dtype} {policy.shape}.")
    if concrete and _concrete(policy):
      stray = np.asarray(policy) & ~np.asarray(mask)
      if np.any(stray):
        where = tuple(int(i) for i in np.argwhere(stray)[0])
        raise ValueError(f"policy_mask{list(where)} is True on a token outside mask: policy "
                         f"tokens must be part of the trajectory.")
  if rollouts.row_mask is not None:
    rows = _array(rollouts.row_mask)
    if rows.shape != tokens.shape[:-1] or rows.dtype != jnp.bool_:
      raise ValueError(f"row_mask must be boolean [..., G] = {tokens.shape[:-1]}; got "
                       f"{rows.dtype} {rows.shape}.")
    if concrete and _concrete(rows):
      stray = np.any(np.asarray(mask), -1) & ~np.asarray(rows)
      if np.any(stray):
        where = tuple(int(i) for i in np.argwhere(stray)[0])
        raise ValueError(f"row_mask{list(where)} is False on a row with tokens: a padded row "
                         f"of a group of varying size must have an all-False mask.")
  if rollouts.prompt_ids is not None:
    ids = _array(rollouts.prompt_ids)
    if ids.shape != tokens.shape[:-2] or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"prompt_ids must be integers [...] = {tokens.shape[:-2]}, one per "
                       f"group; got {ids.dtype} {ids.shape}.")
    if _concrete(ids) and np.any(np.asarray(ids) < 0):
      raise ValueError(f"prompt_ids must be pool indices >= 0; got "
                       f"{np.asarray(ids)[np.asarray(ids) < 0][:5].tolist()}.")
  if rollouts.ref_rewards is not None:
    ref = _array(rollouts.ref_rewards)
    if ref.shape != tokens.shape[:-2] or not _is_real(ref.dtype, allow_bool=True):
      raise ValueError(f"ref_rewards must be real numbers [...] = {tokens.shape[:-2]}, one per "
                       f"group; got {ref.dtype} {ref.shape}.")
    if _concrete(ref) and not np.all(np.isfinite(np.asarray(ref, np.float32))):
      raise ValueError("ref_rewards must be finite in float32.")
  if rollouts.hidden_states is not None:
    h = _array(rollouts.hidden_states)
    if (h.ndim != tokens.ndim + 1 or h.shape[:-1] != tokens.shape
        or not _is_real(h.dtype, allow_bool=False)):
      raise ValueError(f"hidden_states must be real [..., G, L, D] with [..., G, L] = "
                       f"{tokens.shape}; got {h.dtype} {h.shape}.")
    if concrete and _concrete(h) and not np.all(
        np.isfinite(np.asarray(h, np.float32)[np.asarray(mask)])):
      raise ValueError("hidden_states must be finite on unmasked tokens.")
  _check_forks(rollouts, tokens, mask, concrete)
  tree = rollouts.tree
  if tree is not None:
    if tree.mask.shape != tokens.shape:
      raise ValueError(f"tree is of shape [..., G, L] = {tree.mask.shape}; the tokens are "
                       f"{tokens.shape}.")
    if concrete and _concrete(tree.mask) and not np.array_equal(
        np.asarray(tree.mask), np.asarray(mask)):
      raise ValueError("tree.mask differs from mask: the tree was built from other responses.")
  if rollouts.turns is not None:
    validate_turns(rollouts.turns, rollouts)
  return rollouts


def _check_forks(rollouts: Rollouts, tokens, mask, concrete: bool):
  """parent / fork: both or neither, integers [..., G], edges `trees.from_forks` accepts."""
  if (rollouts.parent is None) != (rollouts.fork is None):
    raise ValueError("parent and fork come together (a tree sampler's fork edges); got only "
                     "one of them.")
  if rollouts.parent is None:
    return
  parent, fork = _array(rollouts.parent), _array(rollouts.fork)
  for name, x in (('parent', parent), ('fork', fork)):
    if x.shape != tokens.shape[:-1] or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be integers [..., G] = {tokens.shape[:-1]}; got "
                       f"{x.dtype} {x.shape}.")
  if concrete and all(map(_concrete, (tokens, mask, parent, fork))):
    explicit.check_edges(np.asarray(tokens), np.asarray(mask), np.asarray(parent),
                         np.asarray(fork))


def _check_prompt(rollouts: Rollouts, lead: tuple, concrete: bool):
  """prompt_logprobs [..., P] (leading dims the groups') and its optional prompt_mask."""
  plp, pmask = rollouts.prompt_logprobs, rollouts.prompt_mask
  if plp is None:
    if pmask is not None:
      raise ValueError("prompt_mask is given without prompt_logprobs.")
    return
  plp = _array(plp)
  if plp.ndim != len(lead) + 1 or plp.shape[:-1] != lead:
    raise ValueError(f"prompt_logprobs must be [..., P] with leading dims {lead}; got "
                     f"{plp.shape}.")
  if not _is_real(plp.dtype, allow_bool=False):
    raise ValueError(f"prompt_logprobs must be real numbers; got dtype {plp.dtype}.")
  on = None
  if pmask is not None:
    pmask = _array(pmask)
    if pmask.shape != plp.shape or pmask.dtype != jnp.bool_:
      raise ValueError(f"prompt_mask must be boolean of prompt_logprobs' shape {plp.shape}; "
                       f"got {pmask.dtype} {pmask.shape}.")
    on = np.asarray(pmask) if _concrete(pmask) else None
  if concrete and _concrete(plp):
    with np.errstate(over='ignore'):
      finite = np.isfinite(np.asarray(plp, np.float32))
    if not np.all(finite | (False if on is None else ~on)):
      where = tuple(int(i) for i in np.argwhere(~finite if on is None else ~finite & on)[0])
      raise ValueError(f"prompt_logprobs{list(where)} is not finite"
                       + (" on a scored prompt token." if on is not None else "."))



def _check_probes(probes, lead: tuple, concrete: bool):
  """`StepProbes` [..., G, S+1] of the groups' responses [..., G] = lead."""
  if probes is None:
    return
  m = _array(probes.mask)
  if m.dtype != jnp.bool_ or m.ndim != len(lead) + 1 or m.shape[:-1] != lead or m.shape[-1] < 2:
    raise ValueError(f"step_probes.mask must be boolean [..., G, S+1] with [..., G] = {lead} "
                     f"and S >= 1; got {m.dtype} {m.shape}.")
  for name in ("logprobs", "entropy"):
    x = _array(getattr(probes, name))
    if x.shape != m.shape or not _is_real(x.dtype, allow_bool=False):
      raise ValueError(f"step_probes.{name} must be real of the probe mask's shape {m.shape}; "
                       f"got {x.dtype} {x.shape}.")
    if concrete and _concrete(x) and _concrete(m):
      with np.errstate(over='ignore'):
        bad = ~np.isfinite(np.asarray(x, np.float32)) & np.asarray(m)
      if np.any(bad):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"step_probes.{name}{list(where)} is not finite on a probe that exists.")
