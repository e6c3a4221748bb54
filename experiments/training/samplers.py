"""The samplers the loop draws a step's rollouts from: a registry by `sampler.name`.

Each `Sampler` declares the config fields it reads (the rest are not fingerprinted), its
rollouts per prompt, the problem kinds it plays ('jax', 'text', 'agent') and the problem
capabilities it requires (`problems.capabilities`), whether its groups are explicit trees,
its own config checks and metric-row fields. A multi-turn problem samples its own episodes
(capability 'own_sampler'); its samplers' `fn` is not called.
"""

import dataclasses
from typing import Callable, Optional

import numpy as np

import credit
from configs import tempo as default_config
from experiments.rollouts import branching, sampling
from experiments.rollouts import knapsack as knapsack_lib
from experiments.rollouts import step_forks
from experiments.training import hints as hints_lib
from experiments.training.forward import group_process_rewards, group_rewards

COMMON_FIELDS = ('name', 'temperature', 'top_p', 'top_k')


@dataclasses.dataclass(frozen=True)
class Sampler:
  """fn(params, pcfg, task, scfg, key, prompts, kw, ctx) -> Samples [B, G, L]: `kw` the
  decoding options (`sampling.sample_iid`'s keywords), `ctx` the step's `info`,
  `progress` and `group_sizes`. `check(cfg, jax_task, credit_name)` raises ValueError."""
  fields: tuple[str, ...]
  group_size: Callable
  fn: Optional[Callable]
  problems: frozenset
  tree: bool
  requires: frozenset = frozenset()
  refusal: str = ''  # the error when the problem's kind or capabilities do not fit
  check: Optional[Callable] = None
  row_fields: Callable = lambda samples: {}


def _iid(params, pcfg, task, scfg, key, prompts, kw, ctx):
  return sampling.sample_iid(params, pcfg, key, prompts, scfg.group_size, task.response_len,
                             **kw)


def _tree_fixed(params, pcfg, task, scfg, key, prompts, kw, ctx):
  return sampling.sample_tree_fixed(params, pcfg, key, prompts, tuple(scfg.branching),
                                    scfg.segment_len, task.response_len, **kw)


def _tree_entropy(params, pcfg, task, scfg, key, prompts, kw, ctx):
  return sampling.sample_tree_entropy(params, pcfg, key, prompts, scfg.num_chains,
                                      scfg.num_forks, scfg.num_continuations,
                                      task.response_len, score=scfg.score, **kw)


def _forks(make):
  def fn(params, pcfg, task, scfg, key, prompts, kw, ctx):
    return sampling.sample_tree_forks(params, pcfg, key, prompts, scfg.num_chains,
                                      task.response_len, make(scfg), **kw)
  return fn


def _step_kw(task, prompts, info):
  jax_task = getattr(task, 'task', task)
  return jax_task, dict(
      num_steps=int(jax_task.reasoning_steps),
      ends_fn=lambda t, m: group_process_rewards(prompts, t, m, info, task=jax_task)[1])


def _tree_bisect(params, pcfg, task, scfg, key, prompts, kw, ctx):
  """Rounds of forks at the task's step ends, each decided by the last round's rewards."""
  jax_task, steps = _step_kw(task, prompts, ctx['info'])
  reward_fn = lambda t, m: group_rewards(prompts, t, m, ctx['info'], task=jax_task)
  return step_forks.sample_bisect(
      params, pcfg, key, prompts, scfg.num_chains, scfg.num_rounds, scfg.num_continuations,
      task.response_len, reward_fn=reward_fn, **steps, **kw)[0]


def _tree_steps(params, pcfg, task, scfg, key, prompts, kw, ctx):
  """Each level forks every response at its next step end."""
  _, steps = _step_kw(task, prompts, ctx['info'])
  return step_forks.sample_step_tree(
      params, pcfg, key, prompts, scfg.num_chains, scfg.num_levels, scfg.num_continuations,
      task.response_len, **steps, **kw)


def _hinted(params, pcfg, task, scfg, key, prompts, kw, ctx):
  return hints_lib.sample_hinted(
      params, key, prompts, ctx['info'], ctx['progress'], pcfg=pcfg,
      task=getattr(task, 'task', task), group_size=scfg.group_size,
      hint_rows=scfg.hint_rows, schedule=scfg.hint_schedule,
      temperature=float(kw['temperature']), top_p=float(scfg.top_p), top_k=int(scfg.top_k))


