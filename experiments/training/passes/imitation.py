"""Imitation of single-step interventions (domain code: experiments/training/
interventions.py): InT's fine-tuning phase before the first RL step, and DistIL's SFT step
toward the expert at the learner's first wrong step after each update (its own Adam, whose
moments are loop state)."""

import jax
import jax.numpy as jnp

from experiments.training import interventions as interventions_lib
from experiments.training import train_step as ts
from experiments.training.passes.base import Pass


def _check_interventions(cfg, caps, what: str):
  if 'interventions' not in caps:
    raise ValueError(f'credit {cfg.credit.name!r} {what}, which needs a task that builds '
                     f'single-step interventions (scratch_add); task {cfg.task.name!r} does not')


class InterventionPhase(Pass):
  """InT: fine-tunes on fixed failures' interventions before step 0 of a fresh run."""
  provides = ('interventions',)
  start_tokens = 'intervention_generated_tokens'

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    _check_interventions(cfg, caps, 'fine-tunes on interventions of fixed failures before RL')

  def start(self, run, state):
    hp = self.hparams
    sample_fn = lambda params, k, draw: run.sample(params, k, draw)
    params, info = interventions_lib.phase(
        state.params, run.problem, sample_fn,
        jax.random.fold_in(jax.random.PRNGKey(run.run_seed), 7),
        steps=int(hp.get('intervention_steps', 10)), batch=self.cfg.rl.prompts_per_step,
        lr=float(hp.get('intervention_lr', 3e-4)))
    return state.replace(params=params), info


class ExpertSFT(Pass):
  """DistIL: forward cross-entropy to the expert at the learner's states, after each update."""
  provides = ('expert_sft',)
  state_key = 'expert_opt'

  @classmethod
  def check(cls, cfg, needs, kind, caps):
    _check_interventions(cfg, caps, "imitates the expert at the learner's first wrong step")

  def __init__(self, cfg, hparams):
    super().__init__(cfg, hparams)
    self.tx = ts.make_optimizer(float(hparams.get('expert_lr', 3e-4)))

  def init_state(self, run, state):
    return self.tx.init(state.params)

  def after_update(self, run, carry, s, state, nxt):
    e_prompts, e_tokens, e_mask, e_ok = run.problem.interventions(s.draw, s.samples)
    m = dict(expert_rows=float(jnp.sum(e_ok)))
    nxt['expert_opt'] = carry.aux['expert_opt']
    if m['expert_rows'] > 0:  # donates its state: the policy's params (replaced), fresh rest
      es, em = ts.sft_step_jit(
          ts.TrainState(params=state.params, opt_state=carry.aux['expert_opt'],
                        step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(0), tx=self.tx),
          e_prompts, e_tokens, e_mask, cfg=run.pcfg)
      state, nxt['expert_opt'], m['expert_loss'] = (state.replace(params=es.params),
                                                    es.opt_state, em['loss'])
    return state, m
