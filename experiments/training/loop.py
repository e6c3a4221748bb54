"""The shared RL loop: SFT warm start -> (sample -> rewards -> tree -> credit -> update)*.

    params0 = loop.sft(cfg, workdir + '/sft')              # cached in its workdir
    summary = loop.train(cfg, workdir + '/run', params0, method='tempo:iid')

Each RL step i (all randomness from `fold_in(key(rl.seed), i)`, so a run is a
function of (config, step) and resuming is exact):
  prompts = task.sample(...)                        [B, P]
  samples = sampler(params, prompts)                Samples [B, G, L]
  rewards = task.reward(...)                        [B, G]
  old/ref logprobs by teacher forcing               [B, G, L]  (ratio exactly 1 at first)
  advantages = credit.get(name)(Rollouts(..., tree=trees.from_forks(...) for tree samplers))
  loss mask = credit.loss_mask(name, ...)            (the sampled mask for most estimators)
  state, metrics = train_step(state, batch)
Optional Rollouts inputs are computed only when the estimator `needs` them
(`credit.needs(name)`), so the default path costs nothing extra:
  entropy           the sampler's untempered next-token entropy (`Samples.entropy`; JAX and
                    text tasks); multi-turn samples carry none: a teacher-forced pass
                    (shared with the old log-probs when rl.recompute_logprobs), policy tokens only
  prompt_logprobs   [B, P] one teacher-forced pass over the prompts (`prompt_logprobs`)
  context_logprobs  one teacher-forced pass with the prompt changed (`context_prompts`)
  saliency          one extra backward pass (`experiments/training/saliency.py`)
  step_probes       S + 1 teacher-forced passes scoring the gold continuation after each
                    reasoning step (`experiments/training/probes.py`; JAX CoT tasks)
  hindsight_logprobs  one teacher-forced pass with the task's gold answer after the prompt
                    (`experiments/training/hindsight.py`; JAX CoT tasks); `self_hindsight`:
                    with each group's modal answer instead (SIOP)
  interventions     InT's fine-tuning phase before the first RL step
                    (`experiments/training/interventions.py`; scratch_add)
  expert_sft        DistIL: after each update, one SFT step (its own Adam) on the same
                    interventions of this step's responses
A stateful estimator (`credit.stateful(name)`) gets its state (`credit.init_state`) in
`Rollouts.credit_state`; after the advantages the loop computes `credit.update_state` in
the same jitted call, commits it with the update, logs its scalar leaves as
`credit_state/<path>` and checkpoints it with the train state, so resuming is exact.
The task side is a *problem*: `JaxProblem` (a JAX task, below),
`rollouts.text_rollouts.TextProblem` (a text task on a pretrained model, host-scored) or
`rollouts.agent_rollouts.AgentProblem` (a multi-turn environment: the problem samples its
own episodes, supplies the turn structure, and the step logs environment steps too).
Logs one JSON line per step to <workdir>/metrics.jsonl (step, wall_s, method, timings,
throughput, losses, and greedy_acc / pass@k every eval.every steps), saves orbax
checkpoints to <workdir>/checkpoints/ (every rl.ckpt_every steps, at the end and on
Ctrl-C) together with a config fingerprint; a checkpoint whose fingerprint differs
is refused. `rl.steps`, eval, seeds/methods, quick and progress are not part of
the fingerprint, so a run can be extended by raising `rl.steps`.
"""

import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import time
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

import credit
import envs
import trees
from configs import agents as agents_config
from configs import lm as lm_config
from configs import tempo as default_config
from envs import text_tasks
from experiments.rollouts import agent_rollouts, branching, sampling, text_rollouts
from experiments.rollouts import knapsack as knapsack_lib
from experiments.rollouts import step_forks
from experiments.models import decoder
from experiments.training import critic as critic_lib
from experiments.training import hindsight as hindsight_lib
from experiments.training import hints as hints_lib
from experiments.training import interventions as interventions_lib
from experiments.training import probes as probes_lib
from experiments.training import replay as replay_lib
from experiments.training import saliency as saliency_lib
from experiments.training import train_step as ts
from experiments.training import watchdog
# Re-exported: callers use loop.parse_methods / method_name / with_method.
from experiments.training.methods import method_name, parse_methods, with_method  # noqa: F401
from trees import packing as packing_lib

SAMPLERS = default_config.SAMPLERS
# Free-form dicts, validated by credit / envs / the agent problem themselves.
FREE_DICTS = ('credit.hparams', 'task.kwargs', 'agent.lm_aliases')
NOT_FINGERPRINTED = ('quick', 'seeds', 'methods', 'progress', 'eval', 'rl.steps',
                     'rl.ckpt_every', 'mesh')
# The sampler fields each sampler reads; the others are not part of a run's fingerprint,
# so runs of different scripts that differ only in unused sampler settings can share a workdir.
# Samplers of G i.i.d. rows per prompt (no explicit tree; `sampler.group_size` rows a group).
IID_SAMPLERS = ('iid', 'lagged', 'hinted', 'knapsack', 'experience')
SAMPLER_FIELDS = {
    'iid': ('group_size',),
    'tree_fixed': ('branching', 'segment_len'),
    'tree_entropy': ('num_chains', 'num_forks', 'num_continuations', 'score'),
    'tree_branching': ('num_chains', 'num_forks', 'num_continuations', 'branch_window',
                       'branch_candidates'),
    'tree_cutpoints': ('num_chains', 'num_forks', 'num_continuations', 'cut_threshold',
                       'cut_every'),
    'tree_turns': ('num_chains', 'num_continuations', 'fork_turn'),
    'lagged': ('group_size', 'lag'),
    'hinted': ('group_size', 'hint_rows', 'hint_schedule'),
    'tree_bisect': ('num_chains', 'num_rounds', 'num_continuations'),
    'tree_steps': ('num_chains', 'num_levels', 'num_continuations'),
    'knapsack': ('group_size', 'min_group', 'max_group'),
    'experience': ('group_size', 'admit', 'min_count', 'max_new', 'ema', 'failure_patterns'),
}
PACKING = packing_lib.MODES + ('none',)
SAMPLER_COMMON = ('name', 'temperature', 'top_p', 'top_k')


# ----------------------------------------------------------------------------
# Config checks and builders.


