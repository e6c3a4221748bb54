"""Where the forecasting gradient mask (#143, `answer_only`) collapses on `scratch_add` (issue 40,
item 6): in the answer, the only tokens it trains, or in the scratchpad it leaves untrained?

    python -m experiments.answer_copy [--workdir=/tmp/treecredit/answer_copy] [--seeds=0,1,2]

In `scratch_add` the answer is a copy of the scratchpad: its digits are the column totals'
units and the last carry. For the main job's warm start and, per seed, GRPO and
`answer_only:iid` trained from it (the main job's budget), on the held-out prompts (greedy, as
the evaluation): the accuracy, the fraction whose D column steps are all valid, and the
fraction of well-formed responses (D steps, an answer, EOS) whose answer equals the one their
own scratchpad implies (copy fidelity). Writes docs/results/answer_copy.json.
"""

import argparse
import json
import os
import time

import jax
import numpy as np

from configs import tempo
from experiments.rollouts import sampling
from experiments.training import loop

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                   'results', 'answer_copy.json')
METHODS = ('grpo:iid', 'answer_only:iid')


def implied_answer(text: str, digits: int):
  """(written answer, answer the written column totals imply), both ints, or None for a
  response that is not D comma-closed steps 'terms=total', digits and EOS."""
  if not text.endswith('<eos>'):
    return None
  parts = text[:-len('<eos>')].split(',')
  if len(parts) != digits + 1 or not parts[-1].isdigit():
    return None
  totals = [p.partition('=')[2] for p in parts[:-1]]
  if not all(t.isdigit() and 1 <= len(t) <= 2 for t in totals):
    return None
  value = sum((int(t) % 10) * 10**i for i, t in enumerate(totals))
  return int(parts[-1]), value + (int(totals[-1]) // 10) * 10**digits


def measure(params, pcfg, task, prompts, info) -> dict:
  """Greedy accuracy, all-steps-valid rate and copy fidelity on the held-out prompts."""
  s = sampling.sample_iid(params, pcfg, jax.random.key(0), prompts, 1, task.response_len,
                          temperature=0.0, eos_id=task.eos_id, pad_id=task.pad_id)
  tokens, mask = s.tokens[:, 0], s.mask[:, 0]
  v = task.verify(tokens, mask, info)
  reward = np.asarray(task.reward(prompts, tokens, mask, info))
  steps_ok = np.asarray(v['step_valid']).all(-1)
  vocab = task.vocab
  texts = [''.join(vocab[t] for t, m in zip(row, keep) if m)
           for row, keep in zip(np.asarray(tokens), np.asarray(mask))]
  parsed = [implied_answer(t, task.num_digits) for t in texts]
  formed = [p for p in parsed if p is not None]
  return dict(acc=float(reward.mean()), steps_valid=float(steps_ok.mean()),
              well_formed=len(formed) / len(parsed),
              copy_fidelity=float(np.mean([a == b for a, b in formed])) if formed else None,
              answer_right_given_steps_valid=float(reward[steps_ok].mean()) if steps_ok.any()
              else None)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--workdir', default='/tmp/treecredit/answer_copy')
  p.add_argument('--seeds', default='0,1,2')
  p.add_argument('--out', default=OUT)
  args = p.parse_args(argv)
  start = time.time()
  cfg = tempo.get_config()
  cfg.progress = False
  params0, sft_info = loop.sft(cfg, os.path.join(args.workdir, 'sft'))
  problem = loop.build_problem(cfg)
  task, pcfg = problem.task, problem.pcfg
  prompts, info = task.sample(jax.random.PRNGKey(cfg.eval.seed), cfg.eval.num_prompts)
  out = dict(command='python -m experiments.answer_copy --seeds=' + args.seeds,
             task=cfg.task.to_dict(), rl_steps=cfg.rl.steps, prompts=cfg.eval.num_prompts,
             sft_greedy_acc=float(sft_info['greedy_acc']),
             start=measure(params0, pcfg, task, prompts, info), runs={m: [] for m in METHODS})
  for seed in (int(x) for x in args.seeds.split(',')):
    for m in METHODS:
      run = loop.train(cfg, os.path.join(args.workdir, f'{m.split(":")[0]}_s{seed}'), params0,
                       method=m, seed=seed, progress=False)
      out['runs'][m].append(dict(seed=seed, **measure(run['params'], pcfg, task, prompts, info)))
  out['wall_s'] = time.time() - start
  with open(args.out, 'w') as f:
    json.dump(out, f, indent=1)
    f.write('\n')
  print(json.dumps({k: v for k, v in out.items() if k != 'task'}, indent=1))


if __name__ == '__main__':
  main()
