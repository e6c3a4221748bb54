"""Progress advantage as its paper uses it (#52; issue 40, item 6): an RL-trained policy and its
reference score responses, for best-of-N selection, uncertainty and failure attribution.

    python -m experiments.progress_scoring [--config=configs/progress_scoring.py]
        [--workdir=DIR] [--out=docs/results/progress_scoring.json]

Per seed: GRPO from the main job's warm start (π_ref) gives π_θ; π_θ samples N responses to
each held-out prompt. Best-of-N: the accuracy of the top-scoring response per prompt, against
a random pick (mean@N) and the oracle (pass@N). Uncertainty: the AUROC of the trajectory score
for correctness. Failure attribution: on failed responses, how often the predicted step is the
first wrong one (the task's step verifier). Each scorer is progress advantage and π_θ's own
log-probabilities ('policy_logprob'), the authors' baseline; paired over seeds.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from credit import progress_scores as ps
from experiments.rollouts import sampling
from experiments.training import loop, stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCORERS = ('progress_advantage', 'policy_logprob')


def aggregations(spec: str) -> list:
  """'mean/mean,sum/sum' -> [('mean', 'mean'), ('sum', 'sum')], each checked."""
  out = []
  for item in spec.split(','):
    token, _, step = item.strip().partition('/')
    if token not in ps.TOKEN_AGGS or step not in ps.STEP_AGGS:
      raise ValueError(f'scoring.aggregations: {item!r} is not "token/step" with token in '
                       f'{ps.TOKEN_AGGS} and step in {ps.STEP_AGGS}')
    out.append((token, step))
  return out


def sample_scored(theta, ref, pcfg, task, key, sc) -> dict:
  """N responses per held-out prompt from π_θ, with both models' log-probs and the verifier."""
  prompts, info = task.sample(key, sc.prompts)
  s = sampling.sample_iid(theta, pcfg, jax.random.fold_in(key, 3), prompts, sc.group_size,
                          task.response_len, temperature=sc.temperature, eos_id=task.eos_id,
                          pad_id=task.pad_id)
  success = loop.group_rewards(prompts, s.tokens, s.mask, info, task=task) >= 1.0
  token_rewards, ends = loop.group_process_rewards(prompts, s.tokens, s.mask, info, task=task)
  lp = lambda params: loop.rows_logprobs(params, prompts, s.tokens, s.mask, cfg=pcfg)
  # the first wrong step of a failure: its leading valid steps each carry a process reward
  first_wrong = jnp.sum(token_rewards > 0, -1)
  return dict(mask=s.mask, ends=ends, lp=lp(theta), ref=lp(ref), success=success,
              first_wrong=first_wrong)


def scores(d, scorer: str, token_agg: str, beta: float):
  ref = d['ref'] if scorer == 'progress_advantage' else None
  return ps.step_scores(d['lp'], ref, d['mask'], d['ends'], token_agg=token_agg, beta=beta)


def selection(d, sc) -> dict:
  """Best-of-N accuracy and AUROC per scorer and aggregation."""
  success = np.asarray(d['success'])
  out = {}
  for token_agg, step_agg in aggregations(sc.aggregations):
    for scorer in SCORERS:
      traj = np.asarray(ps.trajectory_scores(*scores(d, scorer, token_agg, sc.beta),
                                             step_agg=step_agg))
      pick = np.argmax(traj, -1)  # ties: the first, as the authors' stable sort
      out[f'{scorer} {token_agg}/{step_agg}'] = dict(
          best_of_n=float(np.take_along_axis(success, pick[:, None], -1).mean()),
          auroc=stats.auroc(traj, success))
  return out


def attribution(d, sc) -> dict:
  """Failure attribution on the failed responses whose first wrong step was written."""
  failed = ~np.asarray(d['success'])
  truth = np.asarray(d['first_wrong'])
  by = {scorer: scores(d, scorer, sc.failure_token_agg, sc.beta) for scorer in SCORERS}
  n_steps = np.asarray(by['progress_advantage'][1]).sum(-1)
  keep = failed & (truth < n_steps)
  out = dict(failed=int(failed.sum()), attributable=int(keep.sum()),
             first_step=float((truth[keep] == 0).mean()),
             last_step=float((truth[keep] == n_steps[keep] - 1).mean()))
  for scorer, (steps, valid) in by.items():
    for rule in ps.RULES:
      pred = np.asarray(ps.failure_step(steps, valid, rule=rule))[keep]
      out[f'{scorer} {rule}'] = dict(accuracy=float((pred == truth[keep]).mean()),
                                     mae=float(np.abs(pred - truth[keep]).mean()))
  return out


