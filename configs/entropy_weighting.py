"""Entropy / surprisal token weighting (STARE #18, TACO #38, A3PO #118, Miner #29, DGPO #13, UCAS #15, DCPO #116) vs GRPO, i.i.d. groups of 8, on scratch_add (issue 22).
(`configs.tempo.family`: the main job's budget, 5 seeds, matched generated tokens.)
"""

from configs import tempo


def get_config():
  return tempo.family('stare:iid,taco:iid,a3po:iid,miner:iid,dgpo:iid,ucas:iid,dcpo:iid')
