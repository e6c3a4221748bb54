"""The method catalogue: every registered estimator with its paper, seed ids, family, needs,
hyperparameters, the config and script that run it, and verl's names for it
(`registry.ALIASES`); `python -m credit` prints it, docs/methods.md is `markdown()`.

Seed ids also feed the seed-method coverage table (`credit/seed_coverage.py`,
docs/coverage.md). Readings that replace the signal a method is about carry a `STAND_INS` line
(issue 40); `reading` is the first sentence of the estimator's docstring, where its paper and
the reading chosen are stated.
"""

import dataclasses
import inspect
import re
from typing import Optional

from credit import registry


@dataclasses.dataclass(frozen=True)
class Method:
  """One catalogue row (`entry(name)`)."""
  name: str
  paper: str  # as the project cites it; "#N" = seed id N (../shared/seeds)
  seeds: tuple
  family: str
  needs: tuple
  hparams: dict  # name -> default
  stateful: bool
  loss_mask: bool
  config: str
  script: str
  reading: str
  stand_in: str  # '' unless a stand-in replaces what the method is about
  aliases: tuple


# name -> (paper as cited, seed ids, config, script).
PAPERS = {
    'a3po': ('A3PO (#118, vague: our reading)', (118,), 'configs/entropy_weighting.py', 'experiments/entropy_weighting.py'),
    'a_grae': ('A-GRAE (#69, stateful)', (69,), 'configs/polarity.py', 'experiments/polarity.py'),
    'aapo': ('AAPO (#48): the reference model\'s response as the baseline, as the public code', (48,), 'configs/confidence.py', 'experiments/confidence.py'),
    'aapo_history': ('AAPO (#48) with a baseline tracked over training: ours (stateful)', (48,), 'configs/confidence.py', 'experiments/confidence.py'),
    'adhint': ('ADHint (#94), difficulty-scheduled hints (issue 23)', (94,), 'configs/hints.py:adhint', 'experiments/hints.py'),
    'adora': ('ADORA (#23, vague: the length criterion)', (23,), 'configs/confidence.py', 'experiments/confidence.py'),
    'advantage_model': ('Advantage Model (#77, issue 24)', (77,), 'configs/ppo.py:advantage', 'experiments/ppo.py'),
    'answer_only': ('Forecasting gradient mask (#143)', (143,), 'configs/policy_losses.py', 'experiments/policy_losses.py'),
    'appo': ('APPO (#35), branching-score forks and dual-group credit (issue 23)', (35,), 'configs/tree_search.py:appo', 'experiments/tree_search.py'),
    'avatar': ('AVATAR (#34): two-sided replay and Temporal Advantage Shaping (issue 23)', (34,), 'configs/replay.py (:tas)', 'experiments/replay.py'),
    'beacon': ('BEACON (#28), milestone-anchored dual-scale credit, multi-turn (issue 23)', (28,), 'configs/milestones.py (:long: household_long, 2 sub-tasks in 20 turns; :long3: 3 in 30; :long_warm: :long from a 450-step warm start)', 'experiments/milestones.py'),
    'bilevel_gae': ('Bi-Level GAE (#44, VAGEN), multi-turn (issue 24)', (44,), 'configs/ppo.py:household with --config.methods=bilevel_gae:iid', 'experiments/ppo.py'),
    'blockwise': ('Blockwise advantages, outcome-conditioned baseline (#50, issue 23)', (50,), 'configs/milestones.py:steps', 'experiments/milestones.py'),
    'canon': ('CANON (#58)', (58,), 'configs/confidence.py', 'experiments/confidence.py'),
    'canon_length': ('CANON (#58)', (58,), 'configs/confidence.py', 'experiments/confidence.py'),
    'capo': ('CAPO (#49, stateful curriculum)', (49,), 'configs/polarity.py', 'experiments/polarity.py'),
    'cast': ('CAST (solver values), multi-turn', (220,), 'configs/cast.py', 'experiments/cast.py'),
    'copo': ('COPO (#112)', (112,), 'configs/confidence.py', 'experiments/confidence.py'),
    'copo_turns': ('CoPO (#43, CogRouter), turn-confidence reweighting, multi-turn (issue 23)', (43,), 'configs/turn_norm.py:confidence', 'experiments/turn_norm.py'),
    'dcpo': ('DCPO (#116, vague: read from public code)', (116,), 'configs/entropy_weighting.py', 'experiments/entropy_weighting.py'),
    'ddca': ('DDCA (#88)', (88,), 'configs/confidence.py', 'experiments/confidence.py'),
    'dgpo': ('DGPO (#13): Hellinger(π, π_ref) × entropy redistribution', (13,), 'configs/entropy_weighting.py', 'experiments/entropy_weighting.py'),
    'distil': ('DistIL (#169), forward cross-entropy to the expert on learner states (issue 23)', (169,), 'configs/expert_traces.py:steps', 'experiments/expert_traces.py'),
    'dr_grpo': ('Dr. GRPO (Liu et al. 2025)', (), 'configs/tempo.py with --config.methods=dr_grpo:iid', 'experiments/tempo.py'),
    'dvao': ('DVAO (#78)', (78,), 'configs/confidence.py', 'experiments/confidence.py'),
    'elpo': ('ELPO (#39), binary-search rollout tree, error-localised credit (issue 23)', (39,), 'configs/tree_search.py', 'experiments/tree_search.py'),
    'endogenous': ('Endogenous reward (#149)', (149,), 'configs/implied_values.py', 'experiments/implied_values.py'),
    'frpo': ('FRPO (future-KL correction)', (8,), 'configs/frpo.py', 'experiments/frpo.py'),
    'gae': ("PPO's GAE (Schulman et al. 2016)", (), 'configs/ppo.py with --config.methods=gae:iid', 'experiments/ppo.py'),
    'gagpo': ('GAGPO, multi-turn', (5,), 'configs/gagpo.py', 'experiments/gagpo.py'),
    'gcpo': ('GCPO (#4, vague)', (4,), 'configs/context_shift.py', 'experiments/context_shift.py'),
    'gepo': ('GEPO (#85, stateful)', (85,), 'configs/confidence.py', 'experiments/confidence.py'),
    'gigpo': ('GiGPO (Feng et al. 2025), multi-turn', (), 'configs/gigpo.py', 'experiments/gigpo.py'),
    'grail': ('GRAIL (#55)', (55,), 'configs/saliency.py', 'experiments/saliency.py'),
    'graphgpo': ('GraphGPO, multi-turn', (20,), 'configs/graphgpo.py', 'experiments/graphgpo.py'),
    'grpo': ('GRPO (Shao et al. 2024)', (), 'configs/tempo.py', 'experiments/tempo.py'),
    'gtpo': ('GTPO turn-level returns', (30,), 'configs/gtpo.py', 'experiments/gtpo.py'),
    'hadw': ('HA-DW (#53, stateful)', (53,), 'configs/confidence.py', 'experiments/confidence.py'),
    'hcapo': ('HCAPO (#9), hindsight critic, multi-scale advantage (issue 23)', (9,), 'configs/hindsight.py', 'experiments/hindsight.py'),
    'hiper': ("HiPER (#21), hierarchical advantage estimation, multi-turn (issue 23; one flat policy: the planner's decision is each milestone segment's first turn)", (21,), 'configs/milestones.py:hiper (household, the critic of configs/ppo.py:household)', 'experiments/milestones.py'),
    'hrpo': ('HRPO (#2, AdaSR), phase-level advantages (issue 23)', (2,), 'configs/milestones.py:steps', 'experiments/milestones.py'),
    'ica': ('ICA (#155), retrieved-view credit, multi-turn (issue 23)', (155,), 'configs/tool_credit.py (webshop)', 'experiments/tool_credit.py'),
    'igpo': ('IGPO (Wang et al. 2025), multi-turn', (40,), 'configs/igpo.py (webshop)', 'experiments/igpo.py'),
    'infopo': ('InfoPO (#41), masked-feedback counterfactual, multi-turn (issue 23)', (41,), 'configs/expert_traces.py', 'experiments/expert_traces.py'),
    'intervention': ('InT (#131), single-step interventions before RL (issue 23)', (131,), 'configs/expert_traces.py:steps', 'experiments/expert_traces.py'),
    'mapo': ('MAPO, mixed advantage (#47)', (47,), 'configs/confidence.py', 'experiments/confidence.py'),
    'mapo_turns': ('MAPO for dialogue (#6), mixed turn/batch normalisation, multi-turn (issue 23)', (6,), 'configs/turn_norm.py', 'experiments/turn_norm.py'),
    'mars2_shaping': ('MARS² reward shaping', (37,), 'configs/tempo.py with --config.methods=mars2_shaping:tree_fixed', 'experiments/tempo.py'),
    'matchtir': ('MatchTIR (#27), expert-trace matching, multi-turn (issue 23)', (27,), 'configs/expert_traces.py', 'experiments/expert_traces.py'),
    'mc_values': ('Monte Carlo values at forks (VinePPO-style, issue 24)', (), 'configs/tempo.py with --config.methods=mc_values:tree_entropy', 'experiments/tempo.py'),
    'memopilot': ('MemoPilot (#42), context-independent turn advantage, multi-turn (issue 23)', (42,), 'configs/turn_norm.py', 'experiments/turn_norm.py'),
    'mig': ('MIG (#173), marginal information gain over a watermark (issue 23)', (173,), 'configs/probes.py', 'experiments/probes.py'),
    'miner': ('Miner (#29)', (29,), 'configs/entropy_weighting.py', 'experiments/entropy_weighting.py'),
    'mr_search': ('MR-Search (#31), meta-episodes of attempts with attempt-level credit, multi-turn (issue 23; the generated self-reflection is the environment\'s "retry" token, the failed attempt in context)', (31,), 'configs/turn_norm.py:retry', 'experiments/turn_norm.py'),
    'mt_grpo': ('MT-GRPO (#17), turn-level advantage, multi-turn (issue 23)', (17,), 'configs/turn_norm.py', 'experiments/turn_norm.py'),
    'ngrpo': ('NGRPO', (102,), 'configs/ngrpo.py', 'experiments/ngrpo.py'),
    'nsr': ('NSR, negative sample reinforcement (#82)', (82,), 'configs/polarity.py', 'experiments/polarity.py'),
    'outcome_explore': ('Outcome-based exploration (#125)', (125,), 'configs/confidence.py', 'experiments/confidence.py'),
    'p2s': ('P2S (#148), path faithfulness reward (issue 23)', (148,), 'configs/probes.py', 'experiments/probes.py'),
    'passk': ('Pass@k training (Chen et al. 2025)', (100,), 'configs/passk.py', 'experiments/passk.py'),
    'pbsd': ('PBSD (#164), Bayes-calibrated self-distillation weights (issue 23)', (164,), 'configs/hindsight.py', 'experiments/hindsight.py'),
    'pgpo': ('PGPO (#33)', (33,), 'configs/context_shift.py', 'experiments/context_shift.py'),
    'pica': ('PiCA (#187), pivot-anchored potential-based step rewards, multi-turn (issue 23)', (187,), 'configs/tool_credit.py (webshop)', 'experiments/tool_credit.py'),
    'polarity': ("polarity weights (the family's common form)", (), 'configs/polarity.py', 'experiments/polarity.py'),
    'ppo': ('PPO as verl runs it (issue 24)', (), 'configs/ppo.py (scratch_add; :household)', 'experiments/ppo.py'),
    'ppo_turns': ('PPO for multi-turn agents, values at turn boundaries (issue 24)', (), 'configs/ppo.py:household', 'experiments/ppo.py'),
    'progress_advantage': ('Progress advantage (#52) as a training bonus: ours; the paper scores with it (`credit.progress_scores`)', (52,), 'configs/implied_values.py', 'experiments/implied_values.py'),
    'progress_advantage_step': ('Progress advantage (#52) as a training bonus: ours; the paper scores with it (`credit.progress_scores`)', (52,), 'configs/implied_values.py', 'experiments/implied_values.py'),
    'progrpo': ('ProGRPO / ARM (#113)', (113,), 'configs/confidence.py', 'experiments/confidence.py'),
    'prorag': ('ProRAG (#176), a tree-built process reward model (issue 24)', (176,), 'configs/ppo.py:prorag', 'experiments/ppo.py'),
    'pum': ('PUM (#90), prefix utility model (issue 24)', (90,), 'configs/ppo.py:pum', 'experiments/ppo.py'),
    'pure': ('PURE (Cheng et al. 2025), min-form process credit', (72,), 'configs/tempo.py with --config.methods=pure:iid (the loop takes the per-step verifier rewards of scratch_add / countdown_steps)', 'experiments/tempo.py'),
    'qae': ('QAE', (12,), 'configs/qae.py', 'experiments/qae.py'),
    'r3': ('R³ (#73), replay of stored successes (issue 23)', (73,), 'configs/replay.py', 'experiments/replay.py'),
    'rebel': ("ReBel (#25), belief-aware grouping and belief-consistency reward, multi-turn (issue 23; our agents write no belief: the belief group is the milestone phase, the belief's agreement with the next observation the policy's own probability of it)", (25,), 'configs/milestones.py', 'experiments/milestones.py'),
    'reinforce_pp': ('REINFORCE++ (Hu et al. 2025)', (), 'configs/tempo.py with --config.methods=reinforce_pp:iid', 'experiments/tempo.py'),
    'reinforce_pp_baseline': ('REINFORCE++-baseline (Hu et al. 2025)', (), 'configs/tempo.py with --config.methods=reinforce_pp_baseline:iid', 'experiments/tempo.py'),
    'returns': ('REINFORCE returns (Williams 1992)', (), '', ''),
    'rloo': ('RLOO (Ahmadian et al. 2024)', (), 'configs/tempo.py with --config.methods=rloo:iid', 'experiments/tempo.py'),
    'rwft': ('Offline reward-weighted fine-tuning (#203, issue 23)', (203,), 'configs/replay.py:offline', 'experiments/replay.py'),
    'salt': ('SALT, multi-turn', (0,), 'configs/salt.py', 'experiments/salt.py'),
    'scrl': ('SCRL (#76), subproblem-level normalisation (issue 23)', (76,), 'configs/milestones.py:steps', 'experiments/milestones.py'),
    'sibling_grpo': ('TreeRPO / Sibling-GRPO (V-STAR)', (179,), 'configs/tempo.py with --config.methods=sibling_grpo:tree_fixed', 'experiments/tempo.py'),
    'siop': ("SIOP (#75), label-free potential toward each response's own answer cluster (issue 23)", (75,), 'configs/hindsight.py', 'experiments/hindsight.py'),
    'spae': ('SPAE (#22), step potential advantage (issue 23)', (22,), 'configs/probes.py', 'experiments/probes.py'),
    'spo_chain': ('SPO-chain (Guo et al. 2025)', (10,), 'configs/spo.py', 'experiments/spo.py'),
    'spo_tree': ('SPO-tree (Guo et al. 2025)', (10,), 'configs/spo.py', 'experiments/spo.py'),
    'stare': ('STARE (#18): surprisal-quantile weights, closed-loop entropy gate (stateful)', (18,), 'configs/entropy_weighting.py', 'experiments/entropy_weighting.py'),
    'taco': ('TACO, tail-aware (#38)', (38,), 'configs/entropy_weighting.py', 'experiments/entropy_weighting.py'),
    'taco_tools': ('TACO (#134), tool-call credit, multi-turn (issue 23; not taco, the token-level TACO)', (134,), 'configs/tool_credit.py (webshop)', 'experiments/tool_credit.py'),
    'tas': ('AVATAR (#34): two-sided replay and Temporal Advantage Shaping (issue 23)', (34,), 'configs/replay.py (:tas)', 'experiments/replay.py'),
    'taura': ('TAURA (#45), turn-entropy rescaled advantage, multi-turn (issue 23)', (45,), 'configs/turn_norm.py:confidence', 'experiments/turn_norm.py'),
    'tempo': ('TEMPO, Prefix-to-Tree credit', (68,), 'configs/tempo.py', 'experiments/tempo.py'),
    'tree_grpo': ('Tree-GRPO (Ji et al. 2025)', (), 'configs/tree_grpo.py', 'experiments/tree_grpo.py'),
    'treepo': ('TreePO (Li et al. 2025)', (), 'configs/treepo.py', 'experiments/treepo.py'),
    'treeps': ('TreePS-RAG (#181), multi-level step tree (issue 23)', (181,), 'configs/tree_search.py:steps', 'experiments/tree_search.py'),
    'treerl': ('TreeRL / EPTree (Hou et al. 2025)', (), 'configs/treerl.py', 'experiments/treerl.py'),
    'ucas': ('UCAS (#15)', (15,), 'configs/entropy_weighting.py', 'experiments/entropy_weighting.py'),
    'verl_rank': ('VERL, effective rank of hidden states (#108, vague: our reading)', (108,), 'configs/confidence.py', 'experiments/confidence.py'),
    'verl_rank_tokens': ('VERL (#108) on token one-hots instead of hidden states: ours', (108,), 'configs/confidence.py', 'experiments/confidence.py'),
    'vimpo': ('VIMPO (#32)', (32,), 'configs/implied_values.py', 'experiments/implied_values.py'),
    'wapo': ('WAPO (#89)', (89,), 'configs/polarity.py', 'experiments/polarity.py'),
}

