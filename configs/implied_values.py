"""Policy-implied values and log-ratio credit (VIMPO #32, progress advantage #52, endogenous reward #149) vs GRPO, i.i.d. groups of 8, on scratch_add (issue 22).
(`configs.tempo.family`: the main job's budget, 5 seeds, matched generated tokens.)
"""

from configs import tempo


def get_config():
  return tempo.family('vimpo:iid,progress_advantage:iid,progress_advantage_step:iid,endogenous:iid')
