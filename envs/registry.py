"""Tasks and multi-turn environments by name: `get(name, **kwargs)`, `names()`;
`get_env(name, **kwargs)`, `env_names()`."""

import dataclasses

from envs import (addition, base, countdown, countdown_steps, exact_mdp, household,
                  household_long, household_retry, multiturn, scratchpad_addition, sokoban,
                  token_tree, webshop)

_TASKS: dict[str, type[base.Task]] = {
    cls.name: cls for cls in (addition.Addition, countdown.Countdown, token_tree.TokenTree,
                              scratchpad_addition.ScratchpadAddition,
                              countdown_steps.CountdownSteps)
}
_ENVS: dict[str, type[multiturn.MultiTurnEnv]] = {
    cls.name: cls for cls in (sokoban.Sokoban, household.Household, exact_mdp.ExactMDP,
                              webshop.WebShop, household_long.HouseholdLong,
                              household_retry.HouseholdRetry)
}


def names() -> tuple[str, ...]:
  """The registered single-turn task names, sorted."""
  return tuple(sorted(_TASKS))


def env_names() -> tuple[str, ...]:
  """The registered multi-turn environment names, sorted."""
  return tuple(sorted(_ENVS))


def _make(table, kind: str, name: str, kwargs):
  if name not in table:
    raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}.")
  cls = table[name]
  fields = {f.name: f.default for f in dataclasses.fields(cls)}
  unknown = sorted(set(kwargs) - set(fields))
  if unknown:
    valid = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    raise ValueError(f"unknown argument(s) {', '.join(unknown)} for {kind} {name!r}; "
                     f"valid arguments (with defaults): {valid}.")
  return cls(**kwargs)


def get(name: str, **kwargs) -> base.Task:
  """The task `name` with hyperparameters `kwargs` (the task's dataclass fields).

  Raises:
    ValueError: for an unknown name, an unknown keyword, or an invalid value.
  """
  return _make(_TASKS, "task", name, kwargs)


def get_env(name: str, **kwargs) -> multiturn.MultiTurnEnv:
  """The multi-turn environment `name` (`envs.multiturn`) with hyperparameters `kwargs`."""
  return _make(_ENVS, "environment", name, kwargs)
