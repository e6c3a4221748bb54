"""Seed-method coverage (issue 40): seed id → method → implemented / stand-in / partial / not.

The registered estimators of a seed come from the catalogue (`catalogue.PAPERS` seed ids) and
so do their stand-in lines (`catalogue.STAND_INS`); what the catalogue cannot know is kept
here as data, from the coverage audit (`../shared/seed_coverage.md`, project at a7a6a0e): the
125 in-scope seeds with their names and categories, the seeds implemented outside the
registry (samplers, losses, procedures), the named parts still missing (partial), the
stand-ins for a signal source, and the seeds not implemented. `markdown()` is
docs/coverage.md (`python -m credit --coverage`).

Status of a seed: 'not implemented' if listed in `NOT`; else 'partial' if listed in
`PARTIAL`; else 'stand-in' if listed in `STAND_IN_SOURCES` or one of its estimators has a
catalogue stand-in; else 'implemented'.
"""

import collections

from credit import catalogue

# id -> (method, category, off-domain): the audit's in-scope set and categories.
SEEDS = {
    0: ('SALT', 'AG', False), 1: ('A³', 'AG', False), 2: ('HRPO (AdaSR)', 'OT', False),
    3: ('HABC', 'OT', True), 4: ('GCPO', 'TR', False), 5: ('GAGPO', 'AG', False),
    6: ('MAPO (dialogue)', 'AG', False), 7: ('TRIAGE', 'AG', False), 8: ('FRPO', 'OB', False),
    9: ('HCAPO', 'AG', False), 10: ('SPO (chain/tree)', 'ETS', False), 11: ('STAMP', 'AG', False),
    12: ('QAE', 'OB', False), 13: ('DGPO', 'TR', False), 14: ('ARM', 'OT', True),
    15: ('UCAS', 'TR', False), 16: ('DelTA', 'TR', False),
    17: ('MT-GRPO-style turn advantage', 'AG', False), 18: ('STARE', 'TR', False),
    19: ('TreeGRPO (diffusion)', 'ETS', True), 20: ('GraphGPO', 'AG', False),
    21: ('HiPER', 'AG', False), 22: ('SPAE', 'OT', False), 23: ('ADORA', 'OB', False),
    25: ('ReBel', 'AG', False), 26: ('MARS, self-play games', 'AG', False),
    27: ('MatchTIR', 'AG', False), 28: ('BEACON', 'AG', False), 29: ('Miner', 'TR', False),
    30: ('GTPO', 'AG', False), 31: ('MR-Search', 'AG', False), 32: ('VIMPO', 'OT', False),
    33: ('PGPO', 'TR', False), 34: ('AVATAR', 'OP', False), 35: ('APPO', 'ETS', False),
    36: ('RTT', 'TR', False), 37: ('MARS²', 'ETS', False), 38: ('TACO (tail-aware)', 'TR', False),
    39: ('ELPO', 'ETS', False), 40: ('IGPO', 'AG', False), 41: ('InfoPO', 'AG', False),
    42: ('MemoPilot', 'AG', False), 43: ('CoPO (CogRouter)', 'AG', False),
    44: ('Bi-Level GAE / VAGEN', 'AG', False), 45: ('TAURA', 'AG', False),
    46: ('SLEA-RL', 'AG', False), 47: ('MAPO (mixed advantage)', 'OB', False),
    48: ('AAPO', 'OB', False), 49: ('CAPO', 'OB', False),
    50: ('Blockwise advantages / OCB', 'OT', False), 52: ('Progress advantage', 'OT', False),
    53: ('HA-DW', 'OB', False), 55: ('GRAIL', 'TR', False), 56: ('Off-policy DAE', 'OP', True),
    58: ('CANON', 'OB', False), 59: ('Knapsack budget', 'OT', False), 61: ('RGRA', 'OB', False),
    62: ('MCTS-staged GRPO', 'ETS', False), 63: ('Off-policy GRPO', 'OP', False),
    66: ('APA', 'OT', False), 68: ('TEMPO (P2T)', 'TPT', False), 69: ('A-GRAE', 'OB', False),
    71: ('Stepwise-Flow-GRPO', 'OT', True), 72: ('PURE', 'OT', False), 73: ('R³', 'OP', False),
    75: ('SIOP', 'AG', False), 76: ('SCRL', 'OT', False), 77: ('Advantage Model', 'OT', False),
    78: ('DVAO', 'OB', False), 80: ('LLM potential rewards, MARL', 'AG', True),
    81: ('Hindsight PRIOR', 'OT', True), 82: ('NSR (negative-only)', 'OB', False),
    85: ('GEPO', 'OB', False), 86: ('AWPO', 'OB', False), 88: ('DDCA', 'OB', False),
    89: ('WAPO', 'OB', False), 90: ('PUM', 'TPT', False),
    92: ('Online RLHF, ENN + affirmative nudge', 'OB', False), 94: ('ADHint', 'OP', False),
    98: ('AWM', 'OT', True), 100: ('Pass@k training', 'OB', False), 102: ('NGRPO', 'OB', False),
    106: ('LOOP (diffusion)', 'OB', True), 108: ('VERL', 'OB', False), 109: ('ReAd', 'AG', True),
    112: ('COPO (consistency-aware)', 'OB', False), 113: ('ProGRPO / ARM', 'OB', False),
    114: ('BT reward transformation', 'OB', False), 116: ('DCPO', 'TR', False),
    118: ('A3PO', 'TR', False), 121: ('SEED', 'AG', False),
    125: ('Outcome-based exploration', 'OB', False), 130: ('OPAC', 'OT', True),
    131: ('InT', 'OT', False), 134: ('TACO (tool credit)', 'AG', False), 138: ('LeTS', 'AG', False),
    139: ('SPO, self-play preference', 'OB', False),
    143: ('Forecast reward + gradient mask', 'TR', False), 148: ('P2S', 'OT', False),
    149: ('Endogenous reward', 'OT', False), 153: ('Shapley + PRM, MAS', 'AG', False),
    155: ('ICA', 'AG', False), 156: ('EM with dis-preferred', 'OT', False),
    164: ('PBSD', 'AG', False), 166: ('CCPO', 'AG', False), 168: ('OTA', 'OT', True),
    169: ('DistIL', 'OT', False), 170: ('VARD', 'OT', True), 173: ('MIG', 'OT', False),
    176: ('ProRAG', 'AG', False), 177: ('StepORLM', 'OT', False), 179: ('V-STAR', 'ETS', False),
    181: ('TreePS-RAG', 'ETS', False), 183: ('SLPO', 'OT', True), 184: ('GenAC', 'OT', False),
    187: ('PiCA', 'AG', False), 188: ('ArenaRL', 'OB', False),
    193: ('IRL dense reward', 'OT', False), 200: ('Trust-GRPO', 'OB', False),
    203: ('Offline reward-weighted FT', 'OP', False), 205: ('Controlled decoding', 'OP', False),
    209: ('VDN', 'AG', True), 211: ('RBIS', 'OP', True),
    214: ('SHAP/LIME token shaping', 'TR', False), 220: ('CAST', 'AG', False),
}