def _knapsack(params, pcfg, task, scfg, key, prompts, kw, ctx):
  sizes = ctx['group_sizes']
  if sizes is None:
    sizes = np.full((prompts.shape[0],), scfg.group_size)
  return knapsack_lib.sample_budgeted(params, pcfg, key, prompts, sizes, scfg.max_group,
                                      task.response_len, **kw)


_STEPS = ('sampler {name!r} works on the reasoning steps of a JAX chain-of-thought task with '
          '`reasoning_steps` (scratch_add, countdown_steps); task {task!r} has none')
_MULTI_TURN = "sampler {name!r} does not play multi-turn environments; valid: {valid}"


def _check_levels(cfg, jax_task, credit_name):
  if cfg.sampler.num_levels > jax_task.reasoning_steps:
    raise ValueError(f'sampler.num_levels = {cfg.sampler.num_levels} is more than task '
                     f'{cfg.task.name!r} has reasoning steps to fork at')


def _check_schedule(cfg, jax_task, credit_name):
  if cfg.sampler.hint_schedule not in hints_lib.SCHEDULES:
    raise ValueError(f'unknown sampler.hint_schedule {cfg.sampler.hint_schedule!r}; valid: '
                     f'{", ".join(hints_lib.SCHEDULES)}')


def _check_knapsack(cfg, jax_task, credit_name):
  if credit_name not in credit.row_masked():
    raise ValueError(f"credit {credit_name!r} does not support groups of varying size (sampler "
                     f"'knapsack'); the ones that do: {', '.join(credit.row_masked())}")
  s = cfg.sampler
  if not s.min_group <= s.group_size <= s.max_group:
    raise ValueError(f"sampler 'knapsack' needs sampler.min_group <= group_size <= max_group; "
                     f'got {s.min_group}, {s.group_size}, {s.max_group}')
  if cfg.loss.agg != 'token-mean':
    raise ValueError(f"sampler 'knapsack' pads groups of varying size with empty rows, which "
                     f"loss.agg {cfg.loss.agg!r} would count as sequences; use 'token-mean'")


_G = lambda scfg: scfg.group_size
_CHAINS = lambda scfg: scfg.num_chains * (1 + scfg.num_forks * scfg.num_continuations)
_FORKS = ('num_chains', 'num_forks', 'num_continuations')
_ANY, _SINGLE = frozenset({'jax', 'text', 'agent'}), frozenset({'jax', 'text'})
_JAX, _AGENT = frozenset({'jax'}), frozenset({'agent'})
_STEP_CAPS = frozenset({'reasoning_steps'})

