"""Credit estimators by name: `fn(rollouts, **hparams) -> advantages [..., G, L]`.

An estimator may declare the optional `Rollouts` fields it `needs` (so a
training loop knows to compute, e.g., reference log-probs or a task's process
rewards and step ends) and a `loss_mask`
function `(rollouts, advantages, **hparams) -> bool [..., G, L]` for methods
that also take tokens out of the policy loss (SPO's probability mask).

A stateful estimator (a pass-rate EMA, a curriculum, a closed-loop entropy target)
registers `state=(init, update)`: `init(**hparams)` gives the first state pytree (static
shapes; an `init` that takes `prompts` keeps a history per prompt of a fixed pool, read
through `Rollouts.prompt_ids`), `update(state, rollouts, **hparams)` the next one. The
estimator itself keeps the one signature and reads the state before this batch from
`rollouts.credit_state`; the loop calls `update` after the advantages, carries the state in
its checkpointed loop state, so a resumed run is exact.

Rollouts with a `row_mask` (groups of varying size padded to G) go only to estimators
registered with `rows=True`, whose group statistics skip the padded rows; any other raises
a ValueError naming it, and every estimator's advantages are 0 on padded rows.

Rollouts with a `policy_mask` (multi-turn trajectories: observations are context,
actions are trained) get advantages 0 off it from every registered estimator, and
`loss_mask` keeps only its tokens; the estimators themselves see whole trajectories.
"""

import functools
import inspect
from typing import Callable, Optional

import jax.numpy as jnp

from credit import vocabulary

_REGISTRY: dict[str, Callable] = {}
_NEEDS: dict[str, tuple[str, ...]] = {}
_LOSS_MASKS: dict[str, Callable] = {}
_STATES: dict[str, tuple[Callable, Callable]] = {}
_ROWS: set[str] = set()
_PER_PROMPT: set[str] = set()  # stateful, with an `init` that takes `prompts`
# verl's `adv_estimator` names (verl/trainer/ppo/core_algos.py) for the same methods, accepted
# wherever a name is; where our numbers differ, docs/conventions.md says why.
ALIASES = {
    'reinforce_plus_plus': 'reinforce_pp',
    'reinforce_plus_plus_baseline': 'reinforce_pp_baseline',
    'rloo_vectorized': 'rloo',
    'grpo_vectorized': 'grpo',
}


def canonical(name: str) -> str:
  """The registered name for `name` (itself, or the estimator an alias names)."""
  return ALIASES.get(name, name)


def register(name: str, needs: tuple[str, ...] = (), loss_mask: Optional[Callable] = None,
             state: Optional[tuple[Callable, Callable]] = None, rows: bool = False,
             **defaults):
  """Registers an estimator under `name`; `defaults` pre-bind hyperparameters; `state`
  is `(init, update)` for an estimator that carries state across steps; `rows` says it
  honours `Rollouts.row_mask` (groups of varying size)."""

  vocabulary.check(name, needs)  # a misspelt need fails here, not in a training run

  def decorator(fn):
    if name in _REGISTRY or name in ALIASES:
      raise ValueError(f"credit estimator {name!r} is already registered"
                       f"{' (an alias)' if name in ALIASES else ''}.")

    @functools.wraps(fn)
    def estimator(rollouts, **hparams):
      if rollouts.row_mask is not None and not rows:
        raise ValueError(f"credit estimator {name!r} does not support groups of varying size "
                         f"(Rollouts.row_mask); the ones that do: {', '.join(row_masked())}.")
      adv = fn(rollouts, **{**defaults, **hparams})
      if rollouts.row_mask is not None:
        adv = jnp.where(rollouts.row_mask[..., None], adv, 0.0)
      if rollouts.policy_mask is None:
        return adv
      return jnp.where(rollouts.policy_mask, adv, 0.0)

    if defaults:
      estimator.__doc__ = f"`{fn.__name__}` with {defaults}.\n\n{fn.__doc__}"
      estimator.__name__ = name
      sig = inspect.signature(fn)  # the pre-bound defaults, as callers see them
      estimator.__signature__ = sig.replace(parameters=[
          p.replace(default=defaults[p.name]) if p.name in defaults else p
          for p in sig.parameters.values()])
    _REGISTRY[name] = estimator
    _NEEDS[name] = tuple(needs)
    if rows:
      _ROWS.add(name)
    if loss_mask is not None:
      _LOSS_MASKS[name] = lambda rollouts, adv, **hp: loss_mask(rollouts, adv,
                                                                **{**defaults, **hp})
    if state is not None:
      init, update = state
      _STATES[name] = (lambda **hp: init(**{**defaults, **hp}),
                       lambda st, rollouts, **hp: update(st, rollouts, **{**defaults, **hp}))
      if 'prompts' in inspect.signature(init).parameters:
        _PER_PROMPT.add(name)
    return fn

  return decorator


