"""Config checks (by name, before any work), builders and run fingerprints of the RL loop."""

import hashlib
import json

import ml_collections

import credit
import envs
from configs import agents as agents_config
from configs import lm as lm_config
from configs import tempo as default_config
from envs import text_tasks
from experiments.models import decoder
from experiments.training import critic as critic_lib
from experiments.training import samplers
from experiments.training import train_step as ts
from experiments.training.methods import parse_methods
from trees import packing as packing_lib


SAMPLERS = default_config.SAMPLERS
# Free-form dicts, validated by credit / envs / the agent problem themselves.
FREE_DICTS = ('credit.hparams', 'task.kwargs', 'agent.lm_aliases')
NOT_FINGERPRINTED = ('quick', 'seeds', 'methods', 'progress', 'eval', 'rl.steps',
                     'rl.ckpt_every', 'mesh', 'log')
# The sampler fields each sampler reads; the others are not part of a run's fingerprint,
# so runs of different scripts that differ only in unused sampler settings can share a workdir.
SAMPLER_FIELDS = {name: s.fields for name, s in samplers.REGISTRY.items()}
# Samplers of G i.i.d. rows per prompt (no explicit tree; `sampler.group_size` rows a group).
IID_SAMPLERS = tuple(name for name, s in samplers.REGISTRY.items() if not s.tree)
SAMPLER_COMMON = samplers.COMMON_FIELDS
group_size = samplers.group_size  # rollouts per prompt of a sampler config
PACKING = packing_lib.MODES + ('none',)


def check_config(cfg, reference=None, prefix=''):
  """Raises ValueError for a field missing from the reference config, listing valid fields.

  Also checks the task (its options included: reasoning-gym's are validated here), sampler,
  credit estimator and loss settings by name, numeric / choice fields by
  `config_rules.RULES` (e.g. optimizer.lr > 0, lm.max_new_tokens >= 1), whether the
  samplers fit the problem (`samplers.check`) and the checks of the passes cfg selects
  (`passes.check`), before any work.
  """
  if reference is None:
    reference = reference_config(cfg)
  for key in cfg.keys():
    path = prefix + key
    if path == 'critic' and key not in reference:  # an optional section (configs/ppo.py)
      bad = sorted(set(cfg.critic.keys()) - set(critic_lib.CONFIG_FIELDS))
      if bad:
        raise ValueError(f'unknown config field critic.{bad[0]}; valid fields of critic: '
                         f'{", ".join(critic_lib.CONFIG_FIELDS)}')
      continue
    if key not in reference:
      raise ValueError(f'unknown config field {path!r}; valid fields'
                       f'{" of " + prefix[:-1] if prefix else ""}: {", ".join(sorted(reference.keys()))}')
    if isinstance(cfg[key], ml_collections.ConfigDict) and path not in FREE_DICTS:
      check_config(cfg[key], reference[key], path + '.')
  if prefix:
    return
  from experiments.training import config_rules, problems  # the value rules (one table)
  config_rules.check_values(cfg)
  jax_task = None  # built once: its options are checked here, its steps below
  if is_text(cfg):
    text_tasks.make_text_task(cfg.task.name, **dict(cfg.task.kwargs))
  elif is_agent(cfg):
    envs.get_env(cfg.task.name, **dict(cfg.task.kwargs))
  else:
    jax_task = envs.get(cfg.task.name, **dict(cfg.task.kwargs))
  credit.get(cfg.credit.name)
  samplers.get(cfg.sampler.name)
  kind, caps = problem_kind(cfg), problems.capabilities(cfg, jax_task)
  for name, sampler, *_ in parse_methods(cfg.methods) + [(cfg.credit.name, cfg.sampler.name)]:
    samplers.check(cfg, name, sampler, kind, caps, jax_task)
  from experiments.training import passes  # each optional part's own checks
  passes.check(cfg, kind, caps)
  loss_config(cfg)
  if cfg.train.packing not in PACKING:
    raise ValueError(f'unknown train.packing {cfg.train.packing!r}; valid: {", ".join(PACKING)}')
  if cfg.train.pack_attention not in packing_lib.ATTENTION:
    raise ValueError(f'unknown train.pack_attention {cfg.train.pack_attention!r}; valid: '
                     f'{", ".join(packing_lib.ATTENTION)}')


