"""TreeRL on EPTree-style trees (4 chains, each forked once at its highest -log p token) vs GRPO.
(`configs.tempo.paper`: 100 RL steps, 3 seeds, the same rollout budget for every method).
"""

from configs import tempo


def get_config():
  return tempo.paper('grpo:iid,grpo:tree_entropy,treerl:tree_entropy',
                     num_chains=4, num_forks=1, num_continuations=1, score='nll')
