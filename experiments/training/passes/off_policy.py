"""A finite prompt pool, R3 / AVATAR's replay of stored responses and off-policy GRPO's
lagged behaviour policy (domain code: experiments/training/replay.py)."""

import jax.numpy as jnp

import credit
from experiments.training import replay as replay_lib
from experiments.training.forward import rows_logprobs
from experiments.training.passes.base import Pass


def pool_size(cfg) -> int:
  """`rl.prompt_pool`, 0 when unset (fresh prompts every step)."""
  return int(cfg.rl.get('prompt_pool', 0))


class PromptPool(Pass):
  """`rl.prompt_pool` > 0: each step's prompts from a fixed pool, their pool indices as ids."""

  @classmethod
  def applies(cls, cfg, needs):
    return pool_size(cfg) > 0

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if 'prompt_pool' not in caps:
      raise ValueError(f'rl.prompt_pool = {pool_size(cfg)} needs a JAX task (a fixed pool of '
                       f'its prompts); task {cfg.task.name!r} draws its own')

  def prepare(self, run):
    run.problem.set_pool(pool_size(self.cfg), run.run_seed)


class Lagged(Pass):
  """Off-policy GRPO: samples with params `sampler.lag` updates old (loop state)."""
  sampler, state_key = 'lagged', 'behaviour'

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if 'own_sampler' in caps:
      raise ValueError("sampler 'lagged' samples single-turn responses; multi-turn environments "
                       "sample with 'iid' or 'tree_turns'")

  def init_state(self, run, state):
    return replay_lib.copy_params(state.params)

  def before_sample(self, run, carry, s):
    if s.i % int(self.cfg.sampler.lag) == 0:  # the behaviour policy catches up
      carry.aux['behaviour'] = replay_lib.copy_params(carry.state.params)
    s.sampling_params = carry.aux['behaviour']


class Replay(Pass):
  """R3 / AVATAR: a stored response of the prompt into each collapsed group (loop state:
  the store); `replay_failures` also stores failures."""
  provides = ('replay', 'replay_failures')
  state_key = 'replay'

  @classmethod
  def applies(cls, cfg, needs):
    return 'replay' in needs

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if not pool_size(cfg):
      raise ValueError(f'credit {cfg.credit.name!r} replays stored successes of the same '
                       f'prompt, which needs prompts that recur: set rl.prompt_pool (e.g. 256)')
    if cfg.sampler.name not in ('iid', 'lagged'):
      raise ValueError(f'credit {cfg.credit.name!r} puts a stored response in place of a '
                       f"group's last one, which needs i.i.d. groups (sampler 'iid' or "
                       f"'lagged'); got {cfg.sampler.name!r}")

  def __init__(self, cfg, hparams):
    super().__init__(cfg, hparams)
    self.kw = dict(success=float(hparams.get('success', 1.0)),
                   two_sided='replay_failures' in credit.needs(cfg.credit.name))
    self.current = hparams.get('replay_logprobs', 'behaviour') == 'current'

  def init_state(self, run, state):
    return replay_lib.init_store(pool_size(self.cfg), run.problem.response_len,
                                 run.problem.pad_id)

  def after_rewards(self, run, carry, s):
    s.samples, s.rewards, s.replayed = replay_lib.inject(
        carry.aux['replay'], s.draw.prompt_ids, s.samples, s.rewards, **self.kw)

  def inputs(self, run, carry, s):
    if s.replayed is None:
      return
    keep = (rows_logprobs(carry.state.params, s.prompts, s.samples.tokens, s.samples.mask,
                          s.plen, None, cfg=run.pcfg, chunks=run.lp_chunks) if self.current
            else s.samples.logprobs)  # their behaviour log-probs, or the current policy's
    s.old_lp = jnp.where(s.replayed[..., None], keep, s.old_lp)

  def update(self, run, carry, s):
    return replay_lib.update(carry.aux['replay'], s.draw.prompt_ids, s.samples, s.rewards,
                             s.replayed, step=s.i, **self.kw), {}

  def counts(self, run, s):
    if s.replayed is None:
      return None, {}
    return (float(jnp.sum(jnp.where(s.replayed, s.samples.lengths, 0))),
            dict(replayed_groups=float(jnp.sum(s.replayed))))
