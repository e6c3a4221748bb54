"""Milestone, hierarchical and subproblem credit (issue 23) vs GRPO.

    python -m experiments.milestones [--config.quick=True]                 # BEACON, ReBel: household
    python -m experiments.milestones --config=configs/milestones.py:steps  # SCRL, HRPO: scratch_add
    python -m experiments.milestones --config=configs/milestones.py:long   # BEACON, 2 sub-tasks
    python -m experiments.milestones --config=configs/milestones.py:long_warm  # from 450 SFT steps
    python -m experiments.milestones --config=configs/milestones.py:hiper  # HiPER on household

Default: BEACON (#28) and ReBel (#25: GRPO plus returns compared within milestone phases,
the policy's probability of each observation as a dense belief-consistency reward) on
household, `configs.agents.paper`'s budget (expert warm start, 30 RL steps x 16 start states
x G = 8), the loop filling `Turns.milestones` from household's sub-goals (holding or placing
the object, cleaning it when asked, solving) and `Turns.feedback_logprobs` by one
teacher-forced pass. `:steps`: SCRL
(#76), blockwise advantages with an outcome-conditioned baseline (#50) and HRPO's phase
advantages (#2) on scratch_add's verifiable steps, `configs.tempo.family`'s budget.
`:long`: BEACON on `household_long` (two sub-tasks in one episode, 20 turns; the expert
needs 8-12), where BEACON's claim is about long tasks; `:long3`: three sub-tasks in 30
turns (its warm start solves none of 256 held-out episodes, so GRPO's groups almost never
carry signal); `:long_warm`: `:long` from a 3x longer warm start (450 SFT steps), so that
outcome-only GRPO starts with signal and the comparison is about credit, not exploration.
`:hiper`: HiPER's hierarchical advantage estimation (#21, `hiper`: GAE within milestone
segments plus segment-level GAE over aggregated returns on each segment's first
turn, with the learned critic of configs/ppo.py:household) against GRPO and `ppo_turns` (the
same critic, flat GAE) on household. 5 seeds each,
paired intervals against GRPO at matched environment steps / generated tokens.
"""

from configs import agents, tempo


def get_config(arg: str = ''):
  if arg == 'steps':
    return tempo.family('scrl:iid,blockwise:iid,hrpo:iid')
  if arg == 'hiper':
    from configs import ppo
    c = ppo.get_config('household')
    c.methods = 'grpo:iid,ppo_turns:iid,hiper:iid'
    return c
  if arg not in ('', 'long', 'long3', 'long_warm'):
    raise ValueError(f'configs/milestones.py:{arg}: valid variants are "" (household), steps, '
                     f'long, long3, long_warm and hiper')
  c = agents.paper('grpo:iid,beacon:iid,rebel:iid' if arg == '' else 'grpo:iid,beacon:iid')
  if arg.startswith('long'):
    goals, turns = (3, 30) if arg == 'long3' else (2, 20)
    c.task.name, c.task.kwargs = 'household_long', {'num_goals': goals, 'max_turns': turns}
    c.model.attn_chunk = 128  # 858 / 1,454-token trajectories: ~3x faster steps, same numbers
  if arg == 'long_warm':
    c.sft.steps = 450  # 3x the paper's warm start: GRPO's groups carry signal from step 0
  c.seeds = (0, 1, 2, 3, 4)
  return c
