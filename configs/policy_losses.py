"""Alternative policy losses and gradient masks (RGRA #61 'grpo:iid:rgra', APA #66 'grpo:iid:apa', the forecasting answer-only gradient mask #143 'answer_only') vs GRPO, i.i.d. groups of 8, on scratch_add (issue 22).
(`configs.tempo.family`: the main job's budget, 5 seeds, matched generated tokens.)
`:em`: EM with dis-preferred samples (#156, 'grpo:iid:em', em_alpha 0.5) with the KL to the
reference that the paper regularises it with (k3, kl_coef 0.1), against GRPO with the same KL.
"""

from configs import tempo

EM_KL_COEF = 0.1


def get_config(arg: str = ''):
  if arg == 'em':
    c = tempo.family('grpo:iid:em')
    c.loss.kl_coef = EM_KL_COEF
    return c
  if arg:
    raise ValueError(f"configs/policy_losses.py has one variant, 'em'; got {arg!r}")
  return tempo.family('grpo:iid:rgra,grpo:iid:apa,answer_only:iid')