REGISTRY = {
    'iid': Sampler(('group_size',), _G, _iid, _ANY, tree=False),
    'tree_fixed': Sampler(('branching', 'segment_len'), lambda s: int(np.prod(s.branching)),
                          _tree_fixed, _SINGLE, tree=True),
    'tree_entropy': Sampler(_FORKS + ('score',), _CHAINS, _tree_entropy, _SINGLE, tree=True),
    'tree_cutpoints': Sampler(
        _FORKS + ('cut_threshold', 'cut_every'), _CHAINS,
        _forks(lambda s: sampling.CutpointForks(s.num_forks, s.num_continuations,
                                                s.cut_threshold, s.cut_every)),
        _SINGLE, tree=True),
    'tree_turns': Sampler(('num_chains', 'num_continuations', 'fork_turn'),
                          lambda s: s.num_chains * (1 + s.num_continuations), None, _AGENT,
                          tree=True, refusal="sampler 'tree_turns' forks multi-turn episodes; "
                          "use it with a multi-turn environment (configs/agents.py)"),
    'lagged': Sampler(('group_size', 'lag'), _G, _iid, _SINGLE, tree=False),
    'hinted': Sampler(('group_size', 'hint_rows', 'hint_schedule'), _G, _hinted, _JAX,
                      tree=False, requires=_STEP_CAPS, refusal=_STEPS, check=_check_schedule,
                      row_fields=lambda samples: dict(hint_tokens=float(samples.hint_len.sum()))),
    'tree_bisect': Sampler(('num_chains', 'num_rounds', 'num_continuations'),
                           lambda s: step_forks.group_size(s.num_chains, s.num_rounds,
                                                           s.num_continuations),
                           _tree_bisect, _JAX, tree=True, requires=_STEP_CAPS, refusal=_STEPS),
    'tree_steps': Sampler(('num_chains', 'num_levels', 'num_continuations'),
                          lambda s: step_forks.step_tree_size(s.num_chains, s.num_levels,
                                                              s.num_continuations),
                          _tree_steps, _JAX, tree=True, requires=_STEP_CAPS, refusal=_STEPS,
                          check=_check_levels),
    'knapsack': Sampler(('group_size', 'min_group', 'max_group'), _G, _knapsack, _SINGLE,
                        tree=False, check=_check_knapsack),
    'tree_branching': Sampler(  # APPO's Branching Score (#35)
        _FORKS + ('branch_window', 'branch_candidates'), _CHAINS,
        _forks(lambda s: branching.BranchingForks(s.num_forks, s.num_continuations,
                                                  s.branch_window, s.branch_candidates)),
        _SINGLE, tree=True),
    'experience': Sampler(('group_size', 'admit', 'min_count', 'max_new', 'ema',
                           'failure_patterns'), _G, None, _AGENT, tree=False,
                          requires=frozenset({'experience'}),
                          refusal="sampler 'experience' (SLEA-RL) retrieves experiences at every "
                          "turn of a multi-turn environment (configs/agents.py, "
                          "agent.experience_slots)"),
}
assert tuple(REGISTRY) == default_config.SAMPLERS, 'configs/tempo.SAMPLERS vs the registry'


def get(name: str) -> Sampler:
  if name not in REGISTRY:
    raise ValueError(f'unknown sampler {name!r}; valid: {", ".join(default_config.SAMPLERS)}')
  return REGISTRY[name]


def check(cfg, credit_name: str, name: str, kind: str, capabilities, jax_task=None):
  """Raises ValueError if sampler `name` does not fit the problem (its `kind`, 'jax', 'text'
  or 'agent', and `capabilities`), the estimator or the config; `jax_task` for a JAX task."""
  sampler = get(name)
  if kind == 'agent' and kind not in sampler.problems:
    valid = ', '.join(n for n, s in REGISTRY.items() if 'agent' in s.problems)
    raise ValueError(_MULTI_TURN.format(name=name, valid=valid))
  if kind not in sampler.problems or not sampler.requires <= set(capabilities):
    raise ValueError(sampler.refusal.format(name=name, task=cfg.task.name))
  if sampler.check is not None:
    sampler.check(cfg, jax_task, credit_name)


def group_size(scfg) -> int:
  """Rollouts per prompt ('knapsack': the mean; its groups are padded to max_group)."""
  return get(scfg.name).group_size(scfg)


def sample(params, pcfg, task, scfg, key, prompts, prompt_ids=None, temperature=None,
           prompt_len=None, info=None, progress: float = 0.0, group_sizes=None):
  """Samples [B, G, L] from the sampler named in scfg.

  `task`: anything with eos_id, pad_id, response_len (a JAX task or a problem). 'hinted'
  also reads the prompts' `info` and the run's `progress` (step / steps), 'tree_bisect'
  and 'tree_steps' their `info` (the step ends, and the rewards of each round of forks),
  'knapsack' the rollouts of each prompt, `group_sizes` [B] (host ints; G each if None).
  """
  sampler = get(scfg.name)
  if sampler.fn is None:
    raise ValueError(f'sampler {scfg.name!r} forks multi-turn episodes: the multi-turn '
                     f'problem samples them (problem.sample)')
  kw = dict(temperature=scfg.temperature if temperature is None else temperature,
            top_p=scfg.top_p, top_k=scfg.top_k, eos_id=task.eos_id, pad_id=task.pad_id,
            prompt_ids=prompt_ids, prompt_len=prompt_len)
  ctx = dict(info=info, progress=progress, group_sizes=group_sizes)
  return sampler.fn(params, pcfg, task, scfg, key, prompts, kw, ctx)
