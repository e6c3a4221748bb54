"""TEMPO vs GRPO at laptop scale: `python -m experiments.tempo --config=configs/tempo.py`.

Overrides: `--config.rl.steps=200 --config.methods=grpo:iid,tempo:tree_entropy`;
`--config.quick=True` shrinks everything to a smoke run (applied after overrides
by the script via `shrink`; what is set on the same command line is kept).

Default budget (2 CPU cores, ~17 min): 3-digit column addition with a written
scratchpad (`scratch_add`: responses of 25-32 tokens, one carry per column, reward
from the final answer only), a d=64/2-layer policy, SFT 600 steps x 64
demonstrations once (shared by every run; greedy accuracy jumps from ~0 to ~50 %
between steps 400 and 600), then GRPO and TEMPO (i.i.d. groups) x 16 seeds x 40 RL
steps of 64 prompts x G=8 rollouts (the same 20,480 rollouts per run), with paired
intervals over seeds (16: enough that TEMPO - GRPO is decided, issue 42; a run's numbers
do not depend on the other seeds, so `--config.seeds="(0,1,2)"` gives the first three in
~4 min). The entropy-forking tree sampler: `--config.methods=grpo:iid,tempo:iid,
grpo:tree_entropy,tempo:tree_entropy`. 'iid' draws G=8 i.i.d.
samples; 'tree_entropy' 4 chains + 1 fork each at its highest-entropy token.
"""

import ml_collections

