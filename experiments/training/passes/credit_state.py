"""A stateful estimator's state (pass-rate EMAs, curricula, ...): read from
`Rollouts.credit_state`, advanced by `credit.update_state` in the estimator's jitted call,
committed with the update, logged as `credit_state/<path>`; loop state."""

import jax
import jax.numpy as jnp

import credit
from experiments.training.metrics_io import state_metrics
from experiments.training.passes.base import Pass


class CreditState(Pass):
  state_key = 'credit_state'

  @classmethod
  def applies(cls, cfg, needs):
    return credit.stateful(cfg.credit.name)

  def init_state(self, run, state):
    return jax.tree.map(jnp.asarray, credit.init_state(self.cfg.credit.name, **self.hparams))

  def inputs(self, run, carry, s):
    s.extra['credit_state'] = carry.aux['credit_state']

  def update(self, run, carry, s):
    return s.credit_out[2], {}  # the estimator returned it with the advantages

  def row_fields(self, run, carry, s):
    return state_metrics(carry.aux['credit_state'])
