"""Hindsight, answer-conditioned step credit (issue 23): PBSD (#164) and HCAPO (#9) vs GRPO,
i.i.d. groups of 8, on scratch_add, whose gold answer the loop places after the prompt for
one extra teacher-forced pass (experiments/training/hindsight.py). `configs.tempo.family`:
the main job's budget, 5 seeds, matched generated tokens.
"""

from configs import tempo


def get_config():
  return tempo.family('pbsd:iid,hcapo:iid')