def check_config(cfg, reference=None, prefix=''):
  """Raises ValueError for a field missing from the reference config, listing valid fields.

  Also checks the task (its options included: reasoning-gym's are validated here), sampler,
  credit estimator and loss settings by name, and numeric / choice fields by
  `config_rules.RULES` (e.g. optimizer.lr > 0, lm.max_new_tokens >= 1), before any work.
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
  from experiments.training import config_rules  # the value rules (one table)
  config_rules.check_values(cfg)
  jax_task = None  # built once: its options are checked here, its steps below
  if is_text(cfg):
    text_tasks.make_text_task(cfg.task.name, **dict(cfg.task.kwargs))
  elif is_agent(cfg):
    envs.get_env(cfg.task.name, **dict(cfg.task.kwargs))
  else:
    jax_task = envs.get(cfg.task.name, **dict(cfg.task.kwargs))
  credit.get(cfg.credit.name)
  if cfg.sampler.name not in SAMPLERS:
    raise ValueError(f'unknown sampler {cfg.sampler.name!r}; valid: {", ".join(SAMPLERS)}')
  agent_samplers = agent_rollouts.SAMPLERS
  for name, sampler, *_ in parse_methods(cfg.methods) + [(cfg.credit.name, cfg.sampler.name)]:
    if is_agent(cfg) and sampler not in agent_samplers:
      raise ValueError(f'sampler {sampler!r} does not play multi-turn environments; valid: '
                       f'{", ".join(agent_samplers)}')
    if not is_agent(cfg) and sampler == 'tree_turns':
      raise ValueError("sampler 'tree_turns' forks multi-turn episodes; use it with a "
                       "multi-turn environment (configs/agents.py)")
    if sampler in ('hinted', 'tree_bisect', 'tree_steps') and not hasattr(
        jax_task, 'reasoning_steps'):
      raise ValueError(f"sampler {sampler!r} works on the reasoning steps of a JAX "
                       f"chain-of-thought task with `reasoning_steps` (scratch_add, "
                       f"countdown_steps); task {cfg.task.name!r} has none")
    if sampler == 'tree_steps' and cfg.sampler.num_levels > jax_task.reasoning_steps:
      raise ValueError(f'sampler.num_levels = {cfg.sampler.num_levels} is more than task '
                       f'{cfg.task.name!r} has reasoning steps to fork at')
    if sampler == 'knapsack' and name not in credit.row_masked():
      raise ValueError(f"credit {name!r} does not support groups of varying size (sampler "
                       f"'knapsack'); the ones that do: {', '.join(credit.row_masked())}")
    if sampler == 'knapsack' and not (cfg.sampler.min_group <= cfg.sampler.group_size
                                      <= cfg.sampler.max_group):
      raise ValueError(f"sampler 'knapsack' needs sampler.min_group <= group_size <= max_group; "
                       f'got {cfg.sampler.min_group}, {cfg.sampler.group_size}, '
                       f'{cfg.sampler.max_group}')
    if sampler == 'knapsack' and cfg.loss.agg != 'token-mean':
      raise ValueError(f"sampler 'knapsack' pads groups of varying size with empty rows, which "
                       f"loss.agg {cfg.loss.agg!r} would count as sequences; use 'token-mean'")
    if sampler == 'hinted' and cfg.sampler.hint_schedule not in hints_lib.SCHEDULES:
      raise ValueError(f'unknown sampler.hint_schedule {cfg.sampler.hint_schedule!r}; valid: '
                       f'{", ".join(hints_lib.SCHEDULES)}')
  loss_config(cfg)
  if cfg.train.packing not in PACKING:
    raise ValueError(f'unknown train.packing {cfg.train.packing!r}; valid: {", ".join(PACKING)}')
  if cfg.train.pack_attention not in packing_lib.ATTENTION:
    raise ValueError(f'unknown train.pack_attention {cfg.train.pack_attention!r}; valid: '
                     f'{", ".join(packing_lib.ATTENTION)}')


def build_task(cfg):
  return envs.get(cfg.task.name, **dict(cfg.task.kwargs))


def policy_config(cfg, task) -> decoder.PolicyConfig:
  return decoder.PolicyConfig(vocab_size=task.vocab_size, max_len=task.prompt_len + task.response_len,
                             **dict(cfg.model))


def loss_config(cfg) -> ts.LossConfig:
  return ts.LossConfig(**dict(cfg.loss))


def group_size(scfg) -> int:
  """Rollouts per prompt ('knapsack': the mean; its groups are padded to max_group)."""
  if scfg.name in IID_SAMPLERS:
    return scfg.group_size
  if scfg.name == 'tree_fixed':
    return int(np.prod(scfg.branching))
  if scfg.name == 'tree_turns':
    return scfg.num_chains * (1 + scfg.num_continuations)
  if scfg.name == 'tree_bisect':
    return step_forks.group_size(scfg.num_chains, scfg.num_rounds, scfg.num_continuations)
  if scfg.name == 'tree_steps':
    return step_forks.step_tree_size(scfg.num_chains, scfg.num_levels, scfg.num_continuations)
  return scfg.num_chains * (1 + scfg.num_forks * scfg.num_continuations)


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


# ----------------------------------------------------------------------------
# Jitted pieces (cached on their static arguments).


def sample(params, pcfg, task, scfg, key, prompts, prompt_ids=None, temperature=None,
           prompt_len=None, info=None, progress: float = 0.0, group_sizes=None):
  """Samples [B, G, L] from the sampler named in scfg.

  `task`: anything with eos_id, pad_id, response_len (a JAX task or a problem). 'hinted'
  also reads the prompts' `info` and the run's `progress` (step / steps), 'tree_bisect'
  and 'tree_steps' their `info` (the step ends, and the rewards of each round of forks),
  'knapsack' the rollouts of each prompt, `group_sizes` [B] (host ints; G each if None).
  """
  if scfg.name == 'hinted':
    return hints_lib.sample_hinted(
        params, key, prompts, info, progress, pcfg=pcfg, task=getattr(task, 'task', task),
        group_size=scfg.group_size, hint_rows=scfg.hint_rows, schedule=scfg.hint_schedule,
        temperature=float(scfg.temperature if temperature is None else temperature),
        top_p=float(scfg.top_p), top_k=int(scfg.top_k))
  kw = dict(temperature=scfg.temperature if temperature is None else temperature,
            top_p=scfg.top_p, top_k=scfg.top_k, eos_id=task.eos_id, pad_id=task.pad_id,
            prompt_ids=prompt_ids, prompt_len=prompt_len)
  if scfg.name in ('tree_bisect', 'tree_steps'):  # forks at the task's step boundaries
    jax_task = getattr(task, 'task', task)
    steps = dict(num_steps=int(jax_task.reasoning_steps),
                 ends_fn=lambda t, m: group_process_rewards(prompts, t, m, info, task=jax_task)[1])
    if scfg.name == 'tree_bisect':  # rounds decided by the task's rewards of the last one
      return step_forks.sample_bisect(
          params, pcfg, key, prompts, scfg.num_chains, scfg.num_rounds, scfg.num_continuations,
          task.response_len, reward_fn=lambda t, m: group_rewards(prompts, t, m, info,
                                                                  task=jax_task),
          **steps, **kw)[0]
    return step_forks.sample_step_tree(  # each level forks every response at its next end
        params, pcfg, key, prompts, scfg.num_chains, scfg.num_levels, scfg.num_continuations,
        task.response_len, **steps, **kw)
  r = task.response_len
  if scfg.name == 'knapsack':
    sizes = (np.full((prompts.shape[0],), scfg.group_size) if group_sizes is None
             else group_sizes)
    return knapsack_lib.sample_budgeted(params, pcfg, key, prompts, sizes, scfg.max_group, r,
                                        **kw)
  if scfg.name in ('iid', 'lagged'):  # lagged: the loop passes the behaviour policy's params
    return sampling.sample_iid(params, pcfg, key, prompts, scfg.group_size, r, **kw)
  if scfg.name == 'tree_fixed':
    return sampling.sample_tree_fixed(params, pcfg, key, prompts, tuple(scfg.branching),
                                      scfg.segment_len, r, **kw)
  if scfg.name == 'tree_entropy':
    return sampling.sample_tree_entropy(params, pcfg, key, prompts, scfg.num_chains,
                                        scfg.num_forks, scfg.num_continuations, r,
                                        score=scfg.score, **kw)
  if scfg.name == 'tree_branching':  # APPO's Branching Score (#35)
    forks = branching.BranchingForks(scfg.num_forks, scfg.num_continuations,
                                     scfg.branch_window, scfg.branch_candidates)
    return sampling.sample_tree_forks(params, pcfg, key, prompts, scfg.num_chains, r, forks, **kw)
  if scfg.name == 'tree_cutpoints':
    forks = sampling.CutpointForks(scfg.num_forks, scfg.num_continuations, scfg.cut_threshold,
                                   scfg.cut_every)
    return sampling.sample_tree_forks(params, pcfg, key, prompts, scfg.num_chains, r, forks, **kw)
  raise ValueError(f'unknown sampler {scfg.name!r}; valid: {", ".join(SAMPLERS)}')


def _broadcast_info(info, g):
  return jax.tree.map(lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], g) + x.shape[1:]), info)


@functools.partial(jax.jit, static_argnames=('task',))
def group_rewards(prompts, tokens, mask, info, *, task):
  """[B, P], [B, G, L] -> rewards [B, G]."""
  g = tokens.shape[1]
  p = jnp.broadcast_to(prompts[:, None], (prompts.shape[0], g, prompts.shape[1]))
  return task.reward(p, tokens, mask, _broadcast_info(info, g))


@functools.partial(jax.jit, static_argnames=('task',))
def group_process_rewards(prompts, tokens, mask, info, *, task):
  """[B, P], [B, G, L] -> (token_rewards float32 [B, G, L], step_ends bool [B, G, L]) from
  the task's per-step verifier (`token_rewards`, `step_ends`; the chain-of-thought tasks)."""
  g = tokens.shape[1]
  p = jnp.broadcast_to(prompts[:, None], (prompts.shape[0], g, prompts.shape[1]))
  info = _broadcast_info(info, g)
  return (task.token_rewards(p, tokens, mask, info) * mask,
          task.step_ends(p, tokens, mask, info) & mask)


