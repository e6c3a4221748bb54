"""The vocabulary of `needs`: what an estimator may ask a training loop for.

Kinds: 'rollouts', a `Rollouts` field the loop computes; 'turns', a `Turns` field a
multi-turn problem computes; 'loop', a behaviour of the loop itself (replay, an extra
phase or step). `register` refuses a need outside this table; in `experiments/`, each key
has exactly one provider (a pass, or the multi-turn problem for the 'turns' kind).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Need:
  kind: str  # 'rollouts' | 'turns' | 'loop'
  doc: str


KINDS = ('rollouts', 'turns', 'loop')

NEEDS = {
    # Rollouts fields the loop computes.
    'logprobs': Need('rollouts', 'log-probs of the sampled tokens under the behaviour policy'),
    'ref_logprobs': Need('rollouts', 'log-probs under the frozen reference policy'),
    'entropy': Need('rollouts', "the policy's next-token entropy at each response token"),
    'prompt_logprobs': Need('rollouts', "the policy's log-probs of the prompt tokens"),
    'context_logprobs': Need('rollouts', 'log-probs of the response with the prompt changed'),
    'hindsight_logprobs': Need('rollouts', 'log-probs with the gold answer in the prompt'),
    'saliency': Need('rollouts', "each token's gradient saliency (one backward pass)"),
    'values': Need('rollouts', "a learned critic's V(s_t) before each token"),
    'step_probes': Need('rollouts', 'the gold continuation scored after each reasoning step'),
    'token_rewards': Need('rollouts', "the task's per-step process rewards, per token"),
    'step_ends': Need('rollouts', 'the last token of each reasoning step'),
    'ref_rewards': Need('rollouts', 'the reward of a response the frozen reference policy '
                        'samples for each prompt'),
    'hidden_states': Need('rollouts', "the policy's final hidden state at each response "
                          'position'),
    'turns': Need('rollouts', 'the turn structure of multi-turn trajectories (`Turns`)'),
    # Turns fields a multi-turn problem computes.
    'values_star': Need('turns', "the exact solver's optimal value of each turn's state"),
    'solver_steps': Need('turns', "the exact solver's steps to go from each turn's state"),
    'milestones': Need('turns', "the environment's milestone (subgoal) reached at each turn"),
    'info_gains': Need('turns', 'the gain in log-prob of the answer from each turn'),
    'attempts': Need('turns', 'the attempt each turn belongs to (a meta-episode of retries)'),
    'feedback_logprobs': Need('turns', "log-probs of the environment's feedback"),
    'expert_matches': Need('turns', "whether each action is the expert's"),
    'answer_logprobs': Need('turns', 'log-prob of the gold answer after each turn'),
    'tool_probes': Need('turns', 'the answer probe without each tool call'),
    'evidence_probes': Need('turns', "the answer probe without each turn's observation"),
    # Behaviours of the loop.
    'replay': Need('loop', "a stored success of the prompt replaces a collapsed group's row"),
    'replay_failures': Need('loop', 'replay also stores failures (two-sided replay)'),
    'interventions': Need('loop', 'a fine-tuning phase on single-step interventions first'),
    'expert_sft': Need('loop', 'an SFT step toward the expert after each update'),
    'self_hindsight': Need('loop', "the hindsight pass with each response's own answer"),
}


def check(name: str, needs) -> None:
  """Raises ValueError naming estimator `name`'s needs that are not in the vocabulary."""
  unknown = [n for n in needs if n not in NEEDS]
  if unknown:
    raise ValueError(f'credit estimator {name!r} needs {", ".join(map(repr, unknown))}, '
                     f'which is not a known need; known: {", ".join(NEEDS)} '
                     f'(credit/vocabulary.py)')


def declare(key: str, kind: str, doc: str) -> None:
  """Adds need `key` for code outside this library: a 'rollouts' key arrives in
  `Rollouts.extras[key]`, computed by a pass that `provides` it."""
  if key in NEEDS:
    raise ValueError(f'need {key!r} is already declared ({NEEDS[key].kind}: {NEEDS[key].doc})')
  if kind not in KINDS:
    raise ValueError(f'unknown kind of need {kind!r}; valid: {", ".join(KINDS)}')
  NEEDS[key] = Need(kind, doc)
