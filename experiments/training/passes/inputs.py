"""The estimator's optional inputs the loop computes, each only when the estimator `needs`
it (credit.NEEDS), so the default path costs nothing extra."""

import contextlib
import time

import jax
import jax.numpy as jnp

import credit
from experiments.rollouts import sampling
from experiments.training import hindsight as hindsight_lib
from experiments.training import saliency as saliency_lib
from experiments.training.config_checks import is_agent, loss_config
from experiments.training.forward import (context_prompts, prompt_logprobs, prompt_scored,
                                          rows_hidden, rows_logprobs)
from experiments.training.passes.base import Pass


def _teacher_forced(run, carry, s, prompts, plen):
  """Log-probs of the step's responses after other prompts (flat rows, the update's parts)."""
  return rows_logprobs(carry.state.params, prompts, s.samples.tokens, s.samples.mask, plen,
                       None, cfg=run.pcfg, chunks=run.lp_chunks)


class Reference(Pass):
  """Log-probs under the frozen reference policy: for KL in the loss or the reward, and for
  estimators that read them (APA's anchor)."""
  provides = ('ref_logprobs',)

  @classmethod
  def applies(cls, cfg, needs):
    return loss_config(cfg).needs_ref or 'ref_logprobs' in needs

  def inputs(self, run, carry, s):
    s.ref_lp = rows_logprobs(run.ref_params, s.prompts, s.samples.tokens, s.samples.mask,
                             s.plen, s.packed, cfg=run.pcfg, chunks=run.lp_chunks)
    if run.loss_cfg.kl_in_reward:
      s.train_rewards = s.rewards - run.loss_cfg.kl_coef * jnp.sum(
          credit.kl_k1(s.old_lp, s.ref_lp, s.samples.mask), -1)


class ReferenceSamples(Pass):
  """One response per prompt from the frozen reference policy, and its reward (AAPO's
  baseline, #48): sampled as the policy's groups are (the run's temperature, top-p, top-k),
  with its own key, fold_in(step key, 2). Its tokens are generated: they count in the run's
  generated tokens (`ref_sample_tokens` in the row)."""
  provides = ('ref_rewards',)

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if kind != 'jax' or 'own_sampler' in caps:
      raise ValueError(f'credit {cfg.credit.name!r} needs a response the reference policy '
                       f'samples for each prompt, which the loop draws for single-turn JAX '
                       f'tasks only; task {cfg.task.name!r} is not one')

  def inputs(self, run, carry, s):
    t = time.perf_counter()
    scfg = run.cfg.sampler
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(run.run_seed), s.i), 2)
    with jax.set_mesh(run.mesh) if run.mesh.size > 1 else contextlib.nullcontext():
      ref = sampling.sample_iid(run.ref_params, run.pcfg, key, s.prompts, 1,
                                run.problem.response_len, temperature=scfg.temperature,
                                top_p=scfg.top_p, top_k=scfg.top_k, eos_id=run.problem.eos_id,
                                pad_id=run.problem.pad_id, prompt_len=s.plen,
                                prompt_ids=s.draw.prompt_ids)
    rewards, _ = run.problem.rewards(s.draw, ref)
    s.extra['ref_rewards'] = rewards[:, 0]
    s.times['ref_sample_tokens'] = float(jnp.sum(ref.mask))
    s.times['ref_sample_s'] = time.perf_counter() - t

  def counts(self, run, s):
    return -s.times['ref_sample_tokens'], {}  # generated at this step, beyond the batch

  def row_fields(self, run, carry, s):
    return {k: s.times[k] for k in ('ref_sample_tokens', 'ref_sample_s')}


class HiddenStates(Pass):
  """The policy's final hidden state at each response position (VERL's representations,
  #108): one extra teacher-forced forward over flat rows, policy tokens only."""
  provides = ('hidden_states',)

  def inputs(self, run, carry, s):
    mask = s.samples.mask if s.policy_mask is None else s.policy_mask
    s.extra['hidden_states'] = rows_hidden(carry.state.params, s.prompts, s.samples.tokens,
                                           mask, s.plen, cfg=run.pcfg)


class Entropy(Pass):
  """The sampler's untempered next-token entropy; multi-turn samples carry none: a
  teacher-forced pass (shared with the old log-probs when rl.recompute_logprobs), policy
  tokens only."""
  provides = ('entropy',)

  def before_logprobs(self, run, carry, s):
    s.with_entropy = getattr(s.samples, 'entropy', None) is None

  def inputs(self, run, carry, s):
    entropy = getattr(s.samples, 'entropy', None)
    if entropy is None:
      entropy = s.tf_entropy
      if entropy is None:  # the old log-probs were the sampler's: a pass of its own
        entropy = rows_logprobs(carry.state.params, s.prompts, s.samples.tokens,
                                s.samples.mask, s.plen, s.packed, cfg=run.pcfg,
                                chunks=run.lp_chunks, with_entropy=True)[1]
      if s.policy_mask is not None:
        entropy = jnp.where(s.policy_mask, entropy, 0.0)
    s.extra['entropy'] = entropy


class PromptLogprobs(Pass):
  """[B, P]: one teacher-forced pass over the prompts."""
  provides = ('prompt_logprobs',)

  def inputs(self, run, carry, s):
    s.extra['prompt_logprobs'] = prompt_logprobs(carry.state.params, s.prompts, s.plen,
                                                 cfg=run.pcfg)
    s.extra['prompt_mask'] = prompt_scored(s.plen, s.prompts.shape[1], s.prompts.shape[0])