# id -> where, for seeds built outside the registry (or beside a registered name).
ELSEWHERE = {
    19: '`spo_tree` / `treerl`: the tree-backup mechanism on token trees',
    46: 'sampler `experience` + `gigpo`',
    52: ('`credit.progress_scores`: step and trajectory scores, best-of-N, uncertainty, '
         'failure attribution (`experiments/progress_scoring.py`)'),
    59: '`grpo` on sampler `knapsack`',
    61: 'loss `rgra`',
    62: "`grpo` on sampler `hinted` (`hint_schedule='staged'`)",
    63: '`grpo` on sampler `lagged`',
    66: 'loss `apa`',
    106: '`rloo` + the clipped surrogate (the mechanism; diffusion n/a)',
    156: 'loss `em`',
    179: 'experiments/rollouts/value_guided.py (inference only)',
    203: 'on sampler `lagged` + loss `rgra`',
    205: 'experiments/rollouts/value_guided.py (an inference procedure)',
}

# id -> the named part that is missing (the core is built).
PARTIAL = {
    5: 'the action-level importance ratio (the loss has only the token ratio)',
    19: 'diffusion denoising trees (off-domain)',
    21: 'no planner / executor: segments are closed by the environment\'s milestones',
    25: 'the agent writes no belief: the belief group is the milestone phase',
    32: 'the value loss through which rewards enter',
    39: 'error-localised adaptive clipping',
    44: 'the World Modeling Reward (the turn reward is the environment\'s)',
    62: "no MCTS: the prefixes are the gold demonstration's, on a shrinking schedule",
    73: 'in-context self-reflection and the entropy-ranking reward for failed samples',
    77: 'Selective Rehearsal',
    94: 'consistency-based gradient modulation inside hints',
    173: 'the Dual-Gated SFT objective',
    176: 'PRM-guided reasoning refinement (stage 3)',
    179: 'value-guided decoding as a training sampler',
}

# id -> what replaces a signal source the method names (its credit computation is built).
STAND_IN_SOURCES = {
    2: 'streaming vs deep-reasoning phases = CoT steps vs answer, the step verifier as reward',
    4: "the negative prompt is the next group's prompt",
    6: "the judge's per-turn rewards are the environment's",
    9: 'the LLM hindsight critic is one teacher-forced pass with the gold answer',
    13: 'Hellinger(π, π_ref) from the sampled token only',
    22: 'the probe teacher-forces the gold continuation',
    27: "the ground-truth trace is the environment's privileged expert",
    31: 'the self-reflection is the environment\'s "retry" token',
    33: "the ablated input is the next group's prompt; one-sample token KL",
    34: 'key reasoning phases = a fixed positional U',
    46: 'counted (state, action) success rates replace LLM-distilled experiences',
    75: ('exact-match answers replace NLI clusters; the reliability calibration is off (its '
         'evidence is NLI over tool observations), so q is the cluster\'s share'),
    131: "the step verifier finds the error and the reference's step is the intervention",
    134: "the probe's reward is the gold answer's geometric-mean token probability",
    169: "the expert's next step at the first wrong step only",
    187: 'pivots = exact states reached by a successful trajectory of the group',
}

