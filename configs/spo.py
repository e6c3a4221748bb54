"""SPO-tree (fixed (2, 2, 2) tree, 1-token segments) and SPO-chain (forks at the first token with p < 0.9) vs GRPO.
(`configs.tempo.paper`: 100 RL steps, 3 seeds, the same rollout budget for every method).
"""

from configs import tempo


def get_config():
  return tempo.paper('grpo:iid,grpo:tree_fixed,spo_tree:tree_fixed,spo_chain:tree_cutpoints',
                     branching=(2, 2, 2), segment_len=1, num_chains=4, num_forks=1,
                     num_continuations=1, cut_threshold=0.9, cut_every=1)
