"""Value-guided decoding with a learned value (issue 24: controlled decoding #205, V-STAR #179).

    python -m experiments.value_decoding [--critic_steps 40] [--eval_prompts 512] [--seeds 3]
        [--candidates 4] [--blocks 4,8] [--workdir /tmp/treecredit/value_decoding] [--quick]

From the main job's SFT start on scratch_add (the shared families workdir's `sft/`, trained
first if absent), a critic (`experiments/training/critic.py`: a copy of the policy's trunk
with a value head) is trained on the frozen policy's own rollouts (64 prompts x 8 a step,
`--critic_steps` steps) to regress TEMPO's prefix-tree values of each group (`critic.targets
= 'tree'`: the success rate of the group's responses through each prefix). Then, on
held-out prompts, one response per prompt is decoded by

  sample          the policy (temperature 1), K = 1;
  vgd_b<n>        value-guided decoding: K candidates per block of n tokens, the next block
                  forked from the one the critic values most (experiments/rollouts/
                  value_guided.py);
  rerank          best of K whole samples by the critic's value before the EOS (one block);
  oracle          best of K whole samples by the task's reward (pass@K, the ceiling; the
                  same K draws as `rerank`, the first of them `sample`'s);

with the same K, and scored by the task's verifier. Sampled tokens per response are
reported: the guided procedures cost about K times `sample`. Seeds vary the critic's
training samples and the decoding draws. Writes value_decoding.json.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import tempo as tempo_config
from experiments.rollouts import sampling, value_guided
from experiments.training import critic as critic_lib
from experiments.training import loop
from experiments.training import train_step as ts


def train_critic(params, problem, cfg, seed: int, steps: int, prompts_per_step: int,
                 group_size: int, lr: float):
  """A critic on TEMPO's prefix values of the frozen policy's groups: (params, losses)."""
  pcfg = problem.pcfg
  state = critic_lib.init_state(params, pcfg, ts.make_optimizer(lr), seed=seed)
  ccfg = critic_lib.CriticConfig(cliprange_value=0.0, targets='tree')
  scfg = cfg.sampler.copy_and_resolve_references()
  scfg.name, scfg.group_size = 'iid', group_size
  key, losses = jax.random.PRNGKey(1000 + seed), []
  for i in range(steps):
    draw = problem.draw(jax.random.fold_in(key, 2 * i), i, prompts_per_step)
    samples = loop.sample(params, pcfg, problem, scfg, jax.random.fold_in(key, 2 * i + 1),
                          draw.prompts)
    rewards, _ = problem.rewards(draw, samples)
    b, g, l = samples.tokens.shape
    flat = lambda x: x.reshape(b * g, l)
    batch = critic_lib.CriticBatch(
        prompts=jnp.repeat(draw.prompts, g, 0), tokens=flat(samples.tokens),
        mask=flat(samples.mask), old_values=jnp.zeros((b * g, l), jnp.float32),
        returns=flat(critic_lib.tree_targets(samples.tokens, samples.mask, rewards)))
    state, m = critic_lib.critic_step_jit(state, batch, cfg=pcfg, ccfg=ccfg)
    losses.append(float(m['vf_loss']))
  return state.params, losses


def decode_all(params, critic_params, problem, prompts, info, key, *, candidates: int,
               blocks):
  """{procedure: (accuracy, sampled tokens per response)} on prompts [N, P]."""
  task, pcfg = problem.task, problem.pcfg
  n, l = prompts.shape[0], task.response_len
  rows = lambda k: jnp.repeat(prompts, k, 0)
  kw = dict(eos_id=task.eos_id, pad_id=task.pad_id)
  reward = lambda s: np.asarray(loop.group_rewards(prompts, s.tokens, s.mask, info,
                                                   task=task))  # [N, G]

  def guided(k, block_len):
    rep = rows(k)
    value_fn = lambda t, m: critic_lib.values_jit(critic_params, pcfg, rep, t)
    return value_guided.sample_value_guided(params, pcfg, key, prompts, 1, k, block_len, l,
                                            value_fn=value_fn, **kw)

  out = {}
  s = guided(1, l)  # K = 1: plain sampling
  out['sample'] = (float(reward(s).mean()), float(s.mask.sum()) / n)
  for block_len in blocks:
    s = guided(candidates, block_len)
    out[f'vgd_b{block_len}'] = (float(reward(s).mean()), candidates * float(s.mask.sum()) / n)
  s = guided(candidates, l)  # one block: rerank whole samples by the critic
  out['rerank'] = (float(reward(s).mean()), candidates * float(s.mask.sum()) / n)
  many = sampling.sample_iid(params, pcfg, key, prompts, candidates, l, **kw)
  out['oracle'] = (float(reward(many).max(-1).mean()), float(many.mask.sum()) / n)
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--critic_steps', type=int, default=40)
  parser.add_argument('--eval_prompts', type=int, default=512)
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--candidates', type=int, default=4)
  parser.add_argument('--blocks', default='4,8')
  parser.add_argument('--lr', type=float, default=3e-4)
  parser.add_argument('--sft_workdir', default='/tmp/treecredit/families')
  parser.add_argument('--workdir', default='/tmp/treecredit/value_decoding')
  parser.add_argument('--quick', action='store_true', help='a smoke run (seconds).')
  args = parser.parse_args(argv)
  cfg = tempo_config.get_config()
  cfg.progress = False
  steps, prompts_per_step, n_eval = args.critic_steps, cfg.rl.prompts_per_step, args.eval_prompts
  if args.quick:
    cfg.task.kwargs, cfg.sft.steps = {'num_digits': 1}, 300
    steps, prompts_per_step, n_eval = 2, 8, 16
  blocks = [int(x) for x in args.blocks.split(',') if x]
  t0 = time.time()
  params, sft_info = loop.sft(cfg, os.path.join(args.sft_workdir, 'sft'))
  problem = loop.build_problem(cfg)
  prompts, info = problem.task.sample(jax.random.PRNGKey(424242), n_eval)  # held out
  runs = []
  for seed in range(args.seeds):
    critic_params, losses = train_critic(params, problem, cfg, seed, steps, prompts_per_step,
                                         cfg.sampler.group_size, args.lr)
    res = decode_all(params, critic_params, problem, prompts, info, jax.random.PRNGKey(seed),
                     candidates=args.candidates, blocks=blocks)
    runs.append(dict(seed=seed, critic_loss_first=losses[0], critic_loss_last=losses[-1],
                     **{k: dict(acc=a, tokens=t) for k, (a, t) in res.items()}))
  names = [k for k in runs[0] if isinstance(runs[0][k], dict)]
  summary = {k: dict(acc_mean=float(np.mean([r[k]['acc'] for r in runs])),
                     acc_std=float(np.std([r[k]['acc'] for r in runs])),
                     tokens=float(np.mean([r[k]['tokens'] for r in runs]))) for k in names}
  print(f'SFT start greedy {sft_info["greedy_acc"]:.3f}; critic: {steps} steps x '
        f'{prompts_per_step} x {cfg.sampler.group_size} rollouts on tree values; K = '
        f'{args.candidates}; {n_eval} held-out prompts; {args.seeds} seeds; '
        f'{time.time() - t0:.0f} s')
  for k in names:
    print(f'{k:>10}  acc {summary[k]["acc_mean"]:.3f} ± {summary[k]["acc_std"]:.3f}   '
          f'sampled tokens / response {summary[k]["tokens"]:.1f}')
  os.makedirs(args.workdir, exist_ok=True)
  out = dict(args=vars(args), sft=sft_info, runs=runs, summary=summary)
  with open(os.path.join(args.workdir, 'value_decoding.json'), 'w') as f:
    json.dump(out, f, indent=1)
  return out


if __name__ == '__main__':
  main()