@functools.partial(jax.jit, static_argnames=('cfg', 'chunks', 'with_entropy'))
def rows_logprobs(params, prompts, tokens, mask, prompt_len=None, packed=None, *, cfg,
                  chunks: int = 1, with_entropy: bool = False):
  """Teacher-forced log-probs of [B, G, L] responses, 0 where masked
  (`with_entropy`: (log-probs, next-token entropies), both 0 where masked).

  `packed`: the groups' `trees.packing.Packing` (one forward per tree) or None (rows).
  `chunks`: the forward runs in sequential parts (`lax.map`): gcd(B * G, chunks) parts
  of rows, or packed, gcd(B, chunks) parts of groups, so the activations and logits
  held at once shrink by that factor; the values are the same. Part i takes rows (or
  groups) i, i + c, i + 2c, ...: with rows split over devices in contiguous blocks
  whose size c divides, every part keeps every device busy on its own rows. The loop
  passes the update step's split (minibatches x micro-batches): without it the old and
  reference passes over a whole rollout batch are what does not fit on a v5e-4
  (experiments/compile_tpu.py, SmolLM2-135M, 256 x 1.5k tokens).
  """
  b, g, l = tokens.shape
  if packed is None:
    n = b * g
    c = math.gcd(n, max(1, int(chunks)))
    rows = lambda x, axis=0: jnp.repeat(x, g, axis=axis)
    prompts_r = rows(prompts)
    plen = None if prompt_len is None else rows(prompt_len)
    parts = (prompts_r, tokens.reshape(n, l), plen)
    pick = (lambda out: out) if with_entropy else (lambda out: out[0])
    part = lambda a: pick(decoder.token_logprobs(params, cfg, *a))
    if c == 1:
      lp = part(parts)
    else:  # [N, ...] -> [c, N / c, ...], part i = rows i, i + c, ...
      split = lambda x: None if x is None else x.reshape((n // c, c) + x.shape[1:]).swapaxes(0, 1)
      lp = jax.tree.map(lambda x: x.swapaxes(0, 1),
                        jax.lax.map(part, tuple(split(x) for x in parts)))
    return jax.tree.map(lambda x: jnp.where(mask, x.reshape(b, g, l), 0.0), lp)
  c = math.gcd(b, max(1, int(chunks)))
  pick = (lambda out: out) if with_entropy else (lambda out: out[0])
  part = lambda a: pick(decoder.packed_token_logprobs(params, cfg, a[0], a[1]))
  if c == 1:
    lp = part((packed, tokens))
  else:  # groups i, i + c, ... per part
    split = lambda x: jax.tree.map(
        lambda a: a.reshape((b // c, c) + a.shape[1:]).swapaxes(0, 1), x)
    lp = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(b, g, l),
                      jax.lax.map(part, (split(packed), split(tokens))))
  return jax.tree.map(lambda x: jnp.where(mask, x, 0.0), lp)


@functools.partial(jax.jit, static_argnames=('cfg',))
def prompt_logprobs(params, prompts, prompt_len=None, *, cfg):
  """float32 [B, P]: teacher-forced log π(prompt token t | prompt tokens < t), 0 on the
  first token and on padding (t >= prompt_len); one forward over the B prompts."""
  b, p = prompts.shape
  if p < 2:
    return jnp.zeros((b, p), jnp.float32)
  lp, _ = decoder.token_logprobs(params, cfg, prompts[:, :1], prompts[:, 1:])
  lp = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp], axis=1)
  if prompt_len is None:
    return lp
  return jnp.where(jnp.arange(p)[None, :] < prompt_len[:, None], lp, 0.0)


def prompt_scored(prompt_len, p: int, num_prompts: int = 1):
  """bool [B, P]: the prompt positions `prompt_logprobs` scores (1 <= t < prompt_len; every
  t >= 1 of `num_prompts` rows when prompt_len is None: unpadded prompts)."""
  t = jnp.arange(p)[None, :]
  if prompt_len is None:
    return jnp.broadcast_to(t >= 1, (num_prompts, p))
  return (t >= 1) & (t < jnp.asarray(prompt_len)[:, None])


def context_prompts(problem, draw, prompts, prompt_len):
  """(prompts, prompt_len) of the changed context for `Rollouts.context_logprobs` (GCPO,
  PGPO): the task's `context_prompts(prompts, info)` if it defines one (a JAX task; same
  shape, prompt_len unchanged), else the prompt of the next group in the batch (a roll by
  one, lengths too): "the same kind of problem, another instance", defined for every task.
  With one prompt per step the roll is the identity, so the context does not change."""
  hook = getattr(getattr(problem, 'task', None), 'context_prompts', None)
  if hook is not None and not isinstance(draw.handle, list):
    return hook(prompts, draw.handle), prompt_len
  return _roll_prompts(prompts, prompt_len)


@jax.jit
def _roll_prompts(prompts, prompt_len):
  return (jnp.roll(prompts, -1, axis=0),
          None if prompt_len is None else jnp.roll(prompt_len, -1, axis=0))


def packing_applies(cfg, num_groups: int, num_devices: int = 1) -> bool:
  """Whether the update step packs each group's tree (`cfg.train.packing` != 'none').

  Packed minibatches and micro-batches take whole groups, so the groups must divide
  into num_minibatches * num_microbatches parts, each split evenly over the devices
  that hold rows (`packs_evenly`); otherwise the step runs flat rows (same loss).
  """
  split = cfg.loss.num_minibatches * cfg.loss.num_microbatches
  return cfg.train.packing != 'none' and packs_evenly(num_groups, split, num_devices)


def packs_evenly(num_groups: int, split: int, num_devices: int) -> bool:
  """Whether `split` parts of the groups each spread evenly over `num_devices`.

  Otherwise a device would hold a share of a packed group, which the packed layout
  does not split: measured with experiments/compile_tpu.py, Llama-3.1-8B with 32 groups
  of 8 x (512 + 1024) tokens packed over 64 chips computed replicated packed log-probs
  (40 GiB of temporaries per chip) where the flat rows fit."""
  return num_groups % (split * num_devices) == 0


def pack_groups(tcfg, prompts, samples, prompt_len=None, min_len: int = 0):
  """The packed trees (`trees.packing.Packing`) of a batch's groups (prompts [B, P],
  samples [B, G, L]).

  pack_len: `tcfg.pack_len`, or for 0 the smallest of 8 evenly spaced buckets in
  (P, P + G * L] that holds the largest group and is >= `min_len` (the loop passes
  the last length, so a run compiles a new shape only when its trees grow).
  """
  tokens, mask = samples.tokens, samples.mask
  node = _node_ids(tokens, mask, mode=tcfg.packing)
  need = prompts.shape[1] + int(ts.host_value(_num_unique(node)).max())
  g, l = tokens.shape[1:]
  pack_len = tcfg.pack_len or max(min_len, packing_lib.bucket_len(need, prompts.shape[1], g, l))
  return packing_lib.pack(prompts, tokens, mask, prompt_len, pack_len=pack_len,
                          mode=tcfg.packing, node=node, attention=tcfg.pack_attention)


_node_ids = jax.jit(packing_lib.node_ids, static_argnames=('mode',))
_num_unique = jax.jit(lambda node: packing_lib.num_unique(node, 1 + node.shape[1] * node.shape[2]))


@functools.lru_cache(maxsize=None)
def credit_fn(name: str, hparams_json: str, tree: bool, with_state: bool = False):
  """Jitted estimator (tree building included) for rollouts [B, G, L].

  Returns fn(tokens, mask, rewards, parent, fork, logprobs, ref_logprobs, token_rewards=None,
  step_ends=None, policy_mask=None, turns=None, *, entropy=None, prompt_logprobs=None,
  prompt_mask=None, context_logprobs=None, saliency=None, credit_state=None, values=None,
  step_probes=None, hindsight_logprobs=None, row_mask=None) -> (advantages, loss mask);
  ref_logprobs and the optional ones may be None (policy_mask and turns: multi-turn
  trajectories; the keyword ones: the `credit.Rollouts` fields of the same names).
  `with_state` (a stateful estimator): -> (advantages, loss mask, the state after this
  batch, `credit.update_state`), in the same call.
  """
  est, hp = credit.get(name), json.loads(hparams_json)

  @jax.jit
  def fn(tokens, mask, rewards, parent, fork, logprobs, ref_logprobs, token_rewards=None,
         step_ends=None, policy_mask=None, turns=None, *, entropy=None, prompt_logprobs=None,
         prompt_mask=None, context_logprobs=None, saliency=None, credit_state=None,
         values=None, step_probes=None, hindsight_logprobs=None, row_mask=None):
    t = trees.from_forks(tokens, mask, parent, fork) if tree else None
    rollouts = credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards, logprobs=logprobs,
                               ref_logprobs=ref_logprobs, tree=t, token_rewards=token_rewards,
                               step_ends=step_ends, policy_mask=policy_mask, turns=turns,
                               entropy=entropy, prompt_logprobs=prompt_logprobs,
                               prompt_mask=prompt_mask, context_logprobs=context_logprobs,
                               saliency=saliency, credit_state=credit_state, values=values,
                               step_probes=step_probes,
                               hindsight_logprobs=hindsight_logprobs, row_mask=row_mask,
                               parent=parent if tree else None, fork=fork if tree else None)
    adv = est(rollouts, **hp)
    keep = credit.loss_mask(name, rollouts, adv, **hp)
    if not with_state:
      return adv, keep
    return adv, keep, credit.update_state(name, credit_state, rollouts, **hp)

  return fn


def state_metrics(credit_state) -> dict:
  """{'credit_state/<path>': float} of the scalar leaves of a stateful estimator's state
  (logged in the metric rows; larger leaves are not)."""
  name = lambda k: str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))))
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(credit_state):
    if np.size(x) == 1:
      key = '.'.join(name(k) for k in path) or 'value'
      out[f'credit_state/{key}'] = float(ts.host_value(x).reshape(()))
  return out


@functools.partial(jax.jit, static_argnames=('task', 'n'))
def _task_sample(key, *, task, n):
  return task.sample(key, n)


@functools.partial(jax.jit, static_argnames=('task', 'n'))
def _demo_batch(key, *, task, n):
  prompts, info = task.sample(key, n)
  responses, mask = task.demonstrations(prompts, info)
  return prompts, responses, mask


