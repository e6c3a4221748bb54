"""TreePO on a fixed (2, 2, 2) tree with 1-token segments vs GRPO.
(`configs.tempo.paper`: 100 RL steps, 3 seeds, the same rollout budget for every method).
"""

from configs import tempo


def get_config():
  return tempo.paper('grpo:iid,grpo:tree_fixed,treepo:tree_fixed',
                     branching=(2, 2, 2), segment_len=1)
