"""Alternative policy losses and gradient masks (RGRA #61 'grpo:iid:rgra', APA #66 'grpo:iid:apa', EM with dis-preferred samples #156 'grpo:iid:em', the forecasting answer-only gradient mask #143 'answer_only') vs GRPO, i.i.d. groups of 8, on scratch_add (issue 22).
(`configs.tempo.family`: the main job's budget, 5 seeds, matched generated tokens.)
"""

from configs import tempo


def get_config():
  return tempo.family('grpo:iid:rgra,grpo:iid:apa,grpo:iid:em,answer_only:iid')