# method spec "credit:sampler"; sampler in SAMPLERS ('tree_turns': multi-turn environments
# only, configs/agents.py; the others: single-turn tasks, 'iid' both; 'lagged': G i.i.d.
# responses from the policy of the last step that is a multiple of sampler.lag; 'hinted': G
# responses, the first hint_rows after a prefix of the reference, experiments/training/hints.py;
# 'tree_bisect': chains and rounds of forks at binary-searched step boundaries; 'tree_steps':
# every response forked at its l-th step boundary, level by level; experiments/rollouts/
# step_forks.py; 'knapsack': B·G i.i.d. responses shared out by the prompts' pass rates,
# groups of varying size, experiments/rollouts/knapsack.py; 'tree_branching': tree_entropy's
# layout, forks at APPO's Branching Score, experiments/rollouts/branching.py; 'experience':
# multi-turn only, G i.i.d. trajectories reading SLEA-RL's step-level experience library,
# envs/experience.py and experiments/training/experience.py).
SAMPLERS = ('iid', 'tree_fixed', 'tree_entropy', 'tree_cutpoints', 'tree_turns', 'lagged',
            'hinted', 'tree_bisect', 'tree_steps', 'knapsack', 'tree_branching', 'experience')


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.quick = False
  # The main job's seeds: with 16, TEMPO - GRPO's paired interval is narrower than ±0.015
  # (issue 42; docs/results/credit_sensitivity.md). paper() and configs/agents.py keep 3.
  c.seeds = tuple(range(16))
  # Comma-separated "credit:sampler" runs compared by experiments/tempo.py.
  c.methods = 'grpo:iid,tempo:iid'
  c.progress = True  # tqdm bars
  # Paired statistics (experiments/training/compare.py): each method vs GRPO on its own sampler
  # ('<credit of baseline>:<sampler>') when that is run, else vs this method.
  c.baseline = 'grpo:iid'
  # Learning-rate sweep: () = off (optimizer.lr); else every method at every lr here,
  # reported best-of-grid (mean final accuracy over seeds) and as the full grid.
  c.lr_grid = ()

  c.task = ml_collections.ConfigDict(dict(name='scratch_add', kwargs={'num_digits': 3}))
  c.model = ml_collections.ConfigDict(dict(d_model=64, num_layers=2, num_heads=4, d_ff=336))

  c.sampler = ml_collections.ConfigDict(dict(
      name='iid',            # one of SAMPLERS
      group_size=8,          # G for 'iid' and 'lagged'; 'knapsack': the mean, B·G rollouts a step
      min_group=2, max_group=16,  # knapsack (#59): each prompt's rollouts in [min, max]
      lag=4,                 # lagged (off-policy GRPO, #63): refresh the sampling policy every lag steps
      hint_rows=8, hint_schedule='staged',  # hinted (#62 'staged', #94 'difficulty')
      temperature=1.0, top_p=1.0, top_k=0,
      branching=(2, 2, 2), segment_len=1,                   # tree_fixed: G = prod(branching)
      num_chains=4, num_forks=1, num_continuations=1,       # tree_entropy: G = N (1 + F C)
      score='entropy',
      branch_window=8, branch_candidates=0,  # tree_branching (APPO #35): 0 = 4 per fork
      num_rounds=2,                  # tree_bisect: G = N (1 + rounds C)
      num_levels=2,                  # tree_steps: G = N (1 + C)^levels
      cut_threshold=0.9, cut_every=1,  # tree_cutpoints (SPO-chain): same G as tree_entropy
      # experience (SLEA-RL #46): a strategy enters at success rate >= admit over >= min_count
      # turns, at most max_new entries of each kind a step, its score an EMA with weight ema;
      # failure_patterns False: strategies only
      admit=0.5, min_count=2, max_new=32, ema=0.5, failure_patterns=True))

  c.credit = ml_collections.ConfigDict(dict(name='grpo', hparams={}))

  c.loss = ml_collections.ConfigDict(dict(
      eps_low=0.2, eps_high=0.28, dual_clip=3.0, agg='token-mean',
      kl_coef=0.0, kl_estimator='k3', kl_in_reward=False, entropy_coef=0.0,
      num_epochs=1, num_minibatches=2, num_microbatches=1,
      policy_loss='clip',  # 'clip' (PPO), 'rgra' (#61), 'apa' (#66), 'em' (#156)
      apa_coef=1.0,        # APA's lambda (> 0)
      apa_anchor='ref',    # APA's anchor policy: 'ref' or 'old' (the sampling policy)
      em_alpha=0.5))       # EM: weight of preferred samples, 1 - it of dis-preferred
  c.optimizer = ml_collections.ConfigDict(dict(
      lr=3e-4, warmup_steps=5, weight_decay=0.0, grad_clip=1.0, b1=0.9, b2=0.999))

  c.sft = ml_collections.ConfigDict(dict(
      steps=600, batch_size=64, lr=1e-3, warmup_steps=100, weight_decay=0.0, seed=0,
      # > 0: that fraction of the demonstrations' prompts also carry the gold answer (a
      # warm start that can serve as PBSD's / HCAPO's answer-conditioned teacher).
      hindsight_frac=0.0))

  c.rl = ml_collections.ConfigDict(dict(
      steps=40, prompts_per_step=64, ckpt_every=20, seed=0,
      # > 0: a fixed pool of this many training prompts per run (each step draws from it,
      # so prompts recur: replay, R3 #73); 0: fresh prompts every step.
      prompt_pool=0,
      # False: old log-probs = the sampler's (saves a forward pass, ~20% of a step).
      recompute_logprobs=False))

  # Update-step layout: 'tree' packs each group's prefix tree (shared tokens computed
  # once, exact), 'prompt' shares only the prompt, 'none' runs flat rows.
  # pack_len 0 = automatic buckets; pack_attention 'auto' (per batch and backend, the
  # cheaper of 'blocks' and 'paths'), 'blocks' (block-sparse over ancestor blocks: cost
  # follows the tree), 'paths' (causal along each response's path: G * S^2 per group)
  # or 'mask' (dense [T, T]); all exact.
  c.train = ml_collections.ConfigDict(dict(packing='tree', pack_len=0, pack_attention='auto'))

  c.eval = ml_collections.ConfigDict(dict(every=10, num_prompts=512, pass_k=8,
                                         pass_prompts=128, seed=12345))
  # Devices = data x fsdp x model; model > 1: tensor parallelism (heads, MLP, vocabulary).
  c.mesh = ml_collections.ConfigDict(dict(fsdp=1, model=1))
  # Metrics sinks (experiments/training/tracking.py): metrics.jsonl always, plus any of
  # 'tensorboard', 'wandb' (pip install -e ".[tracking]"); W&B offline unless 'online'.
  c.log = ml_collections.ConfigDict(dict(sinks='jsonl', wandb_project='treecredit',
                                         wandb_mode='offline'))
  return c


