"""The RL step's optional parts as passes (docs/trainer.md): `PIPELINE` in execution order;
`select` picks a run's, `check` runs their checks before any work, `providers` says who
computes each key of `credit.NEEDS`."""

import credit
from experiments.training.passes.base import Carry, Pass, Step  # noqa: F401
from experiments.training.passes.credit_state import CreditState
from experiments.training.passes.critic import Critic
from experiments.training.passes.experience import Experience
from experiments.training.passes.imitation import ExpertSFT, InterventionPhase
from experiments.training.passes.inputs import (ContextLogprobs, Entropy, Hindsight,
                                                HiddenStates, ProcessRewards, PromptLogprobs,
                                                Reference, ReferenceSamples, Saliency,
                                                SelfHindsight, StepProbes, Turns)
from experiments.training.passes.knapsack import Knapsack
from experiments.training.passes.off_policy import Lagged, PromptPool, Replay

# Hooks run in this order; it is today's (and a dependency order: process rewards before
# the probes, self-hindsight and the critic, which read the step ends or token rewards).
PIPELINE = (PromptPool, Lagged, Replay, Knapsack, Experience, Entropy, PromptLogprobs,
            ContextLogprobs, Hindsight, Saliency, CreditState, Critic, Reference,
            ProcessRewards, StepProbes, SelfHindsight, Turns, InterventionPhase, ExpertSFT,
            ReferenceSamples, HiddenStates)
# Checkpoint keys of the loop state, in the order checkpoints have always listed them.
STATE_KEYS = ('credit_state', 'critic', 'replay', 'behaviour', 'expert_opt', 'pass_rate',
              'library')
# Needs no pass provides: `logprobs` (rl_step's old log-probs, always computed) and the
# Turns fields (the multi-turn problem, `AgentProblem.turns`).
CORE = ('logprobs',)
_REGISTERED = []  # (pass class, the pass it runs after or None: last), `register`


def register(cls, after=None) -> None:
  """Adds a pass from outside experiments/ (a new paper's part) to the pipeline, right after
  pass class `after` (None: at the end). Its `provides` must be declared needs
  (`credit.vocabulary.declare`) that no other pass provides."""
  if not (isinstance(cls, type) and issubclass(cls, Pass)):
    raise TypeError(f'{cls!r} is not a subclass of passes.Pass')
  taken = providers()
  for key in cls.provides:
    if key not in credit.NEEDS:
      raise ValueError(f'pass {cls.__name__} provides {key!r}, which is not a declared need '
                       f'(credit.vocabulary.declare)')
    if taken.get(key):
      raise ValueError(f'pass {cls.__name__} provides {key!r}, which {taken[key][0]} provides')
  if cls.state_key is not None and cls.state_key in (
      set(STATE_KEYS) | {p.state_key for p in pipeline()}):
    raise ValueError(f'pass {cls.__name__}: loop state key {cls.state_key!r} is taken')
  _REGISTERED.append((cls, after))


def unregister(cls) -> None:
  _REGISTERED[:] = [(c, a) for c, a in _REGISTERED if c is not cls]


def pipeline() -> tuple:
  """The pass classes in execution order: `PIPELINE` with the registered ones inserted."""
  out = list(PIPELINE)
  for cls, after in _REGISTERED:
    out.insert(out.index(after) + 1 if after is not None else len(out), cls)
  return tuple(out)


def providers() -> dict:
  """{need key: [its providers' names]} over `credit.NEEDS` (each should have one)."""
  from experiments.rollouts.agent_rollouts import AgentProblem
  out = {key: [] for key in credit.NEEDS}
  for key in CORE:
    out[key].append('rl_step')
  for p in pipeline():
    for key in p.provides:
      out.setdefault(key, []).append(p.__name__)
  for key in AgentProblem.TURN_FIELDS:
    out.setdefault(key, []).append('AgentProblem.turns')
  return out


def selected(cfg) -> tuple:
  """The pass classes that apply to cfg (its estimator's needs and config fields)."""
  needs = credit.needs(cfg.credit.name)
  return tuple(p for p in pipeline() if p.applies(cfg, needs))


def check(cfg, kind: str, caps) -> None:
  """Every selected pass's checks, in pipeline order, then that something provides each of
  the estimator's needs (ValueError naming the estimator and the key)."""
  from experiments.rollouts.agent_rollouts import AgentProblem
  needs = credit.needs(cfg.credit.name)
  chosen = selected(cfg)
  for p in chosen:
    p.check(cfg, needs, kind, caps)
  provided = set(CORE) | {key for p in chosen for key in p.provides}
  if 'turns' in caps:
    provided |= set(AgentProblem.TURN_FIELDS)
  missing = [key for key in needs if key not in provided]
  if missing:
    key = missing[0]
    who = ', '.join(providers().get(key, [])) or 'nothing'
    raise ValueError(f'credit {cfg.credit.name!r} needs {key!r} ({credit.NEEDS[key].doc}), '
                     f'which nothing provides for this run (its provider: {who})')


def select(cfg, hparams: dict) -> tuple:
  """The run's pass instances, in pipeline order."""
  return tuple(p(cfg, hparams) for p in selected(cfg))
