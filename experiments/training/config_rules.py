"""Value rules for the run configs (configs/tempo.py, lm.py, agents.py), checked by
`loop.check_config` before anything is built: one table, one error per bad field.

A numeric rule is an interval in the usual notation, '(0, inf)' or '[0, 1)'; tuple
fields (sampler.branching, lr_grid) apply it to every entry. A choice rule is the
tuple of valid values. Fields a config does not have (lm.* outside configs/lm.py)
are skipped.
"""

import math
import numbers

from envs.text import TRUNCATION_MODES

DTYPES = ('float32', 'bfloat16')  # experiments.models.pretrained.DTYPES

RULES = (
    ('optimizer.lr', '(0, inf)'),
    ('optimizer.warmup_steps', '[0, inf)'),
    ('optimizer.weight_decay', '[0, inf)'),
    ('optimizer.grad_clip', '[0, inf)'),  # 0: no clipping
    ('optimizer.b1', '[0, 1)'),
    ('optimizer.b2', '[0, 1)'),
    ('lr_grid', '(0, inf)'),
    ('sft.steps', '[0, inf)'),  # 0: no warm start
    ('sft.batch_size', '[1, inf)'),
    ('sft.lr', '(0, inf)'),
    ('sft.warmup_steps', '[0, inf)'),
    ('sft.weight_decay', '[0, inf)'),
    ('sft.hindsight_frac', '[0, 1]'),
    ('rl.steps', '[0, inf)'),
    ('rl.prompts_per_step', '[1, inf)'),
    ('rl.ckpt_every', '[1, inf)'),
    ('sampler.group_size', '[1, inf)'),
    ('sampler.min_group', '[1, inf)'),
    ('sampler.max_group', '[1, inf)'),
    ('sampler.temperature', '(0, inf)'),  # 0 is greedy: every rollout of a group the same
    ('sampler.top_p', '(0, 1]'),
    ('sampler.top_k', '[0, inf)'),  # 0: off
    ('sampler.branching', '[1, inf)'),
    ('sampler.segment_len', '[1, inf)'),
    ('sampler.num_chains', '[1, inf)'),
    ('sampler.num_rounds', '[1, inf)'),
    ('sampler.num_levels', '[1, inf)'),
    ('sampler.num_forks', '[1, inf)'),
    ('sampler.num_continuations', '[1, inf)'),
    ('sampler.cut_threshold', '(0, 1]'),
    ('sampler.cut_every', '[1, inf)'),
    ('sampler.branch_window', '[1, inf)'),
    ('sampler.branch_candidates', '[0, inf)'),  # 0: 4 per fork
    ('sampler.fork_turn', '[0, inf)'),
    ('sampler.lag', '[1, inf)'),
    ('sampler.hint_rows', '[0, inf)'),
    ('sampler.admit', '[0, 1]'),
    ('sampler.min_count', '[1, inf)'),
    ('sampler.max_new', '[1, inf)'),
    ('sampler.ema', '(0, 1]'),
    ('sampler.failure_patterns', (True, False)),
    ('agent.experience_slots', '[0, inf)'),  # 0: no experience wrapper
    ('rl.prompt_pool', '[0, inf)'),  # 0: fresh prompts every step
    ('loss.eps_low', '[0, inf)'),
    ('loss.eps_high', '[0, inf)'),
    ('loss.kl_coef', '[0, inf)'),
    ('train.pack_len', '[0, inf)'),  # 0: automatic buckets
    ('eval.every', '[1, inf)'),
    ('eval.num_prompts', '[1, inf)'),
    ('eval.pass_k', '[1, inf)'),
    ('eval.pass_prompts', '[1, inf)'),
    ('mesh.fsdp', '[1, inf)'),
    ('mesh.model', '[1, inf)'),
    ('lm.max_prompt_len', '[1, inf)'),
    ('lm.max_new_tokens', '[1, inf)'),
    ('lm.lora_rank', '[0, inf)'),  # 0: full fine-tuning
    ('lm.lora_alpha', '(0, inf)'),
    ('lm.train_size', '[1, inf)'),
    ('lm.truncation', TRUNCATION_MODES),
    ('lm.dtype', DTYPES),
    ('agent.num_turns', '[0, inf)'),  # 0: the environment's max_turns
    ('agent.gamma', '[0, 1]'),
    ('agent.lm_dtype', DTYPES),
    ('agent.experience_cluster', ('observation', 'state')),
)


def _interval(spec: str):
  """'(0, 1]' -> predicate(x) (False for NaN)."""
  low, high = (float(s) for s in spec[1:-1].split(','))
  above = (lambda x: x >= low) if spec[0] == '[' else (lambda x: x > low)
  below = (lambda x: x <= high) if spec[-1] == ']' else (lambda x: x < high)
  return lambda x: above(x) and below(x)


def _lookup(cfg, path: str):
  """(True, value) of a dotted field, (False, None) if the config has no such field."""
  node = cfg
  for key in path.split('.'):
    if not hasattr(node, 'keys') or key not in node.keys():
      return False, None
    node = node[key]
  return True, node


def check_values(cfg):
  """Raises ValueError naming the first field of cfg that breaks its rule in `RULES`."""
  for path, rule in RULES:
    present, value = _lookup(cfg, path)
    if not present:
      continue
    if isinstance(rule, tuple):
      if value not in rule:
        raise ValueError(f'{path} must be one of {", ".join(map(repr, rule))}; got {value!r}')
      continue
    ok = _interval(rule)
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if not isinstance(v, numbers.Real) or isinstance(v, bool) or math.isnan(v) or not ok(v):
        raise ValueError(f'{path} must be a number in {rule}; got {value!r}')