# Readings where a stand-in replaces the quantity the method is about (issue 40, item 4).
STAND_INS = {
    'appo': ("the released scripts' future-KL loss weight (each token's advantage times "
             "1 + clip(exp(FutureKL), 1, 1.2)) is not applied; the reward scale M is 1 (upstream "
             "it acts only when the branch is at the last token: docs/conventions.md)"),
}

# Module that registers an estimator -> family (estimators that read `turns`: 'agent').
FAMILIES = {
    'outcome': 'outcome', 'frpo': 'outcome', 'returns': 'outcome',
    'tempo': 'tree', 'spo': 'tree', 'treerl': 'tree', 'treepo': 'tree', 'tree_grpo': 'tree',
    'siblings': 'tree', 'tree_search': 'tree',
    'entropy_weighting': 'token weighting', 'entropy_guided': 'token weighting',
    'confidence': 'token weighting', 'difficulty': 'token weighting',
    'polarity': 'token weighting', 'implied_values': 'token weighting',
    'context_shift': 'token weighting', 'saliency': 'token weighting',
    'answer_mask': 'token weighting',
    'pure': 'process', 'milestones': 'process', 'probes': 'process', 'hindsight': 'process',
    'expert_traces': 'process',
    'values': 'value', 'replay': 'replay',
}