def unregister(name: str) -> None:
  """Removes estimator `name` (one registered by code outside this library, e.g. a test's)."""
  for table in (_REGISTRY, _NEEDS, _LOSS_MASKS, _STATES):
    table.pop(name, None)
  _ROWS.discard(name)
  _PER_PROMPT.discard(name)


def get(name: str) -> Callable:
  """The estimator registered as `name`; raises ValueError listing the valid names."""
  try:
    return _REGISTRY[canonical(name)]
  except KeyError:
    raise ValueError(f"unknown credit estimator {name!r}; valid names: {', '.join(names())}."
                     ) from None


def names() -> list[str]:
  """The registered estimator names, sorted."""
  return sorted(_REGISTRY)


def hparam_names(name: str) -> Optional[tuple[str, ...]]:
  """The hyperparameters estimator `name` takes (its keyword arguments after `rollouts`);
  None when it takes any (`**kwargs`)."""
  params = list(inspect.signature(get(name)).parameters.values())[1:]
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return None
  return tuple(p.name for p in params)


def check_hparams(name: str, hparams) -> None:
  """Raises ValueError naming the keys of `hparams` that estimator `name` does not take,
  before any work (the estimator itself would raise a TypeError only when first called)."""
  valid = hparam_names(name)
  unknown = sorted(set(hparams) - set(valid)) if valid is not None else []
  if unknown:
    raise ValueError(f"credit estimator {name!r} takes no hyperparameter {', '.join(unknown)} "
                     f"(credit.hparams is passed to every method of a run); its "
                     f"hyperparameters: {', '.join(valid) or 'none'}.")


def row_masked() -> list[str]:
  """The estimators that accept groups of varying size (`Rollouts.row_mask`), sorted."""
  return sorted(_ROWS)


def needs(name: str) -> tuple[str, ...]:
  """The optional `Rollouts` fields estimator `name` reads (e.g. ('ref_logprobs',))."""
  get(name)
  return _NEEDS[canonical(name)]


def loss_mask(name: str, rollouts, advantages, **hparams):
  """bool [..., G, L]: the tokens estimator `name` keeps in the policy loss
  (`rollouts.trained_mask`, the policy's tokens, unless it registered a `loss_mask`,
  which is then restricted to them)."""
  get(name)
  name = canonical(name)
  if name not in _LOSS_MASKS:
    return rollouts.trained_mask
  return _LOSS_MASKS[name](rollouts, advantages, **hparams) & rollouts.trained_mask


def has_loss_mask(name: str) -> bool:
  """Whether estimator `name` takes tokens out of the policy loss (`register(loss_mask=)`)."""
  get(name)
  return canonical(name) in _LOSS_MASKS


def stateful(name: str) -> bool:
  """Whether estimator `name` carries state across training steps (`register(state=)`)."""
  get(name)
  return canonical(name) in _STATES


def per_prompt(name: str) -> bool:
  """Whether estimator `name` can keep a history per prompt (its state `init` takes
  `prompts`): with prompts that recur (a fixed pool, `Rollouts.prompt_ids`)."""
  get(name)
  return canonical(name) in _PER_PROMPT


def init_state(name: str, prompts: int = 0, **hparams):
  """The first `credit_state` of estimator `name` (None for a stateless one). `prompts` > 0:
  the size of a fixed prompt pool, for an estimator that keeps a history per prompt
  (`per_prompt`; it then reads `Rollouts.prompt_ids`); 0: prompts drawn fresh each step."""
  get(name)
  if int(prompts) != prompts or prompts < 0:
    raise ValueError(f"prompts must be a non-negative integer; got {prompts}.")
  if prompts and per_prompt(name):
    hparams = dict(hparams, prompts=int(prompts))
  name = canonical(name)
  return _STATES[name][0](**hparams) if name in _STATES else None


def update_state(name: str, state, rollouts, **hparams):
  """The state after this batch (`rollouts`, with the advantages already taken from
  `state`); None for a stateless estimator."""
  get(name)
  name = canonical(name)
  return _STATES[name][1](state, rollouts, **hparams) if name in _STATES else None
