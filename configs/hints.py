"""Hinted rollouts (issue 23's hint family) vs GRPO on scratch_add, `configs.tempo.family`'s
budget (5 seeds, matched generated tokens: hint tokens are not generated).

    python -m experiments.hints                                 # MCTS-staged GRPO (#62)
    python -m experiments.hints --config=configs/hints.py:adhint  # ADHint (#94)

Default: `grpo:hinted`, every response of a group continues the same revealed prefix of
the reference, S − 1 steps at the start down to none at the end ('staged'). `:adhint`:
`adhint:hinted`, half of each group (4 of 8) continues a prefix whose length grows with the
prompt's difficulty prior ('difficulty'), the other half none, each half with its own
baseline. The sampler: experiments/training/hints.py.
"""

from configs import tempo


def get_config(arg: str = ''):
  if arg not in ('', 'adhint'):
    raise ValueError(f'configs/hints.py:{arg}: valid variants are "" (MCTS-staged) and adhint')
  c = tempo.family('adhint:hinted' if arg else 'grpo:hinted')
  c.sampler.hint_schedule = 'difficulty' if arg else 'staged'
  c.sampler.hint_rows = c.sampler.group_size // 2 if arg else c.sampler.group_size
  return c
