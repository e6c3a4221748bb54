"""Hindsight, answer-conditioned step credit (issue 23): PBSD (#164) and HCAPO (#9) vs GRPO,
i.i.d. groups of 8, on scratch_add, whose gold answer the loop places after the prompt for
one extra teacher-forced pass (experiments/training/hindsight.py); SIOP (#75), label-free,
with each response's own answer there instead. `configs.tempo.family`: the main job's
budget, 5 seeds, matched generated tokens.

The teacher is the policy reading the answer in context, which a model trained from scratch
has never seen (on the shared SFT start the answer in the prompt makes a correct first step
less likely than one with a wrong digit: `python -m experiments.hindsight_teacher`). So the
warm start here also sees the answer after half its demonstrations' prompts
(`sft.hindsight_frac` 0.5), and every method, GRPO included, starts from it: `:plain` keeps
the shared start.
"""

from configs import tempo


def get_config(arg: str = ''):
  if arg not in ('', 'plain'):
    raise ValueError(f'configs/hindsight.py:{arg}: valid variants are "" and plain')
  c = tempo.family('pbsd:iid,hcapo:iid,siop:iid')
  if arg == '':
    c.sft.hindsight_frac = 0.5
  return c