# id -> why it is not implemented.
NOT = {
    1: 'external (CLI / AST); vague', 3: 'off-domain: robotics, learned critics',
    7: 'learned judge role labels', 11: 'external: citation verifier, deep search',
    14: 'off-domain: robotics', 16: 'not built: needs per-token gradient vectors',
    26: 'external: no multi-agent environment', 36: 'learned token-relevance discriminator',
    56: 'off-domain: classic RL, learned', 71: 'off-domain: flow models',
    80: 'off-domain: multi-agent, LLM ranker', 81: 'off-domain: PbRL world model',
    86: 'not built (buildable on the step-verifier rewards)', 92: 'learned epistemic reward net',
    98: 'off-domain: diffusion', 109: 'off-domain: multi-agent, learned critic',
    114: 'learned Bradley–Terry reward models', 121: 'external: the policy writes NL skills',
    130: 'off-domain: offline RL theory', 138: 'vague process-reward module for RAG',
    139: 'learned preference model', 153: 'multi-agent, conceptual', 166: 'multi-agent',
    168: 'off-domain: offline goal-conditioned RL', 170: 'off-domain: diffusion, learned value',
    177: 'learned generative PRM', 183: 'off-domain: latent reasoning',
    184: 'learned / external generative critic', 188: 'learned pairwise judge',
    193: 'learned: IRL from demonstrations', 200: 'learned thinking reward model',
    209: 'off-domain: classic MARL', 211: 'off-domain: classic off-policy returns',
    214: 'learned: RM attributions and bilevel optimisation',
}

STATUSES = ('implemented', 'stand-in', 'partial', 'not implemented')

Row = collections.namedtuple('Row', 'seed method category off_domain status names where note')


def rows() -> list:
  """One `Row` per in-scope seed, sorted by id."""
  names = collections.defaultdict(list)
  stand_ins = collections.defaultdict(list)
  for m in catalogue.catalogue():
    for seed in m.seeds:
      names[seed].append(m.name)
      if m.stand_in:
        stand_ins[seed].append(f'`{m.name}`: {m.stand_in}')
  out = []
  for seed, (method, category, off) in sorted(SEEDS.items()):
    if seed in NOT:
      status, note = 'not implemented', NOT[seed]
    else:
      notes = ([f'missing: {PARTIAL[seed]}'] if seed in PARTIAL else []) + stand_ins[seed] + (
          [STAND_IN_SOURCES[seed]] if seed in STAND_IN_SOURCES else [])
      note = '; '.join(notes)
      status = ('partial' if seed in PARTIAL else
                'stand-in' if stand_ins[seed] or seed in STAND_IN_SOURCES else 'implemented')
    out.append(Row(seed, method, category, off, status, tuple(sorted(names[seed])),
                   ELSEWHERE.get(seed, ''), note))
  return out


def counts(table=None, llm_only=False) -> dict:
  """{status: number of seeds}; `llm_only` leaves out the off-domain ones."""
  table = rows() if table is None else table
  c = collections.Counter(r.status for r in table if not (llm_only and r.off_domain))
  return {s: c.get(s, 0) for s in STATUSES}


def markdown() -> str:
  """docs/coverage.md (tests/test_seed_coverage.py keeps the file equal)."""
  table = rows()
  out = ['# Seed-method coverage', '',
         'Generated by `python -m credit --coverage > docs/coverage.md` from the catalogue '
         '(`credit/catalogue.py`: seed ids, stand-in lines) and `credit/seed_coverage.py` '
         '(the in-scope seeds, what is built outside the registry, missing parts, stand-ins for '
         'a signal source, what is not built); do not edit by hand. `#` is the seed id '
         '(`../shared/seeds`), the category the coverage audit\'s. **implemented**: the '
         "method's mechanism is computed; **stand-in**: it is, but a stand-in replaces a signal "
         'it names; **partial**: a named part is missing; **not implemented**: nothing computes '
         'it.', '',
         '| | ' + ' | '.join(STATUSES) + ' | all |', '|---|' + '---|' * (len(STATUSES) + 1)]
  for label, llm in (('all seeds', False), ('LLM post-training (no off-domain)', True)):
    c = counts(table, llm)
    out.append(f'| {label} | ' + ' | '.join(str(c[s]) for s in STATUSES) +
               f' | {sum(c.values())} |')
  out += ['', '| # | method | category | status | registered as / built in | note |',
          '|---|---|---|---|---|---|']
  for r in table:
    where = ', '.join(f'`{n}`' for n in r.names)
    where = '; '.join(x for x in (where, r.where) if x) or '—'
    method = r.method + (' [off-domain]' if r.off_domain else '')
    note = (r.note or '—').replace('|', '\\|')
    out.append(f'| {r.seed} | {method} | {r.category} | {r.status} | {where} | {note} |')
  return '\n'.join(out) + '\n'
