"""Tasks by name: `get(name, **kwargs)` and `names()`."""

import dataclasses

from envs import addition, base, countdown, countdown_steps, scratchpad_addition, token_tree

_TASKS: dict[str, type[base.Task]] = {
    cls.name: cls for cls in (addition.Addition, countdown.Countdown, token_tree.TokenTree,
                              scratchpad_addition.ScratchpadAddition,
                              countdown_steps.CountdownSteps)
}


def names() -> tuple[str, ...]:
  """The registered task names, sorted."""
  return tuple(sorted(_TASKS))


def get(name: str, **kwargs) -> base.Task:
  """The task `name` with hyperparameters `kwargs` (the task's dataclass fields).

  Raises:
    ValueError: for an unknown name, an unknown keyword, or an invalid value.
  """
  if name not in _TASKS:
    raise ValueError(f"unknown task {name!r}; valid names: {', '.join(names())}.")
  cls = _TASKS[name]
  fields = {f.name: f.default for f in dataclasses.fields(cls)}
  unknown = sorted(set(kwargs) - set(fields))
  if unknown:
    valid = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    raise ValueError(f"unknown argument(s) {', '.join(unknown)} for task {name!r}; "
                     f"valid arguments (with defaults): {valid}.")
  return cls(**kwargs)