def policy_config(cfg, task) -> decoder.PolicyConfig:
  return decoder.PolicyConfig(vocab_size=task.vocab_size, max_len=task.prompt_len + task.response_len,
                             **dict(cfg.model))


def loss_config(cfg) -> ts.LossConfig:
  return ts.LossConfig(**dict(cfg.loss))


def run_config(cfg, run_seed: int):
  """The config one RL run depends on: rl.seed = run_seed, unused sampler fields dropped, and
  the `critic` section dropped when the estimator reads no values (so GRPO runs of
  configs/ppo.py share their workdir with every other script's), its default targets, loss
  and critic_warmup, rl.prompt_pool when 0, sampler.failure_patterns when True and
  sft.hindsight_frac when 0."""
  out = cfg.copy_and_resolve_references()
  out.rl.seed = run_seed
  used = SAMPLER_COMMON + SAMPLER_FIELDS[cfg.sampler.name]
  with out.unlocked():
    for field in [f for f in out.sampler.keys() if f not in used]:
      del out.sampler[field]
    if 'critic' in out and 'values' not in credit.needs(cfg.credit.name):
      del out['critic']
    elif 'critic' in out:  # the defaults: fingerprints of runs before the options
      for field, default in (('targets', 'td_lambda'), ('loss', 'mse'), ('critic_warmup', 0)):
        if out.critic.get(field, None) == default:
          del out.critic[field]
    if not out.rl.get('prompt_pool', 0) and 'prompt_pool' in out.rl:
      del out.rl['prompt_pool']  # fresh prompts: the fingerprint of runs before the option
    if out.sampler.get('failure_patterns', None) is True:  # the default: as before the option
      del out.sampler['failure_patterns']
    _drop_default_sft_fields(out)
  return out


def _drop_default_sft_fields(cfg):
  """Drops sft.hindsight_frac when 0 and agent.experience_slots / experience_cluster when off
  (in place): the fingerprint of runs before them."""
  if 'sft' in cfg and not cfg.sft.get('hindsight_frac', 0.0) and 'hindsight_frac' in cfg.sft:
    del cfg.sft['hindsight_frac']
  if 'agent' in cfg and not cfg.agent.get('experience_slots', 0):
    for field in ('experience_slots', 'experience_cluster'):
      if field in cfg.agent:
        del cfg.agent[field]


def fingerprint(cfg) -> tuple[str, dict]:
  """(sha1, the fingerprinted config as a flat dict)."""
  flat = {}

  def walk(d, prefix):
    for k in sorted(d.keys()):
      path = prefix + k
      if path in NOT_FINGERPRINTED:
        continue
      v = d[k]
      if isinstance(v, (ml_collections.ConfigDict, dict)) and path not in FREE_DICTS:
        walk(v, path + '.')
      else:
        flat[path] = json.loads(json.dumps(v.to_dict() if hasattr(v, 'to_dict') else v,
                                           sort_keys=True, default=str))
  walk(cfg, '')
  blob = json.dumps(flat, sort_keys=True)
  return hashlib.sha1(blob.encode()).hexdigest(), flat


def problem_kind(cfg) -> str:
  """'text', 'agent' or 'jax': the kind of problem cfg builds (`problems.build_problem`)."""
  return 'text' if is_text(cfg) else 'agent' if is_agent(cfg) else 'jax'


def is_text(cfg) -> bool:
  """Text task on a pretrained model (configs/lm.py) rather than a JAX task."""
  return 'lm' in cfg


def is_agent(cfg) -> bool:
  """Multi-turn environment (configs/agents.py) rather than a single-turn task."""
  return 'agent' in cfg


def reference_config(cfg):
  """The config module cfg is an instance of (its valid fields)."""
  if is_text(cfg):
    return lm_config.get_config()
  return agents_config.get_config() if is_agent(cfg) else default_config.get_config()
