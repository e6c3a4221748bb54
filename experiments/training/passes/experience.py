"""SLEA-RL's step-level experience library (envs/experience.py), read at every turn of
sampling and evaluation and learned from after each step; loop state: the library."""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.training.passes.base import Pass


class Experience(Pass):
  sampler, state_key = 'experience', 'library'

  def init_state(self, run, state):
    return self.restored(run, run.problem.empty_library())

  def restored(self, run, value):
    # Replicated on the run's mesh, as `learn` returns it: the sampler compiles once for both.
    return jax.device_put(value, NamedSharding(run.mesh, P()))

  def before_sample(self, run, carry, s):
    s.problem_kw['library'] = carry.aux['library']

  def update(self, run, carry, s):
    return run.problem.learn(carry.aux['library'], s.samples, self.cfg.sampler)

  def eval_kwargs(self, carry):
    return dict(library=carry.aux['library'])

  def result(self, carry):
    return dict(library=carry.aux['library'])  # beside the params
