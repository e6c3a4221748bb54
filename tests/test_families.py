"""The seed-family scripts (issue 22; issue 23: probes, hindsight, subproblems) run end to end
in quick mode: every method of each family trains from the shared SFT start on the same first batch as GRPO, and its credit
(or loss) actually changes the update."""

import importlib
import math

import pytest

from configs import tempo as tempo_config
from experiments.training import compare, loop

# Variants that add a method to another family's script run slow-marked (their loop paths
# have quick tests of their own: test_interventions, test_replay, test_milestones,
# test_step_forks; ADHint's 'difficulty' hints: test_hints, its sampler: the 'hints' run),
# except 'tree_search:appo', the only loop run of the 'tree_branching' sampler. 'policy_losses:em'
# is slow too: the 'em' loss is tested in test_policy_losses, the loop's per-method loss by
# 'policy_losses' and the KL in the loss by test_train_step.
# Also slow: families whose passes test_golden's fast cases run exactly (confidence: gepo_iid;
# context_shift: gcpo_iid; saliency: grail_iid; probes: spae_iid; hindsight: pbsd_iid, siop_iid;
# entropy_weighting's entropy, stateful credit and reference log-probs: gepo_iid, progrpo_kl).
FAMILIES = ('polarity', 'implied_values', 'policy_losses', 'hints',
            'tree_search', 'tree_search:appo',
            *(pytest.param(f, marks=pytest.mark.slow)
              for f in ('policy_losses:em', 'milestones:steps', 'expert_traces:steps',
                        'replay:offline',
                        'tree_search:steps', 'hints:adhint', 'confidence', 'context_shift',
                        'saliency', 'probes', 'hindsight:plain', 'entropy_weighting')))


# Methods whose documented reduction to GRPO holds on the quick run's first batch:
EQUAL_TO_GRPO_HERE = {
    'stare:iid',  # the entropy gate is closed: batch entropy above target_entropy = 0.3
    'taco:iid',   # no positively-credited token is in the surprisal tail (risk r <= 0)
    'miner:iid',  # no all-correct group in the batch
    'ddca:iid',   # one-digit responses: every correct response has the same length
    'dvao:iid',   # one column: the process reward is the outcome, so one objective
}


# Tree methods equal to GRPO on the same tree on the quick run's first batch:
EQUAL_TO_TWIN_HERE = {
    'elpo:tree_bisect',  # no failed response shares a prefix with a successful one
}


# Methods run with other hyperparameters here: outcome_explore's default outcome is the whole
# response, and whether two whole responses of one first-batch group are equal depends on the
# machine's float rounding (with none, its shaping is exactly 0: GRPO); the answer token
# (scratch_add's last) repeats within groups, so the shaping acts.
QUICK_METHODS = {'outcome_explore:iid': 'outcome_explore[answer_tokens=1]:iid'}


# Methods whose RL starts from other params (a phase of their own first), with the step-0
# field that shows the phase ran:
STARTS_ELSEWHERE = {'intervention:iid': 'intervention_rows'}


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  # One workdir for every family: the SFT start and the GRPO baseline run once.
  return tmp_path_factory.mktemp('families')


@pytest.mark.parametrize('family', FAMILIES)
def test_family_quick(family, workdir, final_plots_only):
  module, _, variant = family.partition(':')
  get_config = importlib.import_module(f'configs.{module}').get_config
  defaults, cfg = (get_config(variant), get_config(variant)) if variant else (get_config(),
                                                                              get_config())
  cfg.quick, cfg.progress = True, False
  tempo_config.shrink(cfg, defaults=defaults)
  cfg.quick = False
  # One-digit scratch_add and 400 SFT steps (seconds): the start earns some reward, so
  # the first batch carries signal (the quick 3-digit start is at 0: every update is 0).
  cfg.task.kwargs = {'num_digits': 1}
  cfg.sampler.num_levels = 1  # 'tree_steps' forks at most at its one reasoning step
  cfg.sft.steps, cfg.rl.steps, cfg.eval.every, cfg.rl.ckpt_every = 400, 1, 1, 1  # one update
  for old, new in QUICK_METHODS.items():
    cfg.methods = cfg.methods.replace(old, new)
  methods = [loop.method_name(*m) for m in loop.parse_methods(cfg.methods)]
  assert methods[0] == 'grpo:iid' and len(methods) >= 2
  summary = compare.run_experiment(cfg, str(workdir))
  assert sorted(summary['methods']) == sorted(methods)
  assert len(summary['plots']) == 3 and all((workdir / p).stat().st_size > 0
                                            for p in summary['plots'])
  rows = {m: loop.read_metrics(workdir / m.replace(':', '_') / 'seed0' / 'metrics.jsonl')
          for m in methods}
  for m in methods:
    assert [r['step'] for r in rows[m]] == [0, 1], m
    assert all(math.isfinite(r['loss']) for r in rows[m][1:]), m
    assert 0.0 <= rows[m][-1]['greedy_acc'] <= 1.0
  base = rows['grpo:iid'][1]
  same = []
  for m in methods[1:]:
    step1 = rows[m][1]
    if m in STARTS_ELSEWHERE:  # its RL starts after its own phase: another first batch
      assert rows[m][0][STARTS_ELSEWHERE[m]] > 0, m
      continue
    if m.endswith(':hinted'):  # its sampler puts hints in (staged: all at the start)
      assert step1['hint_tokens'] > 0 or not m.startswith('grpo'), m
    elif not m.endswith((':tree_bisect', ':tree_steps', ':tree_entropy', ':tree_branching')):
      # (those: another first batch)
      # Same start, same seed: the same first batch as GRPO ...
      assert step1['reward'] == base['reward'] and step1['generated_tokens'] == base['generated_tokens'], m
    assert step1['frac_groups_with_signal'] > 0, m
    # ... and a different update from it (the method's credit or loss is in the step), except
    # where a method's documented reduction to GRPO holds on this batch.
    if (step1['loss'], step1['grad_norm']) == (base['loss'], base['grad_norm']):
      same.append(m)
  assert same == [m for m in methods if m in EQUAL_TO_GRPO_HERE], same
  # A tree method beside GRPO on its own sampler: the same first batch as that GRPO run and,
  # unless its reduction to GRPO holds on it, a different update.
  same = []
  for m in methods:
    twin = f'grpo:{loop.parse_methods(m)[0][1]}'
    if m != twin and twin in rows and twin != 'grpo:iid':
      a, b = rows[m][1], rows[twin][1]
      assert (a['reward'], a['generated_tokens']) == (b['reward'], b['generated_tokens']), m
      if (a['loss'], a['grad_norm']) == (b['loss'], b['grad_norm']):
        same.append(m)
  assert same == [m for m in methods if m in EQUAL_TO_TWIN_HERE], same
