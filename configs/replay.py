"""Off-policy and replay (issue 23): R³ (#73: a stored success replayed into all-fail groups),
AVATAR (#34: also a stored failure into all-success groups; with Temporal Advantage Shaping,
`credit.hparams.tas` 1, 0 for the replay alone) and off-policy GRPO
(#63: sampling from the policy of the last multiple of sampler.lag = 4 steps) vs GRPO, i.i.d. groups of 8, on scratch_add with a fixed pool of 256 training prompts
per seed (rl.prompt_pool; every method, GRPO included, trains on the same pool, so each
prompt recurs about 10 times in 40 steps). `configs.tempo.family`'s budget otherwise: 5
seeds, matched generated tokens (replayed responses are not counted as generated).

`:offline`: offline reward-weighted fine-tuning (#203, `rwft:lagged:rgra`: reward-weighted
NLL on rollouts of the frozen warm start, `sampler.lag` = the run's steps) vs GRPO on fresh
prompts, `configs.tempo.family`'s budget.

`:knapsack`: Knapsack RL's budget allocation (#59, `grpo:knapsack`: each step's 64 × 8
rollouts shared out by the prompts' pass rates at their last visit, 2 to 16 a prompt) vs
GRPO with i.i.d. groups of 8 on the same 256-prompt pools, as the default variant.

`:tas`: AVATAR's Temporal Advantage Shaping (#34): `tas:iid` (GRPO's advantage reweighted along
each response, first and last tokens 2x the middle one, mean 1) and `avatar:iid` (the replay
above and TAS) vs GRPO on the same 256-prompt pools.

    python -m experiments.replay [--config=configs/replay.py:offline|knapsack|tas]
"""

from configs import tempo


def get_config(arg: str = ''):
  if arg == 'offline':
    c = tempo.family('rwft:lagged:rgra')
    c.sampler.lag = c.rl.steps
    return c
  if arg == 'knapsack':
    c = tempo.family('grpo:knapsack')
    c.rl.prompt_pool = 256
    return c
  if arg not in ('', 'tas'):
    raise ValueError(f'configs/replay.py:{arg}: valid variants are "", offline, knapsack and '
                     f'tas')
  c = tempo.family('tas:iid,avatar:iid' if arg else 'r3:iid,avatar:iid,grpo:lagged')
  c.rl.prompt_pool = 256
  return c