class ContextLogprobs(Pass):
  """One teacher-forced pass with the prompt changed (`forward.context_prompts`)."""
  provides = ('context_logprobs',)

  def inputs(self, run, carry, s):
    ctx = _teacher_forced(run, carry, s, *context_prompts(run.problem, s.draw, s.prompts,
                                                          s.plen))
    s.extra['context_logprobs'] = (ctx if s.policy_mask is None
                                   else jnp.where(s.policy_mask, ctx, 0.0))


class Hindsight(Pass):
  """One teacher-forced pass with the task's gold answer after the prompt."""
  provides = ('hindsight_logprobs',)

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if kind != 'jax' or 'reasoning_steps' not in caps:
      raise ValueError(f'credit {cfg.credit.name!r} scores the responses with the gold answer '
                       f'in context, which needs a JAX chain-of-thought task with '
                       f'demonstrations and `reasoning_steps` (scratch_add, countdown_steps); '
                       f'task {cfg.task.name!r} has none')

  def inputs(self, run, carry, s):
    s.extra['hindsight_logprobs'] = _teacher_forced(
        run, carry, s, *run.problem.hindsight_prompts(s.draw, s.prompts, s.plen))


class Saliency(Pass):
  """One extra backward pass (experiments/training/saliency.py)."""
  provides = ('saliency',)

  def inputs(self, run, carry, s):
    s.extra['saliency'] = saliency_lib.token_saliency(
        carry.state.params, s.prompts, s.samples.tokens, s.samples.mask, s.plen, s.policy_mask,
        cfg=run.pcfg, chunks=run.lp_chunks,
        kind=self.hparams.get('saliency_kind', 'grad_norm'),
        answer_tokens=int(self.hparams.get('answer_tokens', 0)))


class ProcessRewards(Pass):
  """(token_rewards, step_ends) [B, G, L] from the task's per-step verifier."""
  provides = ('token_rewards', 'step_ends')

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if kind != 'jax':
      raise ValueError(f'credit {cfg.credit.name!r} needs per-step process rewards, which text '
                       f'tasks and multi-turn environments do not provide; use a JAX '
                       f'chain-of-thought task (scratch_add, countdown_steps)')
    if 'process_rewards' not in caps:
      raise ValueError(f'credit {cfg.credit.name!r} needs per-step process rewards '
                       f'(token_rewards, step_ends), which task {cfg.task.name!r} does not '
                       f'provide; use a chain-of-thought task (scratch_add, countdown_steps)')

  def credit_inputs(self, run, carry, s):
    s.process = run.problem.process_rewards(s.draw, s.samples)


class StepProbes(Pass):
  """S + 1 teacher-forced passes scoring the gold continuation after each reasoning step
  (experiments/training/probes.py), checked on the host: a NaN probe is named."""
  provides = ('step_probes',)

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if 'reasoning_steps' not in caps:
      raise ValueError(f'credit {cfg.credit.name!r} probes the gold continuation after each '
                       f'reasoning step, which needs a JAX chain-of-thought task with '
                       f'demonstrations and `reasoning_steps` (scratch_add, countdown_steps); '
                       f'task {cfg.task.name!r} has none')

  def credit_inputs(self, run, carry, s):
    t = time.perf_counter()
    s.extra['step_probes'] = run.problem.step_probes(carry.state.params, s.draw, s.samples,
                                                     s.process[1])
    credit.validate(credit.Rollouts(tokens=s.samples.tokens, mask=s.samples.mask,
                                    rewards=s.rewards, step_probes=s.extra['step_probes']))
    s.times['probe_s'] = time.perf_counter() - t

  def row_fields(self, run, carry, s):
    return dict(probe_s=s.times['probe_s'])


class SelfHindsight(Pass):
  """SIOP: the hindsight pass with each response's own answer after its prompt (one row per
  response: B·G prompts of one response each)."""
  provides = ('self_hindsight',)

  def credit_inputs(self, run, carry, s):
    t = time.perf_counter()
    tokens, mask = s.samples.tokens, s.samples.mask
    b, g, l = tokens.shape
    prompts, plen = hindsight_lib.own_answer_prompts(s.prompts, s.plen, tokens, mask,
                                                     s.process[1], pad_id=run.problem.pad_id)
    lp = rows_logprobs(carry.state.params, prompts, tokens.reshape(b * g, 1, l),
                       mask.reshape(b * g, 1, l), plen, None, cfg=run.pcfg, chunks=run.lp_chunks)
    s.extra['hindsight_logprobs'] = lp.reshape(b, g, l)
    s.times['probe_s'] = time.perf_counter() - t

  def row_fields(self, run, carry, s):
    return dict(probe_s=s.times['probe_s'])


class Turns(Pass):
  """The turn structure of multi-turn trajectories, and the Turns fields the estimator
  needs, from the multi-turn problem (`AgentProblem.turns`), validated on the host."""
  provides = ('turns',)

  @classmethod
  def applies(cls, cfg, needs):
    return is_agent(cfg) or 'turns' in needs

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if 'turns' not in caps:
      raise ValueError(f'credit {cfg.credit.name!r} assigns credit to the turns of multi-turn '
                       f'trajectories; task {cfg.task.name!r} is single-turn (use a multi-turn '
                       f'environment, configs/agents.py)')

  def credit_inputs(self, run, carry, s):
    s.turns = run.problem.turns(carry.state.params, s.draw, s.samples, run.needs)
    credit.validate_turns(s.turns, s.samples)
