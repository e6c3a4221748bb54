"""Progress advantage as a scorer (#52, issue 40): `python -m experiments.progress_scoring`.

The main job's SFT warm start is π_ref and GRPO from it (the main job's run, one per seed) is
π_θ. `:kl`: GRPO with a k3 KL to π_ref in the loss (`kl_coef` 0.1, as `policy_losses.py:em`),
the KL-regularised RL whose optimum the paper's identity log π*/π_ref = A*/β is about. Each
seed's π_θ samples `scoring.group_size` responses to each of `scoring.prompts` held-out
prompts (the main job's evaluation prompts), scored with `credit.progress_scores` and with
π_θ's own log-probabilities (the authors' 'policy_logprob' baseline) under each (token, step)
aggregation of `scoring.aggregations`.
"""

import ml_collections

from configs import policy_losses, tempo


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  if arg not in ('', 'kl'):
    raise ValueError(f"configs/progress_scoring.py has one variant, 'kl'; got {arg!r}")
  c = tempo.get_config()
  if arg == 'kl':
    c.loss.kl_coef = policy_losses.EM_KL_COEF
  c.methods = 'grpo:iid'
  c.seeds = (0, 1, 2, 3, 4)
  c.progress = False
  c.scoring = ml_collections.ConfigDict(dict(
      prompts=512, group_size=8, temperature=1.0, beta=1.0,
      # "token/step": the authors' best-of-N and uncertainty default is mean/mean; sum/sum is
      # the whole response's log-ratio (the implied return); min/min the weakest token and step
      aggregations='mean/mean,sum/sum,min/min',
      failure_token_agg='min'))  # the authors' failure-attribution default
  return c
