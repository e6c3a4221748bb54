"""A learned critic for estimators that read `values` (PPO's GAE; domain code:
experiments/training/critic.py): V(s_t) before each token, regressed on TD(λ) returns after
each step, alone for `critic.critic_warmup` steps; loop state: its TrainState."""

import time

from experiments.training import critic as critic_lib
from experiments.training import train_step as ts
from experiments.training.passes.base import Pass


class Critic(Pass):
  provides = ('values',)
  state_key = 'critic'

  def init_state(self, run, state):
    value, self.ccfg, self.gamma_lam = critic_lib.from_config(
        self.cfg, run.init_params, run.pcfg, run.run_seed, run.mesh)
    return value

  def restored(self, run, value):
    return ts.shard_state(value, run.mesh)

  def inputs(self, run, carry, s):  # one forward over flat rows
    t = time.perf_counter()
    s.extra['values'] = critic_lib.group_values(carry.aux['critic'].params, s.prompts,
                                                s.samples.tokens, s.plen, cfg=run.pcfg)
    s.extra['values'].block_until_ready()
    s.times['critic_s'] = time.perf_counter() - t

  def update(self, run, carry, s):  # verl: returns = A^GAE + V
    t = time.perf_counter()
    out = critic_lib.update_on_samples(
        carry.aux['critic'], s.prompts, s.plen, s.samples, s.extra['values'], s.train_rewards,
        s.process[0], s.policy_mask, run.mesh, pcfg=run.pcfg, ccfg=self.ccfg,
        gamma_lam=self.gamma_lam)
    s.times['critic_s'] += time.perf_counter() - t
    return out

  def gates_update(self, run, i):
    return dict(critic_warmup=1.0) if i < self.ccfg.critic_warmup else None  # verl's

  def row_fields(self, run, carry, s):
    return dict(critic_s=s.times['critic_s'])
