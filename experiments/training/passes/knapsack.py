"""Knapsack RL: each step's rollouts allocated by the prompts' pass rates at their last
visit (domain code: experiments/rollouts/knapsack.py); loop state: the pass rates."""

import jax.numpy as jnp
import numpy as np

from experiments.rollouts import knapsack as knapsack_lib
from experiments.training.passes.base import Pass
from experiments.training.passes.off_policy import pool_size


class Knapsack(Pass):
  sampler, state_key = 'knapsack', 'pass_rate'

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    if not pool_size(cfg) or 'own_sampler' in caps:
      raise ValueError("sampler 'knapsack' allocates each step's rollouts by the prompts' pass "
                       "rates at their last visit, which needs a single-turn JAX task with "
                       "prompts that recur: set rl.prompt_pool (e.g. 256)")

  def init_state(self, run, state):
    return jnp.full((pool_size(self.cfg),), -1.0, jnp.float32)  # -1: not yet

  def before_sample(self, run, carry, s):
    g = self.cfg.sampler
    s.sample_kw['group_sizes'] = knapsack_lib.allocate(
        np.asarray(carry.aux['pass_rate'])[np.asarray(s.draw.prompt_ids)], run.b * g.group_size,
        default=g.group_size, min_rows=g.min_group, max_rows=g.max_group)

  def update(self, run, carry, s):
    return knapsack_lib.update_pass_rates(carry.aux['pass_rate'], s.draw.prompt_ids, s.rewards,
                                          s.row_mask), {}

  def counts(self, run, s):
    sizes = s.sample_kw['group_sizes']
    return None, dict(group_size_min=float(sizes.min()), group_size_max=float(sizes.max()))
