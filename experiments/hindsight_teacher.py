"""The hindsight teacher on the main job's warm start (issue 40, item 6: why PBSD collapses):
with the gold answer placed after the prompt, does the policy find a demonstration's correct
first column step likelier than the same step with a wrong total digit? And SIOP's signal on
its warm start (configs/hindsight.py's hinted one): how often is a group's largest answer
cluster the correct answer?

    python -m experiments.hindsight_teacher [--workdir=/tmp/treecredit/tempo]
        [--hinted_workdir=/tmp/treecredit/hindsight] [--n=256]

Per prompt, the first step's evidence e = Σ_{t in step 1} log π(y_t | x, a*, y_<t) −
log π(y_t | x, y_<t) (`credit.hindsight`'s d, the quantity PBSD and HCAPO weight steps by),
for the demonstration and for a copy whose last total digit in that step is (d + 1) mod 10.
A teacher that uses the answer gives the correct step the higher e. Writes mean ± std of
both, and the fraction where the correct step wins, to docs/results/hindsight_teacher.json;
and, for n/4 prompts with 8 samples each (temperature 1, as SIOP trains), the fraction of
correct responses and of groups whose largest exact-match answer cluster (ties: any of the
largest) is correct.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import credit
from configs import hindsight as hindsight_config
from configs import tempo
from experiments.rollouts import sampling
from experiments.training import hindsight, loop
from experiments.training.forward import group_rewards

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                   'results', 'hindsight_teacher.json')


def first_step_evidence(params, pcfg, task, prompts, info, seq, mask):
  """e float [n]: the first step's summed teacher − student log-probs of responses seq."""
  ends = task.step_ends(prompts, seq, mask, info) & mask
  first = jnp.cumsum(ends, -1) - ends == 0  # the tokens through the first step end
  wide, plen = hindsight.hindsight_prompts(prompts, None, info, task=task)
  lp = lambda p, n: loop.rows_logprobs(params, p, seq[:, None], mask[:, None], n, None,
                                       cfg=pcfg)[:, 0]
  return jnp.sum(jnp.where(first & mask, lp(wide, plen) - lp(prompts, None), 0.0), -1)


def corrupt_first_step(task, prompts, info, seq, mask):
  """seq with the digit before the first step end replaced by (digit + 1) mod 10."""
  ends = task.step_ends(prompts, seq, mask, info) & mask
  pos = jnp.argmax(ends, -1) - 1
  digit = jnp.take_along_axis(seq, pos[:, None], -1)
  return jnp.where(jnp.arange(seq.shape[-1]) == pos[:, None], (digit + 1) % 10, seq)


def modal_answer_correct(params, pcfg, task, key, n: int, g: int = 8):
  """(fraction of correct responses, fraction of groups whose largest answer cluster holds a
  correct response) over n prompts with g samples each."""
  prompts, info = task.sample(key, n)
  s = sampling.sample_iid(params, pcfg, jax.random.fold_in(key, 1), prompts, g, task.response_len,
                          eos_id=task.eos_id, pad_id=task.pad_id)
  rewards = group_rewards(prompts, s.tokens, s.mask, info, task=task)  # [n, g]
  rows = lambda x: jnp.repeat(x[:, None], g, 1)
  ends = task.step_ends(rows(prompts), s.tokens, s.mask, jax.tree.map(rows, info)) & s.mask
  _, share = credit.hindsight.answer_clusters(s.tokens, s.mask, ends)
  top = share >= jnp.max(share, -1, keepdims=True)
  modal_right = jnp.any(top & (rewards > 0) & (share > 0), -1)
  return float(jnp.mean(rewards > 0)), float(jnp.mean(modal_right))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--workdir', default='/tmp/treecredit/tempo')
  p.add_argument('--hinted_workdir', default='/tmp/treecredit/hindsight')
  p.add_argument('--n', type=int, default=256)
  p.add_argument('--out', default=OUT)
  args = p.parse_args(argv)
  cfg = tempo.get_config()
  cfg.progress = False
  params, sft_info = loop.sft(cfg, os.path.join(args.workdir, 'sft'))
  problem = loop.build_problem(cfg)
  task = problem.task
  prompts, info = task.sample(jax.random.key(0), args.n)
  demo, mask = task.demonstrations(prompts, info)
  wrong = corrupt_first_step(task, prompts, info, demo, mask)
  e_gold, e_wrong = (np.asarray(first_step_evidence(params, problem.pcfg, task, prompts, info,
                                                    s, mask)) for s in (demo, wrong))
  hinted = hindsight_config.get_config()
  hinted.progress = False
  hinted_params, hinted_info = loop.sft(hinted, os.path.join(args.hinted_workdir, 'sft'))
  right, modal_right = modal_answer_correct(hinted_params, problem.pcfg, task,
                                            jax.random.key(1), args.n // 4)
  stats = lambda e: {'mean': float(e.mean()), 'std': float(e.std(ddof=1))}
  out = {'command': 'python -m experiments.hindsight_teacher --n=%d' % args.n,
         'task': cfg.task.name, 'sft_greedy_acc': float(sft_info['greedy_acc']),
         'prompts': args.n, 'correct_first_step_evidence': stats(e_gold),
         'wrong_digit_first_step_evidence': stats(e_wrong),
         'fraction_correct_step_higher': float(np.mean(e_gold > e_wrong)),
         'siop_start': {'sft_greedy_acc': float(hinted_info['greedy_acc']),
                        'prompts': args.n // 4, 'group_size': 8,
                        'fraction_correct': right, 'fraction_modal_correct': modal_right}}
  with open(args.out, 'w') as f:
    json.dump(out, f, indent=1)
    f.write('\n')
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  main()
