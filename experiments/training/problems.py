"""The task side of the loop: `JaxProblem` (a JAX task), and `build_problem` for
JAX tasks, text tasks (`TextProblem`) and multi-turn environments (`AgentProblem`)."""

import functools

import jax
import jax.numpy as jnp

import envs
from experiments.rollouts import agent_rollouts, sampling, text_rollouts
from experiments.training import hindsight as hindsight_lib
from experiments.training import interventions as interventions_lib
from experiments.training import probes as probes_lib
from experiments.training import replay as replay_lib
from experiments.training.config_checks import is_agent, is_text, policy_config
from experiments.training.forward import group_process_rewards, group_rewards


def build_task(cfg):
  return envs.get(cfg.task.name, **dict(cfg.task.kwargs))


@functools.partial(jax.jit, static_argnames=('task', 'n'))
def _task_sample(key, *, task, n):
  return task.sample(key, n)


@functools.partial(jax.jit, static_argnames=('task', 'n'))
def _demo_batch(key, *, task, n):
  prompts, info = task.sample(key, n)
  responses, mask = task.demonstrations(prompts, info)
  return prompts, responses, mask


def task_capabilities(task) -> frozenset:
  """A JAX task's problem's capabilities: what the task declares (`envs.base.Task`:
  'reasoning_steps', 'process_rewards', 'interventions') and 'prompt_pool', which every JAX
  task has (`JaxProblem.set_pool`)."""
  return frozenset({'prompt_pool'}) | task.capabilities


def capabilities(cfg, jax_task=None) -> frozenset:
  """What the problem cfg builds can do, without building it (`jax_task`: cfg's JAX task,
  if built already): `JaxProblem`'s from its task, the others' declared on their class."""
  if is_text(cfg):
    return text_rollouts.TextProblem.capabilities
  if is_agent(cfg):
    return agent_rollouts.AgentProblem.capabilities
  return task_capabilities(build_task(cfg) if jax_task is None else jax_task)


class JaxProblem:
  """A JAX task (envs.registry) for the loop: prompts and rewards computed in jit.

  Same interface as `text_rollouts.TextProblem` (the text-task side).
  """

  def __init__(self, cfg):
    self.task = build_task(cfg)
    self.capabilities = task_capabilities(self.task)
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
    if 'reasoning_steps' not in self.capabilities:
      raise ValueError(f'sft.hindsight_frac needs a chain-of-thought task with '
                       f'`reasoning_steps`; {type(self.task).__name__} has none')
    return hindsight_lib.hinted_demonstrations(key, task=self.task, n=n, frac=frac)

  def interventions(self, draw, samples):
    """InT's rows (prompts [N, P], tokens [N, L], loss_mask [N, L], ok [N]) of the N = B·G
    responses (`task.interventions`; experiments/training/interventions.py)."""
    if 'interventions' not in self.capabilities:
      raise ValueError(f'InT needs single-step interventions, which '
                       f'{type(self.task).__name__} does not build (scratch_add does)')
    return interventions_lib.rows(draw.prompts, samples.tokens, samples.mask, draw.handle,
                                  task=self.task)

  def evaluate(self, params, ecfg) -> dict:
    return evaluate(params, self.pcfg, self.task, ecfg)

  def demonstrations(self, key, n: int):
    """(prompts [n, P], responses [n, L], mask [n, L]) of the task's demonstrations."""
    return _demo_batch(key, task=self.task, n=n)


def build_problem(cfg):
  """JaxProblem, text_rollouts.TextProblem or agent_rollouts.AgentProblem for cfg."""
  if is_text(cfg):
    return text_rollouts.TextProblem(cfg)
  return agent_rollouts.AgentProblem(cfg) if is_agent(cfg) else JaxProblem(cfg)


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
