"""Search trees (issue 23's tree-search family): ELPO (#39) vs GRPO on scratch_add,
`configs.tempo.family`'s budget (5 seeds, matched generated tokens: forks' copied prefixes
are not generated).

    python -m experiments.tree_search [--config.quick=True]

'tree_bisect' (experiments/rollouts/bisect.py): 4 chains per prompt, then 2 rounds of one
continuation per chain at the step boundary a binary search picks (G = 12), so each failed
chain's first irrecoverable step is bracketed; `elpo` keeps a failure's negative advantage
only from there on. `grpo:tree_bisect` separates the sampler's effect from the credit's.
"""

from configs import tempo


def get_config():
  c = tempo.family('grpo:tree_bisect,elpo:tree_bisect')
  c.sampler.num_chains, c.sampler.num_rounds, c.sampler.num_continuations = 4, 2, 1
  return c
