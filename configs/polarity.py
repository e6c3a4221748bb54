"""Polarity asymmetry and curricula (NSR #82, WAPO #89, CAPO #49, A-GRAE #69) vs GRPO, i.i.d. groups of 8, on scratch_add (issue 22).
(`configs.tempo.family`: the main job's budget, 5 seeds, matched generated tokens.)
"""

from configs import tempo


def get_config():
  return tempo.family('nsr:iid,wapo:iid,capo:iid,a_grae:iid')