def _reading(fn) -> str:
  """The docstring's first sentence (at most 200 characters)."""
  doc = ' '.join((inspect.getdoc(fn) or '').split('\n\n')[0].split())
  first = re.split(r'(?<=\.)\s(?=[A-Z`(])', doc)[0]
  return first if len(first) <= 200 else first[:199].rstrip() + '…'


def entry(name: str) -> Method:
  """The catalogue row of estimator `name` (an alias gives its target's row)."""
  name = registry.canonical(name)
  fn = registry.get(name)
  paper, seeds, config, script = PAPERS[name]
  module = inspect.getmodule(inspect.unwrap(fn)).__name__.split('.')[-1]
  needs = registry.needs(name)
  params = list(inspect.signature(fn).parameters.values())[1:]
  return Method(
      name=name, paper=paper, seeds=tuple(seeds),
      family='agent' if 'turns' in needs else FAMILIES.get(module, module),
      needs=needs, hparams={p.name: p.default for p in params if p.default is not p.empty},
      stateful=registry.stateful(name), loss_mask=registry.has_loss_mask(name),
      config=config, script=script, reading=_reading(fn), stand_in=STAND_INS.get(name, ''),
      aliases=tuple(sorted(a for a, t in registry.ALIASES.items() if t == name)))


def catalogue(family: Optional[str] = None, need: Optional[str] = None) -> list[Method]:
  """Every registered estimator's row, sorted by family and name; `family` / `need` filter."""
  rows = [entry(n) for n in registry.names()]
  rows = [m for m in rows if (family is None or m.family == family)
          and (need is None or need in m.needs)]
  return sorted(rows, key=lambda m: (m.family, m.name))


