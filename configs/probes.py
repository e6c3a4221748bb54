"""Self-probe potentials on reasoning steps (issue 23): SPAE (#22), P2S (#148) and MIG (#173)
vs GRPO, i.i.d. groups of 8, on scratch_add, whose gold continuation the loop scores after
each of a response's column steps (experiments/training/probes.py: D + 1 teacher-forced
passes per batch). `configs.tempo.family`: the main job's budget, 5 seeds, matched
generated tokens.
"""

from configs import tempo


def get_config():
  return tempo.family('spae:iid,p2s:iid,mig:iid')