class JaxProblem:
  """A JAX task (envs.registry) for the loop: prompts and rewards computed in jit.

  Same interface as `text_rollouts.TextProblem` (the text-task side).
  """

  def __init__(self, cfg):
    self.task = build_task(cfg)
    self.pcfg = policy_config(cfg, self.task)
    self.eos_id, self.pad_id = self.task.eos_id, self.task.pad_id
    self.response_len = self.task.response_len

  def set_pool(self, size: int, seed: int):
    """Fixes a pool of `size` training prompts drawn from `seed` (`rl.prompt_pool`); `draw`
    then takes each step's prompts from it, their pool indices as prompt ids."""
    self.pool = _task_sample(jax.random.fold_in(jax.random.PRNGKey(seed), 0x5eed),
                             task=self.task, n=size)

  def draw(self, key, step: int, n: int) -> text_rollouts.Draw:
    pool = getattr(self, 'pool', None)
    if pool is not None:  # n distinct prompts of the fixed pool
      idx = replay_lib.pool_indices(key, pool[0].shape[0], n)
      prompts, info = jax.tree.map(lambda x: x[idx], pool)
      return text_rollouts.Draw(prompts, None, idx, info)
    prompts, info = _task_sample(key, task=self.task, n=n)
    return text_rollouts.Draw(prompts, None, jnp.arange(n, dtype=jnp.int32) + step * n, info)

  def rewards(self, draw, samples):
    return group_rewards(draw.prompts, samples.tokens, samples.mask, draw.handle,
                         task=self.task), {}

  def process_rewards(self, draw, samples):
    """(token_rewards, step_ends) [B, G, L] from the task's per-step verifier."""
    return group_process_rewards(draw.prompts, samples.tokens, samples.mask, draw.handle,
                                 task=self.task)

  def step_probes(self, params, draw, samples, step_ends):
    """`credit.StepProbes` [B, G, S+1]: the gold continuation scored after each prefix of
    the responses' reasoning steps (`experiments/training/probes.py`)."""
    return probes_lib.step_probes(params, draw.prompts, samples.tokens, samples.mask, step_ends,
                                  draw.handle, cfg=self.pcfg, task=self.task)

  def hindsight_prompts(self, draw, prompts, prompt_len):
    """(prompts, prompt_len) with the task's gold answer after each prompt
    (`experiments/training/hindsight.py`)."""
    return hindsight_lib.hindsight_prompts(prompts, prompt_len, draw.handle, task=self.task)

  def hinted_demonstrations(self, key, n: int, frac: float):
    """(prompts [n, P + R], prompt_len [n], responses, mask): demonstrations whose prompts
    carry the gold answer (`hindsight_prompts`) with probability `frac` (`sft.hindsight_frac`:
    a warm start that has learned to read the answer, for PBSD and HCAPO's teacher)."""
    if not hasattr(self.task, 'reasoning_steps'):
      raise ValueError(f'sft.hindsight_frac needs a chain-of-thought task with '
                       f'`reasoning_steps`; {type(self.task).__name__} has none')
    return hindsight_lib.hinted_demonstrations(key, task=self.task, n=n, frac=frac)

  def interventions(self, draw, samples):
    """InT's rows (prompts [N, P], tokens [N, L], loss_mask [N, L], ok [N]) of the N = B·G
    responses (`task.interventions`; experiments/training/interventions.py)."""
    if not hasattr(self.task, 'interventions'):
      raise ValueError(f'InT needs single-step interventions, which '
                       f'{type(self.task).__name__} does not build (scratch_add does)')
    return interventions_lib.rows(draw.prompts, samples.tokens, samples.mask, draw.handle,
                                  task=self.task)

  def evaluate(self, params, ecfg) -> dict:
    return evaluate(params, self.pcfg, self.task, ecfg)

  def demonstrations(self, key, n: int):
    """(prompts [n, P], responses [n, L], mask [n, L]) of the task's demonstrations."""
    return _demo_batch(key, task=self.task, n=n)


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


def build_problem(cfg):
  """JaxProblem, text_rollouts.TextProblem or agent_rollouts.AgentProblem for cfg."""
  if is_text(cfg):
    return text_rollouts.TextProblem(cfg)
  return agent_rollouts.AgentProblem(cfg) if is_agent(cfg) else JaxProblem(cfg)


# ----------------------------------------------------------------------------
# Evaluation.


def evaluate(params, pcfg, task, ecfg, pass_sampler=None) -> dict:
  """Greedy accuracy on eval.num_prompts held-out prompts and pass@k on eval.pass_prompts.

  Held-out prompts come from a fixed key (eval.seed) disjoint from training keys.
  pass@k: any of k i.i.d. temperature-1 samples is correct.
  """
  key = jax.random.PRNGKey(ecfg.seed)
  prompts, info = _task_sample(key, task=task, n=ecfg.num_prompts)
  greedy = sampling.sample_iid(params, pcfg, jax.random.fold_in(key, 1), prompts, 1,
                               task.response_len, temperature=0.0, eos_id=task.eos_id,
                               pad_id=task.pad_id)
  acc = group_rewards(prompts, greedy.tokens, greedy.mask, info, task=task)
  n = ecfg.pass_prompts
  p2, i2 = prompts[:n], jax.tree.map(lambda x: x[:n], info)
  samples = sampling.sample_iid(params, pcfg, jax.random.fold_in(key, 2), p2, ecfg.pass_k,
                                task.response_len, temperature=1.0, eos_id=task.eos_id,
                                pad_id=task.pad_id)
  r = group_rewards(p2, samples.tokens, samples.mask, i2, task=task)
  return {'greedy_acc': float(jnp.mean(acc)), f'pass@{ecfg.pass_k}': float(jnp.mean(jnp.max(r, -1))),
          'eval_sample_reward': float(jnp.mean(r))}


# ----------------------------------------------------------------------------
# Checkpoints.


def _manager(path):
  # cleanup_tmp_directories: a save cut short (kill -9, full disk) leaves a
  # `<step>.orbax-checkpoint-tmp-*` directory that orbax never lists; it is removed here.
  return ocp.CheckpointManager(
      os.path.abspath(path),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False,
                                           create=True, cleanup_tmp_directories=True))


def _train_tree(state: ts.TrainState) -> dict:
  return {'params': state.params, 'opt_state': state.opt_state, 'step': state.step,
          'rng': state.rng}


def _state_tree(state: ts.TrainState, aux=None):
  """The checkpointed tree: the train state, and each non-None `aux` entry (the loop state
  that persists across steps: 'credit_state' a stateful estimator's, 'critic' the learned
  critic's `TrainState`, 'replay' the replay store, 'behaviour' the lagged sampler's
  params, 'expert_opt' DistIL's SFT optimizer state, 'pass_rate' the knapsack sampler's
  per-prompt pass rates), saved with the step's."""
  tree = _train_tree(state)
  for name, value in (aux or {}).items():
    if value is not None:
      tree[name] = _train_tree(value) if isinstance(value, ts.TrainState) else value
  return tree


def save_checkpoint(mngr, step: int, state: ts.TrainState, meta: dict, aux=None):
  """Saves `step` (orbax writes a temporary directory and renames it when complete, so a
  save cut short leaves the previous checkpoints intact), with the loop state after that
  step in `aux` ({name: pytree or TrainState or None}, `_state_tree`).
  A failed write (e.g. a full disk) raises an error (OSError for an OS error, same errno;
  else RuntimeError) naming the checkpoint and the newest intact one a rerun resumes from."""
  tree = ts.to_global(_state_tree(state, aux))  # multi-process: global only
  try:
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                            meta=ocp.args.JsonSave(meta)), force=True)
    mngr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 (re-raised with the checkpoint named)
    path = os.path.join(str(mngr.directory), str(step))
    # The partial write stays in orbax's temporary directory (never listed as a step); the
    # rerun's manager removes it (`cleanup_tmp_directories`) before it writes anything.
    try:
      mngr.reload()
      intact = [s for s in mngr.all_steps() if s != step]
      resume = f'step {max(intact)}' if intact else 'the start (no earlier checkpoint)'
    except Exception:  # noqa: BLE001 (the directory itself unreadable)
      resume = 'its newest intact checkpoint'
    full = getattr(e, 'errno', None) == errno.ENOSPC or 'No space left' in str(e)
    message = (f'could not write checkpoint {path}: {type(e).__name__}: {e}'
               f'{" (the disk is full)" if full else ""}; '
               f'the run stopped at step {step}. Rerun the same command to resume from '
               f'{resume} (metric rows after it are recomputed).')
    if isinstance(e, OSError):
      raise OSError(e.errno, message) from e
    raise RuntimeError(message) from e


def _set_aside(mngr, step: int) -> str:
  """Renames the checkpoint directory of `step` to `<step>.corrupt` (`.corrupt.<n>` if taken),
  which orbax does not list; nothing is deleted. Returns the new path."""
  src = os.path.join(str(mngr.directory), str(step))
  dst, n = src + '.corrupt', 1
  while os.path.exists(dst):
    dst, n = f'{src}.corrupt.{n}', n + 1
  os.rename(src, dst)
  return dst


