"""A stateful estimator's state (pass-rate EMAs, curricula, ...): read from
`Rollouts.credit_state`, advanced by `credit.update_state` in the estimator's jitted call,
committed with the update, logged as `credit_state/<path>`; loop state. With
`rl.prompt_pool` an estimator that keeps a history per prompt (`credit.per_prompt`) gets a
state for the pool and each group's pool index (`Rollouts.prompt_ids`)."""

import jax
import jax.numpy as jnp

import credit
from experiments.training.metrics_io import state_metrics
from experiments.training.passes.base import Pass
from experiments.training.passes.off_policy import pool_size


class CreditState(Pass):
  state_key = 'credit_state'

  @classmethod
  def applies(cls, cfg, needs):
    return credit.stateful(cfg.credit.name)

  def prepare(self, run):
    self.prompts = pool_size(self.cfg) if credit.per_prompt(self.cfg.credit.name) else 0

  def init_state(self, run, state):
    return jax.tree.map(jnp.asarray, credit.init_state(self.cfg.credit.name, self.prompts,
                                                       **self.hparams))

  def inputs(self, run, carry, s):
    s.extra['credit_state'] = carry.aux['credit_state']
    if self.prompts:
      s.extra['prompt_ids'] = s.draw.prompt_ids

  def update(self, run, carry, s):
    return s.credit_out[2], {}  # the estimator returned it with the advantages

  def row_fields(self, run, carry, s):
    return state_metrics(carry.aux['credit_state'])
