"""Context-shift token credit (GCPO #4, PGPO #33: one extra teacher-forced pass with the prompt changed) vs GRPO, i.i.d. groups of 8, on scratch_add (issue 22).
(`configs.tempo.family`: the main job's budget, 5 seeds, matched generated tokens.)
"""

from configs import tempo


def get_config():
  return tempo.family('gcpo:iid,pgpo:iid')
