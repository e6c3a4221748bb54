"""Search trees (issue 23's tree-search family): ELPO (#39) and TreePS-RAG (#181) vs GRPO on
scratch_add, `configs.tempo.family`'s budget (5 seeds, matched generated tokens: forks'
copied prefixes are not generated).

    python -m experiments.tree_search [--config.quick=True]                # ELPO
    python -m experiments.tree_search --config=configs/tree_search.py:steps  # TreePS-RAG
    python -m experiments.tree_search --config=configs/tree_search.py:appo   # APPO's forks

'tree_bisect' (experiments/rollouts/step_forks.py): 4 chains per prompt, then 2 rounds of one
continuation per chain at the step boundary a binary search picks (G = 12), so each failed
chain's first irrecoverable step is bracketed; `elpo` keeps a failure's negative advantage
only from there on. `grpo:tree_bisect` separates the sampler's effect from the credit's.
`:steps`: 'tree_steps', 2 chains, each response forked once at its first and then at its
second step boundary (G = 2 · 2² = 8), `treeps` (step-level Monte Carlo process advantage)
and `grpo` on that tree.
`:appo`: APPO's Branching Score (#35, 'tree_branching', experiments/rollouts/branching.py:
entropy × |likelihood gain of the chain's continuation over the best alternative token|,
8 highest-entropy positions probed per chain, 4 chains + 1 fork each, G = 8) against the
same tree forked at the highest-entropy token ('tree_entropy'), GRPO credit on both; and APPO's
own credit on its tree (`appo`: the initial rollouts and the branches normalised as two groups,
each branch's advantage added to the prefix it shares with its chain; branches not trained),
paired with `grpo:tree_branching`.
"""

from configs import tempo


def get_config(arg: str = ''):
  if arg == 'steps':
    c = tempo.family('grpo:tree_steps,treeps:tree_steps')
    c.sampler.num_chains, c.sampler.num_levels, c.sampler.num_continuations = 2, 2, 1
    return c
  if arg == 'appo':
    c = tempo.family('grpo:tree_entropy,grpo:tree_branching,appo:tree_branching')
    c.sampler.num_chains, c.sampler.num_forks, c.sampler.num_continuations = 4, 1, 1
    c.sampler.branch_candidates, c.sampler.branch_window = 8, 8
    return c
  if arg:
    raise ValueError(f'configs/tree_search.py:{arg}: valid variants are "" (ELPO), steps '
                     f'and appo')
  c = tempo.family('grpo:tree_bisect,elpo:tree_bisect')
  c.sampler.num_chains, c.sampler.num_rounds, c.sampler.num_continuations = 4, 2, 1
  return c
