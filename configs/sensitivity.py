"""Where finer credit pays (issue 42): a horizon x group-size sweep of credit estimators on
scratch_add and an agent horizon pair, each cell one `compare.run_experiment` comparison
at its family's main-job budget, every method paired against GRPO on its own sampler.

    python -m experiments.sensitivity --config=configs/sensitivity.py --workdir=DIR
        [--config.cells=scratch_add_d5_g4,household_g8] [--config.seeds="(0,1,2)"] [--report]

The study's design, and the choices made where the issue is silent: docs/sensitivity.md.
"""

import re

import ml_collections

from configs import agents as agents_config
from configs import ppo as ppo_config
from configs import tempo as tempo_config

METHODS = ('grpo:iid,tempo:iid,grpo:tree_entropy,treerl:tree_entropy,mc_values:tree_entropy,'
           'ppo:iid,scrl:iid')
AGENT_METHODS = 'grpo:iid,beacon:iid,mt_grpo:iid,gigpo:iid'
MAX_DIGITS = 8  # envs.scratchpad_addition: num_digits in [1, 8]
AGENT_TASKS = {'household': dict(kwargs={'max_turns': 8}),
               'household_long': dict(kwargs={'num_goals': 2, 'max_turns': 20}, attn_chunk=128)}


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.quick = False     # every cell shrunk to a smoke run (configs.tempo / configs.agents shrink)
  c.progress = False  # tqdm bars per run
  c.cells = ''        # comma-separated cell names to run (`cell_names`); '' = every cell
  c.seeds = tuple(range(10))
  c.baseline = 'grpo:iid'
  c.horizons = (3, 5, 8)
  c.group_sizes = (4, 8)
  # Greedy starts measured on one 2-core Xeon: d3 600 steps 0.53 (the main job's); d5 1000
  # steps 0.02, 1250 0.51, 1400 0.66, 2000 0.86 (a sharp jump, as at d3). On a 2-core AMD EPYC:
  # d3 600 steps 0.53, d5 1250 0.47, d8 2600 0.35 (extrapolated from d3 -> d5, then run).
  c.sft_steps = ml_collections.ConfigDict(dict(d3=600, d5=1250, d8=2600))
  c.methods = METHODS
  c.agent_tasks = tuple(AGENT_TASKS)
  c.agent_group_sizes = (8,)
  c.agent_methods = AGENT_METHODS
  c.agent_sft_steps = ml_collections.ConfigDict(dict(household=150, household_long=450))
  # --report: where the page goes (relative to the repository root unless absolute), the
  # stored credit-accuracy files read for the accuracy-vs-learning analysis, the stored main
  # job summaries whose power is stated, and the statistics' settings.
  c.report = ml_collections.ConfigDict(dict(
      out='docs/results', name='credit_sensitivity',
      credit_quality='docs/results/credit_quality_sensitivity.json',
      agent_credit_quality='docs/results/agent_credit_quality_sensitivity.json',
      agent_quality_env='sokoban',
      main_job=('docs/results/main_job_seeds012.json', 'docs/results/main_job/11c6dc0a55e7.json',
                'docs/results/main_job_seeds0-15.json'),
      level=0.95, alpha=0.05, power=0.8, num_boot=10000, boot_seed=0, target_half_width=0.03))
  return c


def scratch_cell(digits: int, g: int) -> str:
  return f'scratch_add_d{digits}_g{g}'


def agent_cell(task: str, g: int) -> str:
  return f'{task}_g{g}'


def cell_names(c) -> list[str]:
  """Every cell of the grid, scratch_add first (by horizon, then G), then the agent cells."""
  return ([scratch_cell(d, g) for d in c.horizons for g in c.group_sizes] +
          [agent_cell(t, g) for t in c.agent_tasks for g in c.agent_group_sizes])


def parse_cell(name: str) -> dict:
  """'scratch_add_d5_g4' -> dict(task='scratch_add', digits=5, group_size=4);
  'household_long_g8' -> dict(task='household_long', digits=None, group_size=8)."""
  m = re.fullmatch(r'(scratch_add)_d(\d+)_g(\d+)|([a-z_]+?)_g(\d+)', name)
  if m is None:
    raise ValueError(f'cell name {name!r}: expected scratch_add_d<D>_g<G> or <agent task>_g<G>')
  if m.group(1):
    return dict(task='scratch_add', digits=int(m.group(2)), group_size=int(m.group(3)))
  return dict(task=m.group(4), digits=None, group_size=int(m.group(5)))