def restore_checkpoint(mngr, template: ts.TrainState, fp: str, flat_cfg: dict, aux=None):
  """(state, meta) from the newest intact checkpoint, or (None, None) if there is none;
  refuses another config's. With `aux` templates ({name: pytree or TrainState or None}, as
  `save_checkpoint` takes them: shapes and dtypes) it returns (state, meta, aux), each entry
  from the checkpoint or, if there is none, the template itself (None stays None).

  A checkpoint that cannot be read (truncated or garbled files, a missing item) is set aside
  as `<step>.corrupt` with a warning naming it, and the one before it is tried: the run
  resumes exactly from the newest intact step (metric rows after it are recomputed), or
  starts over if none is intact (a run is a function of (config, step)).
  """
  bad = []
  state = meta = None
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
      if not isinstance(meta, dict):
        raise ValueError(f'its meta item is {type(meta).__name__}, not a JSON object')
    except Exception as e:  # noqa: BLE001 (any unreadable checkpoint is set aside)
      bad.append((step, e))
      meta = None
      continue
    if meta.get('fingerprint') != fp:
      old = meta.get('config', {})
      diff = sorted(k for k in set(old) | set(flat_cfg) if old.get(k) != flat_cfg.get(k))
      details = ', '.join(f'{k}: {old.get(k)!r} -> {flat_cfg.get(k)!r}' for k in diff[:10])
      raise ValueError(
          f'incompatible checkpoint in {mngr.directory}: it was written with a different config '
          f'(fingerprint {meta.get("fingerprint")} != {fp}; differences: {details}). '
          'Use another --workdir or delete the checkpoints to start over.')
    # Restored with the template's shardings (whatever mesh or process count wrote it).
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            ts.to_global(_state_tree(template, aux)))
    try:
      tree = mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract)))['state']
    except Exception as e:  # noqa: BLE001
      bad.append((step, e))
      meta = None
      continue
    state = template.replace(params=tree['params'], opt_state=tree['opt_state'],
                             step=tree['step'], rng=tree['rng'])
    restored_aux = {name: (None if value is None else value.replace(**tree[name])
                           if isinstance(value, ts.TrainState) else tree[name])
                    for name, value in (aux or {}).items()}
    break
  if bad:
    good = ('starting over (no intact checkpoint)' if state is None
            else f'resuming from step {step}')
    if jax.process_index() == 0:  # one process renames (and says so)
      for s, e in bad:
        where = os.path.join(str(mngr.directory), str(s))
        aside = _set_aside(mngr, s)
        warnings.warn(f'corrupt checkpoint {where} ({type(e).__name__}: {str(e)[:300]}); set '
                      f'aside as {aside}, {good}', RuntimeWarning, stacklevel=2)
    if jax.process_count() > 1:  # every process sees the renamed directory before going on
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices('treecredit_checkpoint_set_aside')
    mngr.reload()
  if aux is None:
    return state, meta
  return state, meta, (restored_aux if state is not None else dict(aux))


# ----------------------------------------------------------------------------
# Metrics file.


class MetricsWriter:
  """Appends JSON lines, each with one write + flush + fsync (a crash can cut at most the
  last line, which `read_metrics` then drops); on resume keeps the rows up to the restored
  step, rewritten atomically (a temporary file, fsynced, then os.replace).

  `rows`: the kept rows (read on every process; process 0 alone writes the file).
  """

  def __init__(self, path, resume_step: Optional[int]):
    self.path = str(path)
    self.enabled = jax.process_index() == 0  # one writer on multi-host jobs
    self.rows = []
    if resume_step is not None and os.path.exists(self.path):
      self.rows = [r for r in read_metrics(self.path, warn=self.enabled)
                   if r['step'] <= resume_step]
      missing = sorted(set(range(resume_step + 1)) - {r['step'] for r in self.rows})
      if missing and self.enabled and resume_step > 0:  # cannot be recomputed: say so
        warnings.warn(f'{self.path}: no rows for steps {missing[:20]} (lost before the '
                      f'checkpoint of step {resume_step} was written); resuming without them',
                      RuntimeWarning, stacklevel=2)
    if not self.enabled:
      return
    os.makedirs(os.path.dirname(self.path) or '.', exist_ok=True)
    _write_atomic(self.path, ''.join(json.dumps(r) + '\n' for r in self.rows).encode())

  def write(self, row: dict):
    if not self.enabled:
      return
    line = (json.dumps(row) + '\n').encode()
    with open(self.path, 'ab', buffering=0) as f:  # O_APPEND: each write lands at the end
      view = memoryview(line)
      while view:  # one write for a regular file; looped in case it is ever short
        view = view[f.write(view):]
      os.fsync(f.fileno())


def _write_atomic(path: str, data: bytes):
  """Replaces `path` by `data` so a crash leaves the old file or the new one, never a mix."""
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  try:  # the rename itself durable
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  except OSError:  # some filesystems cannot fsync a directory
    pass


def read_metrics(path, warn: bool = True) -> list[dict]:
  """The rows of a metrics.jsonl (one JSON object with 'step' per line; blank lines skipped).

  A torn final line (a write cut short by a crash or power loss) is dropped, with a warning
  naming the file (`warn`); an unreadable line anywhere else is a ValueError naming the file
  and the line number.
  """
  with open(path, 'rb') as f:
    lines = f.read().split(b'\n')
  numbered = [(i + 1, l) for i, l in enumerate(lines) if l.strip()]
  rows = []
  for k, (lineno, raw) in enumerate(numbered):
    try:
      row = json.loads(raw.decode('utf-8'))
      if not isinstance(row, dict) or 'step' not in row:
        raise ValueError("not a JSON object with a 'step'")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
      if k == len(numbered) - 1:
        if warn:
          warnings.warn(f'{path}: dropped torn final line {lineno} ({len(raw)} bytes, '
                        f'{raw[:60]!r}...): a write cut short (e.g. by a crash)',
                        RuntimeWarning, stacklevel=2)
        break
      raise ValueError(f'{path}: line {lineno} is not a metrics row ({e}): '
                       f'{raw[:80]!r}; only a torn final line is dropped') from None
    rows.append(row)
  return rows


# ----------------------------------------------------------------------------
# SFT warm start.


def sft(cfg, workdir: str, progress: Optional[bool] = None):
  """Supervised warm start on demonstrations; cached as a checkpoint in `workdir`.

  Returns (params, info dict with greedy_acc, loss, wall_s). A second call with
  the same workdir and compatible config loads the result.
  """
  check_config(cfg)
  progress = cfg.progress if progress is None else progress
  problem = build_problem(cfg)
  pcfg = problem.pcfg
  ts.check_model_axis(pcfg, cfg.mesh.get('model', 1))  # refused before the warm start, not after
  sub = ml_collections.ConfigDict({'task': cfg.task.to_dict(), 'model': cfg.model.to_dict(),
                                   'sft': cfg.sft.to_dict(),
                                   **({'agent': cfg.agent.to_dict()} if is_agent(cfg) else {})})
  _drop_default_sft_fields(sub)
  fp, flat = fingerprint(sub)
  s = cfg.sft
  tx = ts.make_optimizer(s.lr, s.warmup_steps, s.weight_decay, cfg.optimizer.grad_clip)
  params = getattr(problem, 'init_params', None)  # a pretrained policy, else a fresh one
  if params is None:
    params = decoder.init_params(jax.random.PRNGKey(s.seed), pcfg)
  state = ts.init_state(jax.tree.map(jnp.copy, params), tx, seed=s.seed)
  mngr = _manager(os.path.join(workdir, 'checkpoints'))
  restored, meta = restore_checkpoint(mngr, state, fp, flat)
  if restored is not None and meta.get('done'):
    return restored.params, meta['info']
  t0 = time.time()
  key = jax.random.PRNGKey(s.seed + 1)
  hinted = float(s.get('hindsight_frac', 0.0))
  if hinted and not hasattr(problem, 'hinted_demonstrations'):
    raise ValueError(f'sft.hindsight_frac needs a JAX chain-of-thought task with '
                     f'`reasoning_steps` (scratch_add, countdown_steps); task '
                     f'{cfg.task.name!r} has none')
  bar = tqdm(range(s.steps), desc='SFT', disable=not progress, leave=False)
  loss = float('nan')
  for i in bar:
    if hinted:  # some prompts carry the gold answer: a teacher that has read one
      prompts, plen, responses, mask = problem.hinted_demonstrations(
          jax.random.fold_in(key, i), s.batch_size, hinted)
    else:
      (prompts, responses, mask), plen = problem.demonstrations(
          jax.random.fold_in(key, i), s.batch_size), None
    state, m = ts.sft_step_jit(state, prompts, responses, mask, plen, cfg=pcfg)
    if i % 20 == 0 or i == s.steps - 1:
      loss = float(m['loss'])
      bar.set_postfix(loss=f'{loss:.3f}')
  wall = time.time() - t0
  ev = problem.evaluate(state.params, cfg.eval)
  info = dict(loss=loss, wall_s=wall, **ev)
  save_checkpoint(mngr, s.steps, state, dict(fingerprint=fp, config=flat, done=True, info=info))
  mngr.close()
  return state.params, info


def pretrained_start(cfg):
  """Starting point of a text-task run: the pretrained params and their eval (no SFT)."""
  t0 = time.time()
  problem = build_problem(cfg)
  ev = problem.evaluate(problem.init_params, cfg.eval)
  return problem.init_params, dict(wall_s=time.time() - t0, source=cfg.lm.source, **ev)


# ----------------------------------------------------------------------------
# RL.


def _off_policy_setup(cfg, problem, pool: int, need_replay: bool, run_seed: int):
  """The empty replay store (None unless the estimator needs replay): fixes the problem's
  prompt pool (`rl.prompt_pool`) and checks what the replay store and the lagged sampler
  need, with errors naming the field."""
  if pool:
    if not hasattr(problem, 'set_pool'):
      raise ValueError(f'rl.prompt_pool = {pool} needs a JAX task (a fixed pool of its '
                       f'prompts); task {cfg.task.name!r} draws its own')
    problem.set_pool(pool, run_seed)
  if cfg.sampler.name == 'lagged' and hasattr(problem, 'sample'):
    raise ValueError("sampler 'lagged' samples single-turn responses; multi-turn environments "
                     "sample with 'iid' or 'tree_turns'")
  if not need_replay:
    return None
  if not pool:
    raise ValueError(f'credit {cfg.credit.name!r} replays stored successes of the same prompt, '
                     f'which needs prompts that recur: set rl.prompt_pool (e.g. 256)')
  if cfg.sampler.name not in ('iid', 'lagged'):
    raise ValueError(f'credit {cfg.credit.name!r} puts a stored response in place of a '
                     f"group's last one, which needs i.i.d. groups (sampler 'iid' or 'lagged'); "
                     f'got {cfg.sampler.name!r}')
  return replay_lib.init_store(pool, problem.response_len, problem.pad_id)