def per_seed(cfg, sc, workdir, params0, seed: int, problem) -> dict:
  summary = loop.train(cfg, os.path.join(workdir, f'grpo_s{seed}'), params0, method='grpo:iid',
                       seed=seed, progress=False)
  key = jax.random.fold_in(jax.random.PRNGKey(cfg.eval.seed), 100 + seed)
  d = sample_scored(summary['params'], params0, problem.pcfg, problem.task, key, sc)
  success = np.asarray(d['success'])
  return dict(seed=seed, rl_final_acc=float(summary['final_acc']),
              mean_at_n=float(success.mean()), pass_at_n=float(success.any(-1).mean()),
              selection=selection(d, sc), attribution=attribution(d, sc))


def paired(rows: list) -> dict:
  """Progress advantage against each baseline, paired over seeds (t intervals)."""
  out = {}
  sel = lambda r, k, m: r['selection'][k][m]
  for key in rows[0]['selection']:
    if not key.startswith('progress_advantage'):
      continue
    base = key.replace('progress_advantage', 'policy_logprob')
    pa = [sel(r, key, 'best_of_n') for r in rows]
    out[f'best_of_n {key} - random'] = stats.paired_difference(pa, [r['mean_at_n'] for r in rows])
    for m in ('best_of_n', 'auroc'):
      out[f'{m} {key} - policy_logprob'] = stats.paired_difference(
          [sel(r, key, m) for r in rows], [sel(r, base, m) for r in rows])
  for rule in ps.RULES:
    acc = lambda s: [r['attribution'][f'{s} {rule}']['accuracy'] for r in rows]
    out[f'attribution {rule} progress_advantage - policy_logprob'] = stats.paired_difference(
        acc('progress_advantage'), acc('policy_logprob'))
  return out


def run(config: ml_collections.ConfigDict, workdir: str, command: str) -> dict:
  aggregations(config.scoring.aggregations)  # refused before any work
  start = time.time()
  cfg = config.copy_and_resolve_references()  # the main job's config, for the loop
  with cfg.unlocked():
    del cfg['scoring']
  params0, sft_info = loop.sft(cfg, os.path.join(workdir, 'sft'))
  problem = loop.build_problem(cfg)
  rows = [per_seed(cfg, config.scoring, workdir, params0, seed, problem) for seed in cfg.seeds]
  return dict(command=command, task=cfg.task.to_dict(), scoring=config.scoring.to_dict(),
              rl_steps=cfg.rl.steps, kl_coef=cfg.loss.kl_coef, seeds=list(cfg.seeds),
              sft_greedy_acc=float(sft_info['greedy_acc']), per_seed=rows,
              paired=paired(rows), wall_s=time.time() - start)


def main():
  config = config_flags.DEFINE_config_file(
      'config', os.path.join(ROOT, 'configs', 'progress_scoring.py'), 'Scoring config.')
  workdir = flags.DEFINE_string('workdir', '', 'Run directory (default /tmp/treecredit/'
                                 'progress_scoring, with _kl for a run with a KL).')
  out = flags.DEFINE_string('out', os.path.join(ROOT, 'docs', 'results', 'progress_scoring.json'),
                            'Where the summary goes.')

  def go(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    command = ' '.join(['python -m experiments.progress_scoring'] +
                       [a for a in sys.argv[1:] if a.startswith('--config')])
    kl = '_kl' if config.value.loss.kl_coef else ''
    summary = run(config.value, workdir.value or f'/tmp/treecredit/progress_scoring{kl}', command)
    with open(out.value, 'w') as f:
      json.dump(summary, f, indent=1)
      f.write('\n')
    print(json.dumps(summary['paired'], indent=1))

  app.run(go)


if __name__ == '__main__':
  main()