def paper(methods: str, **sampler) -> ml_collections.ConfigDict:
  """A per-paper comparison (configs/<paper>.py): this config with `methods` and the
  `sampler` fields given, and 100 RL steps instead of 40.

  Every method gets the same rollout budget: 100 steps x 64 prompts x G=8 = 51,200
  rollouts per run, 3 seeds. Tree-sampler papers also run GRPO on the same sampler,
  so the credit estimator is compared on the same trees as well as against i.i.d. GRPO.
  """
  c = get_config()
  c.methods = methods
  c.seeds = (0, 1, 2)
  c.sampler.update(sampler)
  c.rl.steps = 100
  return c


def family(methods: str) -> ml_collections.ConfigDict:
  """A seed-family comparison (configs/<family>.py, issue 22): the main job's budget
  (40 RL steps x 64 prompts x G=8 i.i.d. rollouts from the shared SFT warm start) for GRPO
  and each of the family's `methods` ('credit:sampler[:policy_loss]'), 5 seeds, each
  method read at matched generated tokens with paired 95 % intervals against GRPO.
  """
  c = get_config()
  c.methods = 'grpo:iid,' + methods
  c.seeds = (0, 1, 2, 3, 4)
  return c

def shrink(c: ml_collections.ConfigDict, defaults=None, explicit=()) -> ml_collections.ConfigDict:
  """The --config.quick=True smoke run (well under a minute on 2 CPU cores).

  Keeps what the user set (`apply_quick`): fields that differ from `defaults` (the config c
  was built from; None: `get_config()`) or are named in `explicit`.
  """
  quick = {'model.d_model': 32, 'model.num_layers': 1, 'model.num_heads': 2, 'model.d_ff': 64,
           'sampler.group_size': 4, 'sampler.branching': (2, 2), 'sampler.num_chains': 2,
           'sampler.num_forks': 1, 'sampler.num_continuations': 1,
           'sft.steps': 20, 'sft.batch_size': 64, 'sft.warmup_steps': 5,
           'rl.steps': 4, 'rl.prompts_per_step': 8, 'rl.ckpt_every': 2,
           # pass@k batch = one RL batch (8 prompts x 4): it reuses the sampler's program.
           'eval.every': 2, 'eval.num_prompts': 64, 'eval.pass_k': 4, 'eval.pass_prompts': 8,
           'seeds': (0,)}
  if c.methods == get_config().methods:  # a paper's own methods are kept
    quick['methods'] = 'grpo:iid,tempo:tree_entropy'
  return apply_quick(c, quick, get_config() if defaults is None else defaults, explicit)


_MISSING = object()


def _get(c, path: str):
  for key in path.split('.'):
    if not hasattr(c, 'keys') or key not in c:
      return _MISSING
    c = c[key]
  return c.to_dict() if hasattr(c, 'to_dict') else c


def apply_quick(c: ml_collections.ConfigDict, quick: dict, defaults,
                explicit=()) -> ml_collections.ConfigDict:
  """Sets every dotted path of `quick` in c, except the fields the user set: those whose
  value in c differs from `defaults` (the config c was built from, e.g. its file's
  get_config()) and those named in `explicit` (the --config.<path> overrides given; a
  parent or child path counts). Prints what it kept (where it differs from quick's value).
  """
  explicit = tuple(explicit)
  kept = []
  for path, value in quick.items():
    mine = _get(c, path)
    named = any(e == path or path.startswith(e + '.') or e.startswith(path + '.')
                for e in explicit)
    if named or mine != _get(defaults, path):
      if mine != (value.to_dict() if hasattr(value, 'to_dict') else value):
        kept.append(f'{path}={mine!r} (quick: {value!r})')
      continue
    *parents, key = path.split('.')
    node = c
    for p in parents:
      node = node[p]
    node[key] = value
  if kept:
    print(f'--config.quick=True kept what you set: {", ".join(kept)}', flush=True)
  return c