def selected_cells(c) -> list[str]:
  """The cells `c.cells` names ('' = all), in grid order; ValueError naming an unknown one."""
  grid = cell_names(c)
  want = [x.strip() for x in c.cells.split(',') if x.strip()] if c.cells else grid
  unknown = [x for x in want if x not in grid]
  if unknown:
    raise ValueError(f'unknown cell {unknown[0]!r} in config.cells; valid cells: '
                     f'{", ".join(grid)}')
  return [x for x in grid if x in want]


def check(c) -> None:
  """Refuses a grid that cannot run (issue 42), before any training: a horizon outside
  scratch_add's 1..8 or without `sft_steps['d<D>']`, an unknown agent task or one without
  `agent_sft_steps`, a group size < 2 (odd with a tree sampler), a repeated value, an
  unknown method or sampler, a method list without its baseline."""
  from experiments.training import methods as methods_lib  # not at import: it imports configs
  for field in ('methods', 'agent_methods'):
    parsed = [methods_lib.method_name(*m) for m in methods_lib.parse_methods(c[field])]
    base = methods_lib.method_name(*methods_lib.parse_methods(c.baseline)[0])
    if base not in parsed:
      raise ValueError(f'config.{field} {c[field]!r} lacks the baseline {base!r}: every Δ of '
                       'the study is taken against it')
  for field in ('horizons', 'group_sizes', 'agent_tasks', 'agent_group_sizes', 'seeds'):
    values = tuple(c[field])
    if len(set(values)) != len(values):
      raise ValueError(f'config.{field} {values} repeats a value')
  for d in c.horizons:
    if not (isinstance(d, int) and 1 <= d <= MAX_DIGITS):
      raise ValueError(f'horizon {d!r}: scratch_add takes num_digits in [1, {MAX_DIGITS}]')
    if f'd{d}' not in c.sft_steps:
      raise ValueError(f'horizon {d} has no SFT steps: set --config.sft_steps.d{d}=<steps> '
                       f'(have {", ".join(sorted(c.sft_steps.keys()))})')
  for t in c.agent_tasks:
    if t not in AGENT_TASKS:
      raise ValueError(f'unknown agent task {t!r}; valid: {", ".join(AGENT_TASKS)}')
    if t not in c.agent_sft_steps:
      raise ValueError(f'agent task {t!r} has no entry in config.agent_sft_steps')
  tree = 'tree_' in c.methods
  for g in tuple(c.group_sizes) + tuple(c.agent_group_sizes):
    if not (isinstance(g, int) and g >= 2) or (tree and g % 2):
      raise ValueError(f'group size {g!r}: need an int >= 2, even with a tree sampler '
                       f'(G = 2 x chains)')


def cell_config(c, name: str) -> ml_collections.ConfigDict:
  """The `compare.run_experiment` config of one cell."""
  cell = parse_cell(name)
  g = cell['group_size']
  if cell['task'] == 'scratch_add':
    cfg = tempo_config.get_config()  # the main job's budget: 40 steps x 64 prompts
    cfg.methods = c.methods
    cfg.task.kwargs = {'num_digits': cell['digits']}
    cfg.sft.steps = int(c.sft_steps[f'd{cell["digits"]}'])
    cfg.sampler.update(group_size=g, num_chains=g // 2, num_forks=1, num_continuations=1)
    cfg.critic = ppo_config.get_config('tree').critic  # read by 'values' estimators only
  else:
    spec = AGENT_TASKS[cell['task']]
    cfg = agents_config.paper(c.agent_methods)  # 30 steps x 16 start states
    cfg.task.name, cfg.task.kwargs = cell['task'], dict(spec['kwargs'])
    cfg.model.attn_chunk = spec.get('attn_chunk', 0)
    cfg.sft.steps = int(c.agent_sft_steps[cell['task']])
    cfg.sampler.update(group_size=g, num_chains=max(1, g // 2), num_continuations=1)
  cfg.seeds = tuple(c.seeds)
  cfg.baseline = c.baseline
  cfg.quick = c.quick
  cfg.progress = c.progress
  return cfg
