"""Response- and group-level confidence, entropy and difficulty reweighting (CANON #58, GEPO #85, ProGRPO #113, VERL #108, outcome-based exploration #125, MAPO #47, HA-DW #53, AAPO #48, ADORA #23, DDCA #88, DVAO #78, COPO #112) vs GRPO, i.i.d. groups of 8, on scratch_add (issue 22).
(`configs.tempo.family`: the main job's budget, 5 seeds, matched generated tokens.)
"""

from configs import tempo


def get_config():
  return tempo.family('canon:iid,canon_length:iid,gepo:iid,progrpo:iid,verl_rank:iid,outcome_explore:iid,mapo:iid,hadw:iid,aapo:iid,adora:iid,ddca:iid,dvao:iid,copo:iid')