def train(cfg, workdir: str, init_params, method: Optional[str] = None, seed: int = 0,
          progress: Optional[bool] = None) -> dict:
  """RL from `init_params` (also the frozen KL reference) for cfg.rl.steps steps.

  `method` 'credit:sampler' overrides cfg.credit.name / cfg.sampler.name; `seed`
  is added to rl.seed. Resumes from <workdir>/checkpoints if present. Returns a
  summary dict (final and peak eval metrics, mean timings; the final params, and with the
  sampler 'experience' the experience library).
  """
  if method is not None:
    cfg = with_method(cfg, method)
  check_config(cfg)
  credit.check_hparams(cfg.credit.name, dict(cfg.credit.hparams))
  method = method or f'{cfg.credit.name}:{cfg.sampler.name}'
  progress = cfg.progress if progress is None else progress
  problem = build_problem(cfg)
  pcfg = problem.pcfg
  loss_cfg = loss_config(cfg)
  run_seed = cfg.rl.seed + seed
  fp, flat = fingerprint(run_config(cfg, run_seed))
  flat['init_params_sum'] = float(sum(float(jnp.sum(x)) for x in jax.tree.leaves(init_params)))
  fp = hashlib.sha1((fp + repr(flat['init_params_sum'])).encode()).hexdigest()

  mesh = ts.make_mesh(cfg.mesh.fsdp, model=cfg.mesh.get('model', 1))
  ts.check_model_axis(pcfg, ts.mesh_axis(mesh, 'model'))  # a clear error, before any work
  o = cfg.optimizer
  tx = ts.make_optimizer(o.lr, o.warmup_steps, o.weight_decay, o.grad_clip, o.b1, o.b2,
                         lora_only=pcfg.lora_rank > 0)
  state = ts.shard_state(ts.init_state(jax.tree.map(jnp.copy, init_params), tx, seed=run_seed),
                         mesh)  # so a checkpoint restores straight onto the mesh
  hparams_json = json.dumps(cfg.credit.hparams.to_dict() if hasattr(cfg.credit.hparams, 'to_dict')
                            else dict(cfg.credit.hparams), sort_keys=True)
  hparams = json.loads(hparams_json)
  needs = credit.needs(cfg.credit.name)
  stateful = credit.stateful(cfg.credit.name)
  # A stateful estimator's state (pass-rate EMAs, curricula, ...): carried and checkpointed.
  credit_state = (jax.tree.map(jnp.asarray, credit.init_state(cfg.credit.name, **hparams))
                  if stateful else None)
  # A learned critic (PPO's GAE), only when the estimator reads values: its own train state.
  need_values = 'values' in needs
  critic_state, ccfg, critic_gl = (
      critic_lib.from_config(cfg, init_params, pcfg, run_seed, mesh)
      if need_values else (None, None, None))
  mngr = _manager(os.path.join(workdir, 'checkpoints'))
  watchdog.register_checkpoints(os.path.join(workdir, 'checkpoints'))  # named if a peer dies
  # A finite prompt pool, R3's replay store and off-policy GRPO's lagged behaviour policy
  # (experiments/training/replay.py): the store and the lagged params are checkpointed.
  pool, scfg = int(cfg.rl.get('prompt_pool', 0)), cfg.sampler
  need_replay, lag = 'replay' in needs, int(scfg.lag) if scfg.name == 'lagged' else 0
  replay_store = _off_policy_setup(cfg, problem, pool, need_replay, run_seed)
  behaviour = replay_lib.copy_params(state.params) if lag else None
  # Knapsack RL: each pool prompt's pass rate at its last visit (-1: not yet), loop state.
  knapsack = scfg.name == 'knapsack'
  if knapsack and (not pool or hasattr(problem, 'sample')):
    raise ValueError("sampler 'knapsack' allocates each step's rollouts by the prompts' pass "
                     "rates at their last visit, which needs a single-turn JAX task with "
                     "prompts that recur: set rl.prompt_pool (e.g. 256)")
  pass_rate = jnp.full((pool,), -1.0, jnp.float32) if knapsack else None
  # SLEA-RL: the step-level experience library (envs/experience.py), loop state.
  experience = scfg.name == 'experience'
  if experience and not hasattr(problem, 'learn'):
    raise ValueError("sampler 'experience' (SLEA-RL) retrieves experiences at every turn of "
                     "a multi-turn environment (configs/agents.py, agent.experience_slots)")
  library = problem.empty_library() if experience else None
  replay_kw = dict(success=float(hparams.get('success', 1.0)),
                   two_sided='replay_failures' in needs)
  replay_current = hparams.get('replay_logprobs', 'behaviour') == 'current'
  # DistIL: an SFT step toward the expert at the learner's first wrong step, after each
  # update, with its own Adam (its moments are loop state).
  need_expert = 'expert_sft' in needs
  if need_expert and not hasattr(getattr(problem, 'task', None), 'interventions'):
    raise ValueError(f'credit {cfg.credit.name!r} imitates the expert at the learner\'s '
                     f'first wrong step, which needs a task that builds single-step '
                     f'interventions (scratch_add); task {cfg.task.name!r} does not')
  expert_tx = ts.make_optimizer(float(hparams.get('expert_lr', 3e-4))) if need_expert else None
  expert_opt = expert_tx.init(state.params) if need_expert else None
  restored, meta, aux = restore_checkpoint(mngr, state, fp, flat, dict(
      credit_state=credit_state, critic=critic_state, replay=replay_store, behaviour=behaviour,
      expert_opt=expert_opt, pass_rate=pass_rate, library=library))
  credit_state, critic_state = aux['credit_state'], aux['critic']
  replay_store, behaviour, expert_opt = aux['replay'], aux['behaviour'], aux['expert_opt']
  pass_rate, library = aux['pass_rate'], aux['library']

  def lib_kw():  # the current library (restored, then each step's), for sampling and eval
    return dict(library=library) if experience else {}

  if need_values:
    critic_state = ts.shard_state(critic_state, mesh)
  start, wall0 = 0, 0.0
  if restored is not None:
    state, start, wall0 = restored, meta['rl_step'], meta['wall_s']
  phase_info = {}
  if 'interventions' in needs and restored is None:  # InT: fine-tune on fixed failures first
    sample_fn = lambda params, k, draw: sample(params, pcfg, problem, scfg, k, draw.prompts,
                                               prompt_ids=draw.prompt_ids)
    params, phase_info = interventions_lib.phase(
        state.params, problem, sample_fn, jax.random.fold_in(jax.random.PRNGKey(run_seed), 7),
        steps=int(hparams.get('intervention_steps', 10)), batch=cfg.rl.prompts_per_step,
        lr=float(hparams.get('intervention_lr', 3e-4)))
    state = state.replace(params=params)
  state = ts.shard_state(state, mesh)
  ref_params = jax.device_put(init_params, ts.param_sharding(init_params, mesh))  # as policy
  writer = MetricsWriter(os.path.join(workdir, 'metrics.jsonl'),
                         start if restored is not None else None)
  old_rows = writer.rows  # the rows up to the restored step (a torn final line dropped)
  gen_total = max([r.get('generated_tokens_total', 0.0) for r in old_rows] + [0.0])
  gen_total += phase_info.get('intervention_generated_tokens', 0.0)  # InT's phase samples
  env_steps_total = max([r.get('env_steps_total', 0.0) for r in old_rows] + [0.0])
  b = cfg.rl.prompts_per_step
  est = credit_fn(cfg.credit.name, hparams_json, scfg.name not in IID_SAMPLERS, stateful)
  need_ref = loss_cfg.needs_ref or 'ref_logprobs' in needs  # KL loss/reward, APA's anchor
  need_entropy, need_prompt_lp = 'entropy' in needs, 'prompt_logprobs' in needs
  need_context, need_saliency = 'context_logprobs' in needs, 'saliency' in needs
  need_hindsight = 'hindsight_logprobs' in needs
  need_self_hindsight = 'self_hindsight' in needs  # with step_ends: a JAX CoT task (below)
  if need_hindsight and not (hasattr(problem, 'hindsight_prompts') and hasattr(
      getattr(problem, 'task', None), 'reasoning_steps')):
    raise ValueError(f'credit {cfg.credit.name!r} scores the responses with the gold answer '
                     f'in context, which needs a JAX chain-of-thought task with '
                     f'demonstrations and `reasoning_steps` (scratch_add, countdown_steps); '
                     f'task {cfg.task.name!r} has none')
  saliency_kw = dict(kind=hparams.get('saliency_kind', 'grad_norm'),
                     answer_tokens=int(hparams.get('answer_tokens', 0)))
  # Old / reference log-probs run over the batch in the update step's parts (rows_logprobs).
  lp_chunks = loss_cfg.num_minibatches * loss_cfg.num_microbatches
  need_process = bool({'token_rewards', 'step_ends'} & set(needs))
  if need_process and not hasattr(problem, 'process_rewards'):
    raise ValueError(f'credit {cfg.credit.name!r} needs per-step process rewards, which text '
                     f'tasks and multi-turn environments do not provide; use a JAX '
                     f'chain-of-thought task (scratch_add, countdown_steps)')
  if need_process and not hasattr(problem.task, 'token_rewards'):
    raise ValueError(f'credit {cfg.credit.name!r} needs per-step process rewards '
                     f'(token_rewards, step_ends), which task {cfg.task.name!r} does not '
                     f'provide; use a chain-of-thought task (scratch_add, countdown_steps)')
  need_probes = 'step_probes' in needs
  if need_probes and not hasattr(getattr(problem, 'task', None), 'reasoning_steps'):
    raise ValueError(f'credit {cfg.credit.name!r} probes the gold continuation after each '
                     f'reasoning step, which needs a JAX chain-of-thought task with '
                     f'demonstrations and `reasoning_steps` (scratch_add, countdown_steps); '
                     f'task {cfg.task.name!r} has none')
  if 'turns' in credit.needs(cfg.credit.name) and not hasattr(problem, 'turns'):
    raise ValueError(f'credit {cfg.credit.name!r} assigns credit to the turns of multi-turn '
                     f'trajectories; task {cfg.task.name!r} is single-turn (use a multi-turn '
                     f'environment, configs/agents.py)')
  n_dev = ts.row_shards(mesh)  # devices that hold different rows ('model' repeats them)
  use_packing, pack_len = packing_applies(cfg, b, n_dev), 0
  key = jax.random.PRNGKey(run_seed)
  t_start = time.time() - wall0
  step = start

  def meta_now():
    return dict(fingerprint=fp, config=flat, rl_step=step, wall_s=time.time() - t_start,
                method=method)

  def checkpoint():  # the train, credit and critic states after `step`, together
    save_checkpoint(mngr, step, state, meta_now(), dict(
        credit_state=credit_state, critic=critic_state, replay=replay_store, behaviour=behaviour,
        expert_opt=expert_opt, pass_rate=pass_rate, library=library))

  bar = tqdm(range(start, cfg.rl.steps), desc=f'RL {method} s{seed}', disable=not progress,
             initial=start, total=cfg.rl.steps, leave=False)
  last_eval, pending, dirty = {}, None, False
  try:
    if start == 0:  # eval of the starting policy, logged as step 0
      last_eval = problem.evaluate(state.params, cfg.eval, **lib_kw())
      writer.write(dict(step=0, wall_s=0.0, method=method, seed=seed, **last_eval,
                        **phase_info))
    for i in bar:
      k = jax.random.fold_in(key, i)
      t0 = time.perf_counter()
      pending = None
      draw = problem.draw(jax.random.fold_in(k, 0), i, b)
      prompts, plen = draw.prompts, draw.prompt_len
      if b % n_dev == 0:
        # Every process drew the whole batch (same key); each feeds its devices' rows.
        prompts, plen = ts.host_batch_to_global((prompts, plen), mesh)
      if lag and i % lag == 0:  # off-policy GRPO: the behaviour policy catches up
        behaviour = replay_lib.copy_params(state.params)
      sampling_params = behaviour if lag else state.params
      sizes = None
      if knapsack:  # Knapsack RL: each prompt's rollouts from its pass rate, B·G in all
        sizes = knapsack_lib.allocate(
            np.asarray(pass_rate)[np.asarray(draw.prompt_ids)], b * scfg.group_size,
            default=scfg.group_size, min_rows=scfg.min_group, max_rows=scfg.max_group)
      if hasattr(problem, 'sample'):  # multi-turn episodes (the problem's own sampler)
        samples = problem.sample(state.params, scfg, jax.random.fold_in(k, 1), draw, **lib_kw())
      else:  # on a mesh of > 1 device, rows of the KV cache split over it (place_rows)
        with jax.set_mesh(mesh) if mesh.size > 1 else contextlib.nullcontext():
          samples = sample(sampling_params, pcfg, problem, scfg, jax.random.fold_in(k, 1),
                           prompts, prompt_ids=draw.prompt_ids, prompt_len=plen,
                           info=draw.handle, progress=i / cfg.rl.steps, group_sizes=sizes)
      rewards, reward_metrics = problem.rewards(draw, samples)
      row_mask = getattr(samples, 'row_mask', None)  # groups of varying size (knapsack)
      if row_mask is not None:
        rewards = jnp.where(row_mask, rewards, 0.0)
      fresh_rewards, replayed = rewards, None
      if need_replay:  # R3 / AVATAR: a stored response of the prompt into each collapsed group
        samples, rewards, replayed = replay_lib.inject(replay_store, draw.prompt_ids, samples,
                                                       rewards, **replay_kw)
      rewards.block_until_ready()
      t1 = time.perf_counter()
      packed = None
      if use_packing:
        packed = pack_groups(cfg.train, prompts, samples, plen, pack_len)
        pack_len = packed.pack_len
      policy_mask = getattr(samples, 'policy_mask', None)
      entropy = getattr(samples, 'entropy', None) if need_entropy else None
      tf_entropy = need_entropy and entropy is None  # multi-turn: from a teacher-forced pass
      if cfg.rl.recompute_logprobs:  # teacher-forced: ratio exactly 1 at the first update
        old_lp = rows_logprobs(sampling_params, prompts, samples.tokens, samples.mask, plen,
                               packed, cfg=pcfg, chunks=lp_chunks, with_entropy=tf_entropy)
        if tf_entropy:
          old_lp, entropy = old_lp
      else:  # the sampler's untempered log-probs (same params; equal up to float rounding)
        old_lp = samples.logprobs
        if tf_entropy:
          entropy = rows_logprobs(state.params, prompts, samples.tokens, samples.mask, plen,
                                  packed, cfg=pcfg, chunks=lp_chunks, with_entropy=True)[1]
      if replayed is not None:  # replayed rows: their behaviour log-probs, or the current's
        keep = (rows_logprobs(state.params, prompts, samples.tokens, samples.mask, plen, None,
                              cfg=pcfg, chunks=lp_chunks) if replay_current
                else samples.logprobs)
        old_lp = jnp.where(replayed[..., None], keep, old_lp)
      if tf_entropy and policy_mask is not None:  # the policy's own steps only
        entropy = jnp.where(policy_mask, entropy, 0.0)
      extra = dict(entropy=entropy, row_mask=row_mask)
      if need_prompt_lp:
        extra['prompt_logprobs'] = prompt_logprobs(state.params, prompts, plen, cfg=pcfg)
        extra['prompt_mask'] = prompt_scored(plen, prompts.shape[1], prompts.shape[0])
      if need_context:  # one teacher-forced pass with the prompt changed (flat rows)
        ctx_prompts, ctx_plen = context_prompts(problem, draw, prompts, plen)
        ctx = rows_logprobs(state.params, ctx_prompts, samples.tokens, samples.mask, ctx_plen,
                            None, cfg=pcfg, chunks=lp_chunks)
        extra['context_logprobs'] = (ctx if policy_mask is None
                                     else jnp.where(policy_mask, ctx, 0.0))
      if need_hindsight:  # one teacher-forced pass with the gold answer after the prompt
        hs_prompts, hs_plen = problem.hindsight_prompts(draw, prompts, plen)
        extra['hindsight_logprobs'] = rows_logprobs(
            state.params, hs_prompts, samples.tokens, samples.mask, hs_plen, None, cfg=pcfg,
            chunks=lp_chunks)
      if need_saliency:  # one extra backward pass
        extra['saliency'] = saliency_lib.token_saliency(
            state.params, prompts, samples.tokens, samples.mask, plen, policy_mask, cfg=pcfg,
            chunks=lp_chunks, **saliency_kw)
      if stateful:
        extra['credit_state'] = credit_state
      critic_s = 0.0
      if need_values:  # the critic's V(s_t) before each token: one forward (flat rows)
        tc = time.perf_counter()
        extra['values'] = critic_lib.group_values(critic_state.params, prompts, samples.tokens,
                                                  plen, cfg=pcfg)
        extra['values'].block_until_ready()
        critic_s += time.perf_counter() - tc
      ref_lp = (rows_logprobs(ref_params, prompts, samples.tokens, samples.mask, plen, packed,
                              cfg=pcfg, chunks=lp_chunks) if need_ref else None)
      train_rewards = rewards
      if need_ref and loss_cfg.kl_in_reward:
        train_rewards = rewards - loss_cfg.kl_coef * jnp.sum(
            credit.kl_k1(old_lp, ref_lp, samples.mask), -1)
      old_lp.block_until_ready()
      t2 = time.perf_counter()
      process = problem.process_rewards(draw, samples) if need_process else (None, None)
      probe_s = {}
      if need_probes:  # S + 1 teacher-forced passes scoring the gold continuation
        tp = time.perf_counter()
        extra['step_probes'] = problem.step_probes(state.params, draw, samples, process[1])
        credit.validate(credit.Rollouts(  # on the host: a NaN probe is named, not trained on
            tokens=samples.tokens, mask=samples.mask, rewards=rewards,
            step_probes=extra['step_probes']))
        probe_s = dict(probe_s=time.perf_counter() - tp)
      if need_self_hindsight:  # SIOP: the hindsight pass with each group's modal answer
        tp = time.perf_counter()
        mode_prompts, mode_plen = hindsight_lib.modal_answer_prompts(
            prompts, plen, samples.tokens, samples.mask, process[1], pad_id=problem.pad_id)
        extra['hindsight_logprobs'] = rows_logprobs(
            state.params, mode_prompts, samples.tokens, samples.mask, mode_plen, None,
            cfg=pcfg, chunks=lp_chunks)
        probe_s = dict(probe_s=time.perf_counter() - tp)
      turns = (problem.turns(state.params, draw, samples, credit.needs(cfg.credit.name))
               if hasattr(problem, 'turns') else None)
      if turns is not None:  # values are checked on the host: `est` is jitted (tracers)
        credit.validate_turns(turns, samples)
      out = est(samples.tokens, samples.mask, train_rewards, samples.parent, samples.fork,
                old_lp, ref_lp, *process, policy_mask=policy_mask, turns=turns, **extra)
      adv, loss_mask = out[:2]
      next_credit_state = out[2] if stateful else None  # committed with the update below
      adv.block_until_ready()
      t3 = time.perf_counter()
      batch = ts.batch_from_samples(prompts, samples.tokens, loss_mask, adv, old_lp, ref_lp,
                                    plen, packed)
      if (b if packed is not None else batch.tokens.shape[0]) % n_dev == 0:
        batch = ts.shard_batch(batch, mesh)
      next_critic, cm = critic_state, {}
      if need_values:  # regression on TD(λ) returns (verl: returns = A^GAE + V)
        tc = time.perf_counter()
        next_critic, cm = critic_lib.update_on_samples(
            critic_state, prompts, plen, samples, extra['values'], train_rewards, process[0],
            policy_mask, mesh, pcfg=pcfg, ccfg=ccfg, gamma_lam=critic_gl)
        critic_s += time.perf_counter() - tc
      next_rate = (knapsack_lib.update_pass_rates(pass_rate, draw.prompt_ids, rewards, row_mask)
                   if knapsack else None)
      next_library, exp_m = (problem.learn(library, samples, scfg) if experience
                             else (None, {}))
      next_store = (replay_lib.update(replay_store, draw.prompt_ids, samples, rewards, replayed,
                                      step=i, **replay_kw) if need_replay else None)
      # From the donating update to the commit below, `state` and the loop state are not one
      # step's: an interrupt there keeps the last checkpoint (see KeyboardInterrupt below).
      dirty = True
      if need_values and i < ccfg.critic_warmup:  # verl's critic_warmup: the critic alone
        m = dict(critic_warmup=1.0)
      else:
        state, m = ts.train_step_jit(state, batch, cfg=pcfg, loss_cfg=loss_cfg)
      next_expert = expert_opt
      if need_expert:  # DistIL: forward cross-entropy to the expert at the learner's states
        e_prompts, e_tokens, e_mask, e_ok = problem.interventions(draw, samples)
        m['expert_rows'] = float(jnp.sum(e_ok))
        if m['expert_rows'] > 0:
          es, em = ts.sft_step_jit(  # donates its state: the policy's params (replaced
              ts.TrainState(params=state.params, opt_state=expert_opt,  # below), fresh rest
                            step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(0),
                            tx=expert_tx), e_prompts, e_tokens, e_mask, cfg=pcfg)
          state, next_expert, m['expert_loss'] = (state.replace(params=es.params),
                                                  es.opt_state, em['loss'])
      # `state` is now the state after this step (the old one was donated); the credit,
      # critic and replay states after it are committed with it, in one statement.
      step, credit_state, critic_state, replay_store, expert_opt, pass_rate, library, dirty = (
          i + 1, next_credit_state if stateful else None, next_critic, next_store, next_expert,
          next_rate, next_library, False)
      m.update(cm)
      m.update(exp_m)
      pending = dict(step=step, wall_s=time.time() - t_start, method=method, seed=seed,
                     interrupted=True)
      m = {k_: float(v) for k_, v in m.items()}
      t4 = time.perf_counter()
      ntok = float(jnp.sum(getattr(samples, 'policy_mask', samples.mask)))  # trained tokens
      if hasattr(samples, 'hint_len'):  # the 'hinted' sampler: reference tokens given
        m['hint_tokens'] = float(jnp.sum(samples.hint_len))
      if hasattr(samples, 'generated_tokens'):  # multi-turn: copied turns are not generated
        gen = float(samples.generated_tokens)
        steps_now = float(samples.env_steps)
        env_steps_total += steps_now
        counts = dict(env_steps=steps_now, env_steps_total=env_steps_total,
                      env_steps_per_s=steps_now / (t1 - t0))
      else:
        gen = ntok - float(jnp.sum(jnp.where(samples.parent >= 0, jnp.minimum(  # forks' copied
            samples.fork, samples.lengths), 0)))  # prefixes are not generated; i.i.d.: fork 0
        counts = {}
        if replayed is not None:  # replayed responses were generated at an earlier step
          gen -= float(jnp.sum(jnp.where(replayed, samples.lengths, 0)))
          counts = dict(replayed_groups=float(jnp.sum(replayed)))
        if knapsack:
          counts = dict(group_size_min=float(sizes.min()), group_size_max=float(sizes.max()))
      gen_total += gen
      r = ts.host_value(rewards)  # all rows, on every process (trained: replayed included)
      rows = None if row_mask is None else ts.host_value(row_mask)
      fresh = ts.host_value(fresh_rewards)
      group_signal, row_signal = knapsack_lib.signal(r, rows)
      row = dict(step=step, wall_s=time.time() - t_start, method=method, seed=seed,
                 generated_tokens=gen, generated_tokens_total=gen_total, **counts,
                 reward=float(fresh.mean() if rows is None  # this step's samples
                              else fresh[rows].mean()),
                 frac_groups_with_signal=group_signal, frac_rows_with_signal=row_signal,
                 response_len=ntok / (r.size if rows is None else rows.sum()), **m,
                 sample_s=t1 - t0, logprob_s=t2 - t1, credit_s=t3 - t2, update_s=t4 - t3,
                 step_s=t4 - t0, sampled_tokens_per_s=ntok / (t1 - t0),
                 train_tokens_per_s=ntok * loss_cfg.num_epochs / (t4 - t3),
                 credit_frac=(t3 - t2) / (t4 - t0), **probe_s, **reward_metrics,
                 **({'critic_s': critic_s} if need_values else {}),
                 **(state_metrics(credit_state) if stateful else {}))
      pending = row  # update applied, row not yet written (see KeyboardInterrupt below)
      if step % cfg.eval.every == 0 or step == cfg.rl.steps:
        last_eval = problem.evaluate(state.params, cfg.eval, **lib_kw())
        row.update(last_eval)
      writer.write(row)
      pending = None
      bar.set_postfix(reward=f'{row["reward"]:.2f}',
                      acc=f'{last_eval.get("greedy_acc", float("nan")):.2f}')
      if step % cfg.rl.ckpt_every == 0 or step == cfg.rl.steps:
        checkpoint()
  except KeyboardInterrupt:
    if pending is not None:  # interrupted during eval: keep the update, log it without eval
      writer.write(pending)
    if not dirty and mngr.latest_step() != step:
      checkpoint()
    saved = mngr.latest_step()
    mngr.close()
    print(f'\nInterrupted{" during an update" if dirty else ""}: {workdir}/checkpoints holds '
          f'step {saved}; rerun to resume from there.' if saved is not None else
          f'\nInterrupted before the first checkpoint; rerun to start over.')
    raise
  mngr.close()
  out = summarize(read_metrics(os.path.join(workdir, 'metrics.jsonl')), cfg.eval.pass_k,
                  params=state.params)
  if experience:  # SLEA-RL's library after the last step, beside the params
    out['library'] = library
  return out


