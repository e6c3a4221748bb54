"""FRPO (future-KL correction, beta = 0.01, reference = the SFT policy) vs GRPO, i.i.d. groups of 8.
(`configs.tempo.paper`: 100 RL steps, 3 seeds, the same rollout budget for every method).
"""

from configs import tempo


def get_config():
  return tempo.paper('grpo:iid,frpo:iid')
