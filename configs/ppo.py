"""PPO as verl runs it (issue 24): a learned critic, GAE with verl's γ = λ = 1, advantages
whitened over the batch (`credit` estimator `ppo`), and verl's clipped value loss
(`cliprange_value` 0.5), against GRPO and TEMPO on the same budget.

    python -m experiments.ppo                                     # scratch_add, the main job's budget
    python -m experiments.ppo --config=configs/ppo.py:household   # household (ppo_turns), the agents' budget
    python -m experiments.ppo --config=configs/ppo.py:tree        # the critic trained on tree values
    python -m experiments.ppo --config=configs/ppo.py:advantage   # the Advantage Model (#77)
    python -m experiments.ppo --config=configs/ppo.py:pum         # a prefix utility model (#90)
    python -m experiments.ppo --config=configs/ppo.py:prorag      # a tree-built PRM (#176)

The critic (experiments/training/critic.py) is a copy of the warm-start policy with a zero
value head, its own Adam (lr `critic.lr`), updated once per RL step on TD(λ) returns; its
compute (one forward for the values, epochs x forward + backward for its update) is
logged as `critic_s` and counts in each step's wall time, so curves against wall time
include it; at matched generated tokens or environment steps it is not charged. All three
methods share the project's policy loss (clip-higher 0.2 / 0.28, dual clip 3); verl's PPO
defaults differ there (docs/conventions.md). 5 seeds, paired 95 % intervals vs GRPO.
`:tree` (issue 24, item 4): PPO whose critic regresses TEMPO's prefix-tree values of each
step's groups (`critic.targets = 'tree'`: a process value model trained on tree labels)
instead of TD(λ) returns, against GRPO. `:advantage` (issue 24, #77): the Advantage Model,
the critic regressing each response's reward less its group's mean (`critic.targets =
'advantage'`), its output before the last token used as the response's advantage
(`advantage_model`; `critic.critic_warmup` = 10: verl's critic warm-up, the first 10 of the
40 steps update the model only), against GRPO. `:pum` (#90): a prefix utility model, the critic ranking
each response's prefixes by their tree values (`critic.targets = 'tree'`, `critic.loss =
'rank'`, 10 warm-up steps), its utility gain over each reasoning step added to GRPO (`pum`),
against GRPO. `:prorag` (#176): the same with the critic regressing the tree values (a
tree-built PRM, squared error) and `prorag`'s dual-granularity advantage.
"""

import ml_collections

from configs import agents, tempo

METHODS = 'grpo:iid,ppo:iid,tempo:iid'


def get_config(arg: str = ''):
  if arg == 'household':  # the critic's values at turn boundaries (`ppo_turns`)
    c = agents.paper('grpo:iid,ppo_turns:iid,tempo:iid')
  elif arg in ('', 'tree', 'advantage', 'pum', 'prorag'):
    c = tempo.get_config()
    c.methods = {'': METHODS, 'tree': 'grpo:iid,ppo:iid', 'pum': 'grpo:iid,pum:iid',
                 'prorag': 'grpo:iid,prorag:iid',
                 'advantage': 'grpo:iid,advantage_model:iid'}[arg]
  else:
    raise ValueError(f'configs/ppo.py:{arg}: valid variants are "" (scratch_add), household, '
                     f'tree, advantage, pum and prorag')
  c.seeds = (0, 1, 2, 3, 4)
  c.critic = ml_collections.ConfigDict(dict(
      lr=c.optimizer.lr, warmup_steps=c.optimizer.warmup_steps, cliprange_value=0.5,
      agg='token-mean', epochs=c.loss.num_epochs, minibatches=c.loss.num_minibatches,
      microbatches=c.loss.num_microbatches,
      targets={'tree': 'tree', 'pum': 'tree', 'prorag': 'tree',
               'advantage': 'advantage'}.get(arg, 'td_lambda'),
      loss='rank' if arg == 'pum' else 'mse',  # 'td_lambda', 'mse': verl's
      # The Advantage Model and PUM score every response: untrained, their noise (amplified
      # by Adam into full-size steps) collapsed or destabilised training; they first learn
      # from 10 steps' samples (the papers train them before RL).
      critic_warmup=10 if arg in ('advantage', 'pum', 'prorag') else 0))
  return c