def _cell(text: str) -> str:
  return text.replace('|', '\\|')


def markdown() -> str:
  """docs/methods.md: one table per family (tests/test_catalogue.py keeps the file equal)."""
  rows = catalogue()
  out = ['# Methods', '',
         'Generated by `python -m credit --markdown > docs/methods.md` from `credit/catalogue.py` '
         'and the registry; do not edit by hand. `#N` is a seed id (`../shared/seeds`). '
         '"stand-in" marks a reading that replaces what the paper\'s method is about.', '']
  for family in sorted({m.family for m in rows}):
    out += [f'## {family}', '', '| name | paper | needs | hyperparameters | run with | reading |',
            '|---|---|---|---|---|---|']
    for m in (m for m in rows if m.family == family):
      hp = ', '.join(f'{k}={v!r}' for k, v in m.hparams.items())
      run = ' / '.join(x for x in (m.config, m.script) if x) or '—'
      name = f'`{m.name}`' + ''.join(f' (verl: `{a}`)' for a in m.aliases)
      flags = ''.join(f' *{f}*' for f, on in (('stateful', m.stateful),
                                               ('loss mask', m.loss_mask)) if on)
      reading = m.reading + (f' **Stand-in:** {m.stand_in}.' if m.stand_in else '')
      out.append(f'| {name}{flags} | {_cell(m.paper)} | {", ".join(m.needs) or "—"} | '
                 f'{_cell(hp) or "—"} | {_cell(run)} | {_cell(reading)} |')
    out.append('')
  return '\n'.join(out)
