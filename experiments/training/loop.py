"""The shared RL loop: SFT warm start -> (sample -> rewards -> tree -> credit -> update)*.

    params0 = loop.sft(cfg, workdir + '/sft')              # cached in its workdir
    summary = loop.train(cfg, workdir + '/run', params0, method='tempo:iid')

`train` is a thin driver over `rl_step` and the passes (experiments/training/passes); the
structure, the hooks and how to add a paper: docs/trainer.md.
"""

import os
from typing import Optional

from tqdm.auto import tqdm

from experiments.training import run_context, watchdog
from experiments.training.rl_step import rl_step
# The loop's public names, importable from here as before the split by job:
from experiments.training.checkpoints import (  # noqa: F401
    _manager, _set_aside, _state_tree, _train_tree, restore_checkpoint, save_checkpoint)
from experiments.training.config_checks import (  # noqa: F401
    FREE_DICTS, IID_SAMPLERS, NOT_FINGERPRINTED, PACKING, SAMPLER_COMMON, SAMPLER_FIELDS,
    SAMPLERS, check_config, fingerprint, group_size, is_agent, is_text, loss_config,
    policy_config, reference_config, run_config)
from experiments.training.forward import (  # noqa: F401
    context_prompts, credit_fn, group_process_rewards, group_rewards, pack_groups,
    node_ids, packing_applies, packs_evenly, prompt_logprobs, prompt_scored, rows_logprobs)
from experiments.training.methods import method_name, parse_methods, with_method  # noqa: F401
from experiments.training.metrics_io import (  # noqa: F401
    MetricsWriter, read_metrics, state_metrics, summarize)
from experiments.training.problems import (  # noqa: F401
    JaxProblem, build_problem, build_task, evaluate)
from experiments.training.samplers import sample  # noqa: F401
from experiments.training.warm_start import pretrained_start, sft  # noqa: F401


# ----------------------------------------------------------------------------
# RL.


def train(cfg, workdir: str, init_params, method: Optional[str] = None, seed: int = 0,
          progress: Optional[bool] = None) -> dict:
  """RL from `init_params` (also the frozen KL reference) for cfg.rl.steps steps.

  `method` 'credit:sampler' overrides cfg.credit.name / cfg.sampler.name; `seed`
  is added to rl.seed. Resumes from <workdir>/checkpoints if present. Returns a
  summary dict (final and peak eval metrics, mean timings; the final params, and with the
  sampler 'experience' the experience library).
  """
  run = run_context.build(cfg, init_params, method, seed)
  mngr = _manager(os.path.join(workdir, 'checkpoints'))
  watchdog.register_checkpoints(os.path.join(workdir, 'checkpoints'))  # named if a peer dies
  carry, phase, writer = run_context.start(run, mngr, os.path.join(workdir, 'metrics.jsonl'))
  steps = run.cfg.rl.steps
  bar = tqdm(range(carry.step, steps), desc=f'RL {run.method} s{seed}', initial=carry.step,
             total=steps, leave=False,
             disable=not (run.cfg.progress if progress is None else progress))
  last_eval = {}
  try:
    if carry.step == 0:  # eval of the starting policy, logged as step 0
      last_eval = run.evaluate(carry)
      writer.write(dict(step=0, wall_s=0.0, method=run.method, seed=seed, **last_eval, **phase))
    for i in bar:
      carry.pending = None
      row = carry.pending = rl_step(run, carry, i)  # updated, not yet logged
      if carry.step % run.cfg.eval.every == 0 or carry.step == steps:
        last_eval = run.evaluate(carry)
        row.update(last_eval)
      writer.write(row)
      carry.pending = None
      bar.set_postfix(reward=f'{row["reward"]:.2f}',
                      acc=f'{last_eval.get("greedy_acc", float("nan")):.2f}')
      if carry.step % run.cfg.rl.ckpt_every == 0 or carry.step == steps:
        run_context.save(run, mngr, carry)
  except KeyboardInterrupt:
    _interrupted(run, mngr, carry, writer, workdir)
    raise
  finally:
    writer.close()  # the metric sinks (TensorBoard, W&B; JSONL needs none)
  mngr.close()
  return run_context.summary(run, carry, workdir)


def _interrupted(run, mngr, carry, writer, workdir: str) -> None:
  """Ctrl-C: logs an update whose row was not written (without eval), checkpoints the last
  committed step unless an update was under way (`carry.dirty`), and says where to resume."""
  if carry.pending is not None:
    writer.write(carry.pending)
  if not carry.dirty and mngr.latest_step() != carry.step:
    run_context.save(run, mngr, carry)
  saved = mngr.latest_step()
  mngr.close()
  print(f'\nInterrupted{" during an update" if carry.dirty else ""}: {workdir}/checkpoints '
        f'holds step {saved}; rerun to resume from there.' if saved is not None else
        '\nInterrupted before the first checkpoint; rerun to start over.')
