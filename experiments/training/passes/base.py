"""The pass protocol: one optional part of the RL step, with when it applies, its checks,
its loop state and its per-step hooks (each a no-op by default). docs/trainer.md."""

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass
class Step:
  """One RL step's values, filled in stage by stage by `rl_step` and the passes' hooks.
  Shapes: prompts [B, P], samples [B, G, L], rewards [B, G]."""
  i: int
  draw: Any
  prompts: Any = None
  plen: Any = None
  sampling_params: Any = None        # the policy's params, or the lagged behaviour policy's
  sample_kw: dict = dataclasses.field(default_factory=dict)   # extra sampler keywords
  problem_kw: dict = dataclasses.field(default_factory=dict)  # the problem's own sampler's
  samples: Any = None
  rewards: Any = None                # trained on (replayed rows included)
  fresh_rewards: Any = None          # this step's samples'
  reward_metrics: dict = dataclasses.field(default_factory=dict)
  row_mask: Any = None               # groups of varying size (knapsack)
  policy_mask: Any = None            # multi-turn: the policy's own tokens
  replayed: Any = None               # bool [B, G]: rows sampled at an earlier step
  packed: Any = None
  with_entropy: bool = False         # the old log-prob pass also returns entropies
  tf_entropy: Any = None             # those entropies
  old_lp: Any = None
  ref_lp: Any = None
  train_rewards: Any = None          # rewards, less the KL penalty when it is in the reward
  extra: dict = dataclasses.field(default_factory=dict)      # the estimator's keywords
  process: tuple = (None, None)      # (token_rewards, step_ends)
  turns: Any = None
  credit_out: tuple = ()             # (advantages, loss mask[, next credit state])
  times: dict = dataclasses.field(default_factory=dict)      # extra timing fields


@dataclasses.dataclass
class Carry:
  """What one step hands the next: the train state, the passes' loop state by checkpoint
  key, the step count. `dirty` from the donating update to the commit (an interrupt there
  keeps the last checkpoint); `pending`: the row of an update not yet logged."""
  state: Any
  aux: dict
  step: int
  dirty: bool = False
  pending: Optional[dict] = None
  pack_len: int = 0      # the last packed length (a new shape only when trees grow)
  t_start: float = 0.0   # time.time() at step 0 (less a restored run's wall time)
  totals: dict = dataclasses.field(default_factory=dict)  # generated tokens, env steps


class Pass:
  """An optional part of the loop. `provides`: the `credit.NEEDS` keys it computes;
  `sampler`: the sampler it serves; it applies when the estimator needs one of those keys or
  the run uses that sampler. `state_key`: its loop state's checkpoint key (None: none)."""
  provides: tuple = ()
  sampler: Optional[str] = None
  state_key: Optional[str] = None
  # The field of `start`'s metrics that counts tokens it sampled (added to the run's total).
  start_tokens: Optional[str] = None

  @classmethod
  def applies(cls, cfg, needs) -> bool:
    return cfg.sampler.name == cls.sampler or bool(set(cls.provides) & set(needs))

  @classmethod
  def check(cls, cfg, needs, kind: str, caps) -> None:
    """Raises ValueError before any warm start, model load or compile."""

  def __init__(self, cfg, hparams: dict):
    self.cfg, self.hparams = cfg, hparams

  def prepare(self, run) -> None:
    """Once, after the problem is built (e.g. fix its prompt pool)."""

  def init_state(self, run, state):
    """The loop state of a fresh run (`state`: the policy's TrainState)."""

  def restored(self, run, value):
    """The loop state after a restore (e.g. placed on the mesh)."""
    return value

  def start(self, run, state):
    """A fresh run's (state, metric fields of the starting row) before step 0."""
    return state, {}

  def before_sample(self, run, carry, s) -> None:
    """Sets s.sampling_params / s.sample_kw / s.problem_kw; may refresh carry.aux."""

  def after_rewards(self, run, carry, s) -> None:
    """May change s.samples / s.rewards (replay)."""

  def before_logprobs(self, run, carry, s) -> None:
    """May ask the old log-prob pass for entropies (s.with_entropy)."""

  def inputs(self, run, carry, s) -> None:
    """After the old log-probs: the estimator's inputs it provides (s.extra, s.ref_lp)."""

  def credit_inputs(self, run, carry, s) -> None:
    """The estimator's inputs timed as credit (process rewards, probes, turns)."""

  def update(self, run, carry, s):
    """(its next loop state, metrics), computed before the policy update."""
    return carry.aux.get(self.state_key), {}

  def gates_update(self, run, i: int) -> Optional[dict]:
    """Metrics in place of the policy update at step i, or None to update."""

  def after_update(self, run, carry, s, state, nxt: dict):
    """(state, metrics) after the policy update; may set its entry of `nxt`."""
    return state, {}

  def counts(self, run, s):
    """(tokens to take off this step's generated count, the batch's: those not generated at
    this step, or minus tokens generated beyond the batch; or None, row fields)."""
    return None, {}

  def row_fields(self, run, carry, s) -> dict:
    return {}

  def eval_kwargs(self, carry) -> dict:
    return {}

  def result(self, carry) -> dict:
    return {}