def summarize(rows, pass_k, params=None) -> dict:
  """Final / peak eval metrics and mean timings of one run's metric rows."""
  ev = [r for r in rows if 'greedy_acc' in r]
  tr = [r for r in rows if 'reward' in r]
  mean = lambda k, rs: float(np.mean([r[k] for r in rs])) if rs else float('nan')
  steady = tr[1:] if len(tr) > 1 else tr  # skip the compiling step for timings
  out = dict(
      steps=rows[-1]['step'] if rows else 0,
      final_acc=ev[-1]['greedy_acc'] if ev else float('nan'),
      peak_acc=max(r['greedy_acc'] for r in ev) if ev else float('nan'),
      init_acc=ev[0]['greedy_acc'] if ev else float('nan'),
      final_pass=ev[-1].get(f'pass@{pass_k}', float('nan')) if ev else float('nan'),
      final_reward=mean('reward', tr[-5:]),
      wall_s=rows[-1]['wall_s'] if rows else 0.0,
      sampled_tokens_per_s=mean('sampled_tokens_per_s', steady),
      train_tokens_per_s=mean('train_tokens_per_s', steady),
      credit_frac=(sum(r['credit_s'] for r in steady) / max(sum(r['step_s'] for r in steady), 1e-9)
                   if steady else float('nan')),
      sample_s=mean('sample_s', steady), update_s=mean('update_s', steady),
      credit_s=mean('credit_s', steady))
  if params is not None:
    out['params'] = params
  return out
