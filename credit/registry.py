"""Credit estimators by name: `fn(rollouts, **hparams) -> advantages [..., G, L]`."""

from typing import Callable

_REGISTRY: dict[str, Callable] = {}


def register(name: str, **defaults):
  """Registers an estimator under `name`; `defaults` pre-bind hyperparameters."""

  def decorator(fn):
    if name in _REGISTRY:
      raise ValueError(f"credit estimator {name!r} is already registered.")
    if defaults:
      def bound(rollouts, **hparams):
        return fn(rollouts, **{**defaults, **hparams})
      bound.__doc__ = f"`{fn.__name__}` with {defaults}.\n\n{fn.__doc__}"
      bound.__name__ = name
      _REGISTRY[name] = bound
    else:
      _REGISTRY[name] = fn
    return fn

  return decorator


def get(name: str) -> Callable:
  """The estimator registered as `name`; raises ValueError listing the valid names."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown credit estimator {name!r}; valid names: {', '.join(names())}."
                     ) from None


def names() -> list[str]:
  """The registered estimator names, sorted."""
  return sorted(_REGISTRY)
