"""The multi-turn side of the loop: environment episodes in, turn-structured rollouts out.

An `AgentProblem` gives the RL loop (`experiments/training/loop.py`) what a JAX task gives it,
for a multi-turn environment (`envs.get_env`) played by the decoder policy through
`experiments.rollouts.agent_sampling`:
  draw(key, step, n)        -> Draw: n fresh episodes (`env.reset`); the prompt of a
                               group is its start state's observation [n, O];
  sample(params, scfg, key, draw) -> AgentSamples [n, G, ...]: 'iid' (G trajectories per
                               start state), 'tree_turns' (chains forked at a turn
                               boundary by copying env state and KV cache) or 'experience'
                               ('iid' reading SLEA-RL's library, `library=`);
  learn(library, samples, scfg) -> the experience library after a batch, and its metrics
                               (cfg.agent.experience_slots > 0: `envs.experience`);
  rewards(draw, samples)    -> (episode returns [n, G], metrics);
  turns(params, draw, samples, needs) -> `credit.Turns`, with solver values (CAST) or answer
                               probes (IGPO) when the estimator needs them;
  evaluate(params, ecfg[, library]) -> greedy success rate ('greedy_acc'), mean return,
                               pass@k of k sampled episodes, on fixed held-out episodes;
  demonstrations(key, n)    -> the environment's expert episodes, for the SFT warm start.

Layout: a trajectory is the sampler's one token sequence; the initial observation is
the prompt (the same for the G trajectories of a group) and everything after it the
"response" [L = K (A + O)]: `mask` is the trajectory's span (actions and observations
of the taken turns, one run from 0), `policy_mask` its action tokens. So the update
step, tree packing and every token-level estimator (GRPO, TEMPO over whole
trajectories, Tree-GRPO over turns) run unchanged, and only action tokens are trained
(`credit.loss_mask`). The loop counts generated tokens (action tokens not copied from
a parent) and environment steps (taken turns not copied) per step. The episode sampler keeps
no entropies: an estimator that needs `Rollouts.entropy` gets them from a teacher-forced pass
over the trajectories (shared with the old log-probs when rl.recompute_logprobs), on action
tokens only, like `logprobs`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import credit
import envs
from envs import experience as exp_env
from experiments.rollouts import agent_sampling as ags
from experiments.models import decoder, pretrained
from experiments.rollouts.text_rollouts import Draw, loading_mesh
from experiments.training import experience as exp_lib

SAMPLERS = ('iid', 'tree_turns', 'experience')
# Environment words a pretrained tokenizer splits into several tokens, spelled as words it
# keeps whole (SmolLM2's BPE: " mug" is two tokens, " cup" one); cfg.agent.lm_aliases adds more.
LM_ALIASES = {
    'household': {'mug': 'cup'},
    'webshop': {'mug': 'cup', '10': 'ten', '20': 'twenty', '30': 'thirty', '40': 'forty',
                **{f'p{i}': 'ABCDEFGHIJKLMNOP'[i] for i in range(16)}},
}


def lm_vocab_map(env, tokenizer, aliases=None) -> ags.VocabMap:
  """`agent_sampling.VocabMap` of env onto a pretrained tokenizer: each environment word
  (or its alias) written as the tokenizer would see it in the environment's text
  (after a space when env.separator is ' ') must be one token; EOA is a newline, PAD the
  tokenizer's pad token. Raises ValueError naming the words that are not one token, or
  two words that share one."""
  aliases = {**LM_ALIASES.get(env.name, {}), **(aliases or {})}
  space = ' ' if env.separator == ' ' else ''
  to_lm, bad = [], []
  for i, word in enumerate(env.vocab):
    if i == env.pad_id:
      ids = [tokenizer.pad_id]
    elif i == env.eoa_id:
      ids = tokenizer.encode('\n')
    else:
      ids = tokenizer.encode(space + aliases.get(word, word))
    if len(ids) != 1:
      bad.append(f'{word!r} -> {ids}')
    to_lm.append(ids[0])
  if bad:
    raise ValueError(f'environment {env.name!r}: these words are not one token of the '
                     f'model\'s tokenizer: {", ".join(bad)}; give one-token spellings in '
                     f'agent.lm_aliases (e.g. {{"mug": "cup"}})')
  if len(set(to_lm)) != len(to_lm):
    raise ValueError(f'environment {env.name!r}: two words map to one token ({to_lm}); '
                     f'change agent.lm_aliases')
  to_env = np.full((tokenizer.vocab_size,), env.pad_id, np.int32)
  to_env[to_lm] = np.arange(len(to_lm))
  return ags.VocabMap(to_lm=jnp.asarray(to_lm, jnp.int32), to_env=jnp.asarray(to_env),
                      eoa=int(to_lm[env.eoa_id]), pad=int(to_lm[env.pad_id]))


@struct.dataclass
class AgentSamples:
  """Sampled trajectories without their initial observation (the prompt): [B, G, L].

  Attributes:
    tokens: int32 [B, G, L], actions and observations of every turn slot.
    mask: bool [B, G, L], the span of the taken turns (one run from 0).
    policy_mask: bool [B, G, L], the generated action tokens (inside mask).
    logprobs: float32 [B, G, L], sampling log-probs on policy tokens, 0 elsewhere.
    parent: int32 [B, G], the trajectory each one forked from, -1 for chains.
    fork: int32 [B, G], leading tokens copied from the parent (`trees.from_forks`).
    fork_turn: int32 [B, G], turns copied from the parent.
    turns: `credit.Turns` of the trajectories (token_turn in these coordinates).
    episodes: the sampler's `agent_sampling.Episodes` (whole trajectories).
  """

  tokens: jax.Array
  mask: jax.Array
  policy_mask: jax.Array
  logprobs: jax.Array
  parent: jax.Array
  fork: jax.Array
  fork_turn: jax.Array
  turns: credit.Turns
  episodes: ags.Episodes

  @property
  def lengths(self) -> jax.Array:
    """int32 [B, G]: span lengths."""
    return jnp.sum(self.mask, -1, dtype=jnp.int32)

  @property
  def generated_tokens(self) -> jax.Array:
    """Action tokens sampled for this batch (forks' copied turns excluded)."""
    own = self.turns.token_turn >= self.fork_turn[..., None]
    return jnp.sum(self.policy_mask & own)

  @property
  def env_steps(self) -> jax.Array:
    """Environment steps taken for this batch (forks' copied turns excluded)."""
    k = self.turns.turn_mask.shape[-1]
    return jnp.sum(self.turns.turn_mask & (jnp.arange(k) >= self.fork_turn[..., None]))


def split_prompt(episodes: ags.Episodes, env) -> tuple[jax.Array, AgentSamples]:
  """(prompts [B, O], AgentSamples [B, G, L]) of whole-trajectory episodes [B, G, T]."""
  o, slot = env.obs_len, env.action_len + env.obs_len
  cut = lambda x: x[..., o:]
  e = episodes
  mask = cut(e.span_mask)
  fork = jnp.minimum(e.fork_turn * slot, jnp.sum(mask, -1))  # a chain may end before it
  turns = credit.Turns(state_ids=e.state_ids, rewards=e.turn_rewards, turn_mask=e.turn_mask,
                       token_turn=cut(e.token_turn), success=e.success)
  samples = AgentSamples(tokens=cut(e.tokens), mask=mask, policy_mask=cut(e.policy_mask),
                         logprobs=cut(e.logprobs), parent=e.parent,
                         fork=jnp.where(e.parent >= 0, fork, 0).astype(jnp.int32),
                         fork_turn=e.fork_turn, turns=turns, episodes=e)
  return e.tokens[:, 0, :o], samples


@functools.partial(jax.jit, static_argnames=('env', 'n'))
def _reset(key, *, env, n):
  return env.reset(key, n)


@functools.partial(jax.jit, static_argnames=('env',))
def _attach(start, library, *, env):
  return env.with_library(start, library)


@functools.partial(jax.jit, static_argnames=('env', 'n', 'num_turns'))
def _demos(key, *, env, n, num_turns):
  episodes = ags.expert_episodes(env, key, n, num_turns=num_turns)
  prompts, samples = split_prompt(episodes, env)
  return prompts, samples.tokens[:, 0], samples.policy_mask[:, 0]


@functools.partial(jax.jit, static_argnames=('env',))
def _answers(state, *, env):
  return env.answer(state)


@functools.partial(jax.jit, static_argnames=('env', 'num_turns'))
def _expert_traces(start, *, env, num_turns):
  """The expert's episodes [B, 1, ...] from the groups' start (state, obs, obs_mask): the
  reference trace of MatchTIR."""
  return ags.expert_episodes(env, jax.random.key(0), start[1].shape[0], num_turns=num_turns,
                             start=start)


class AgentProblem:
  """A multi-turn environment for the loop (see the module docstring).

  cfg.task.name / cfg.task.kwargs name the environment (`envs.get_env`);
  cfg.agent.num_turns (0 = the environment's max_turns) is K, the static turn count
  of the sampler; cfg.agent.gamma is the discount used for solver values (CAST).
  The policy is the toy decoder (cfg.model) on the environment's vocabulary, or with
  cfg.agent.lm_source (e.g. 'smollm2', a .gguf file or a Hugging Face directory) a
  pretrained LM that reads and writes the environment's words as its own tokens
  (`lm_vocab_map`; the expert warm start and RL then fine-tune it).
  """
  # It samples its own episodes, computes the Turns fields (`turns`, the provider of the
  # 'turns' kind of `credit.NEEDS`) and keeps SLEA-RL's experience library.
  capabilities = frozenset({'own_sampler', 'turns', 'experience'})
  TURN_FIELDS = ('values_star', 'solver_steps', 'milestones', 'info_gains', 'attempts',
                 'feedback_logprobs', 'expert_matches', 'answer_logprobs', 'tool_probes',
                 'evidence_probes')

  def __init__(self, cfg):
    self.env = env = envs.get_env(cfg.task.name, **dict(cfg.task.kwargs))
    slots = int(cfg.agent.get('experience_slots', 0))
    if slots:  # SLEA-RL: observations followed by the experience library's hints
      if cfg.agent.lm_source:
        raise ValueError('agent.experience_slots > 0 (the experience wrapper) is built for '
                         'the toy decoder on the environment\'s vocabulary; set '
                         'agent.lm_source=""')
      self.env = env = exp_env.ExperienceEnv(
          inner=env, slots=slots, cluster=cfg.agent.get('experience_cluster', 'observation'))
    self.num_turns = ags.num_turns_of(env, cfg.agent.num_turns or None)
    self.gamma = float(cfg.agent.gamma)
    max_len = ags.sequence_length(env, self.num_turns)
    if cfg.agent.lm_source:
      model = pretrained.load(cfg.agent.lm_source, max_len=max_len, dtype=cfg.agent.lm_dtype,
                              mesh=loading_mesh(cfg))
      self.pcfg, self.init_params, self.tokenizer = model.cfg, model.params, model.tokenizer
      self.vocab = lm_vocab_map(env, model.tokenizer, dict(cfg.agent.lm_aliases))
      self.eos_id, self.pad_id = self.vocab.eoa, self.vocab.pad
    else:
      self.pcfg = decoder.PolicyConfig(vocab_size=env.vocab_size, max_len=max_len,
                                       **dict(cfg.model))
      self.init_params = self.vocab = self.tokenizer = None  # SFT starts from a fresh decoder
      self.eos_id, self.pad_id = env.eoa_id, env.pad_id
    self.response_len = self.num_turns * (env.action_len + env.obs_len)

  def lm_ids(self, x):
    """Environment tokens as the policy's tokens."""
    return ags.policy_tokens(self.vocab, x)

  def draw(self, key, step: int, n: int) -> Draw:
    state, obs, obs_mask = _reset(key, env=self.env, n=n)
    prompts = self.lm_ids(jnp.where(obs_mask, obs, self.env.pad_id).astype(jnp.int32))
    return Draw(prompts, None, jnp.arange(n, dtype=jnp.int32) + step * n,
                (state, obs, obs_mask))

  def sample(self, params, scfg, key, draw: Draw, temperature=None,
             library=None) -> AgentSamples:
    """G trajectories from each of the draw's start states (sampler scfg.name; 'experience'
    with the experience library `library` attached to them)."""
    temperature = scfg.temperature if temperature is None else temperature
    n = draw.prompts.shape[0]
    kw = dict(num_turns=self.num_turns, start=draw.handle, vocab=self.vocab)
    if scfg.name == 'experience':
      kw['start'] = _attach(draw.handle, self._library(library), env=self.env)
    if scfg.name in ('iid', 'experience'):
      episodes = ags.sample_episodes(params, self.pcfg, self.env, key, n, scfg.group_size,
                                     temperature, **kw)
    elif scfg.name == 'tree_turns':
      episodes = ags.fork_episodes(params, self.pcfg, self.env, key, n, scfg.num_chains,
                                   1 + scfg.num_continuations, scfg.fork_turn, temperature, **kw)
    else:
      raise ValueError(f'sampler {scfg.name!r} does not play multi-turn environments; '
                       f'valid: {", ".join(SAMPLERS)}')
    return split_prompt(episodes, self.env)[1]

  def _library(self, library):
    if not isinstance(self.env, exp_env.ExperienceEnv):
      raise ValueError("sampler 'experience' (SLEA-RL) reads an experience library, which "
                       "needs the environment in its wrapper: set agent.experience_slots "
                       "(e.g. 2048)")
    return self.env.empty() if library is None else library

  def empty_library(self):
    """The experience library before any step (sampler 'experience')."""
    return self._library(None)

  def learn(self, library, samples: AgentSamples, scfg):
    """(library after the batch, metrics): SLEA-RL's admission, eviction and rate limit
    (`experiments/training/experience.py`) over the batch's turns; `experience_hints_per_turn`
    counts the hints the batch's observations showed (their markers), per taken turn."""
    e = samples.episodes
    marks = (e.tokens == self.env.token_id(exp_env.TIP)) | (
        e.tokens == self.env.token_id(exp_env.AVOID))
    shown = jnp.sum(marks & e.obs_mask) / jnp.maximum(jnp.sum(e.turn_mask), 1)
    _, actions, _ = ags.split_slots(e.tokens, self.env, self.num_turns)
    _, policy, _ = ags.split_slots(e.policy_mask, self.env, self.num_turns)
    library, m = exp_lib.update(
        self._library(library), e.state_ids, actions, policy, e.turn_mask, e.success,
        eoa_id=self.env.eoa_id, pad_id=self.env.pad_id, admit=float(scfg.admit),
        min_count=int(scfg.min_count), max_new=int(scfg.max_new), ema=float(scfg.ema),
        failure_patterns=bool(scfg.failure_patterns))
    return library, {k: float(v) for k, v in {**m, 'experience_hints_per_turn': shown}.items()}

  def rewards(self, draw: Draw, samples: AgentSamples) -> tuple[jax.Array, dict]:
    e = samples.episodes
    return e.returns, dict(success=float(jnp.mean(e.success)),
                           turns=float(jnp.mean(e.lengths)))

  def turns(self, params, draw: Draw, samples: AgentSamples, needs=()) -> credit.Turns:
    """The samples' `credit.Turns`, with values_star / solver_steps / milestones /
    info_gains / feedback_logprobs / attempts / expert_matches / answer_logprobs /
    tool_probes / evidence_probes if in `needs` (the gold answer, `env.answer`, is fixed by
    the group's start state). Masked observations are `self.pad_id` (the policy's padding)."""
    turns, e = samples.turns, samples.episodes
    if 'values_star' in needs:
      turns = turns.replace(values_star=ags.solver_values(e, self.env, self.gamma))
    if 'solver_steps' in needs:
      turns = turns.replace(solver_steps=ags.solver_steps(e, self.env))
    if 'milestones' in needs:
      turns = turns.replace(milestones=ags.milestone_turns(e, self.env))
    if 'info_gains' in needs:  # InfoPO: K + 1 teacher-forced passes, feedback masked
      gains = ags.info_gains(params, self.pcfg, self.env, e.tokens, e.policy_mask, self.pad_id,
                             num_turns=self.num_turns)
      turns = turns.replace(info_gains=jnp.where(e.turn_mask, gains, 0.0))
    if 'attempts' in needs:  # MR-Search: the attempt ends are the retry env's milestones
      if not hasattr(self.env, 'attempts'):
        raise ValueError(f'environment {self.env.name!r} has no attempts; attempt credit '
                         f'(mr_search) needs a meta-episode of retries (household_retry)')
      ends = ags.milestone_turns(e, self.env)
      turns = turns.replace(attempts=jnp.where(e.turn_mask, jnp.cumsum(ends, -1) - ends, 0))
    if 'feedback_logprobs' in needs:  # ReBel: one teacher-forced pass
      turns = turns.replace(feedback_logprobs=ags.feedback_logprobs(
          params, self.pcfg, self.env, e.tokens, e.turn_mask, self.pad_id,
          num_turns=self.num_turns))
    if 'expert_matches' in needs:
      if not hasattr(self.env, 'expert_action'):
        raise ValueError(f'environment {self.env.name!r} has no expert (env.expert_action); '
                         f'expert-trace credit needs one (household)')
      expert = _expert_traces(draw.handle, env=self.env, num_turns=self.num_turns)
      expert = expert.replace(tokens=self.lm_ids(expert.tokens))
      turns = turns.replace(expert_matches=ags.expert_matches(e, expert, self.env,
                                                              self.num_turns))
    probes = {'answer_logprobs', 'tool_probes', 'evidence_probes'} & set(needs)
    if probes:  # gold-answer probes (IGPO; TACO and ICA without one turn's observation)
      if not hasattr(self.env, 'answer'):
        raise ValueError(f'environment {self.env.name!r} has no gold answer (env.answer); '
                         f'the answer probes ({", ".join(sorted(probes))}) need one '
                         f'(household, webshop)')
      answer, mask = _answers(draw.handle[0], env=self.env)
      answer = self.lm_ids(answer)
      g = e.tokens.shape[1]
      answer, mask = (jnp.repeat(x[:, None], g, 1) for x in (answer, mask))
      turns = turns.replace(answer_logprobs=ags.answer_logprobs(
          params, self.pcfg, self.env, e.tokens, answer, mask, num_turns=self.num_turns))
      for field, at in (('tool_probes', 'next'), ('evidence_probes', 'last')):
        if field in probes:  # K more teacher-forced passes each
          turns = turns.replace(**{field: ags.masked_answer_logprobs(
              params, self.pcfg, self.env, e.tokens, answer, mask, e.turn_mask, self.pad_id, at=at,
              num_turns=self.num_turns)})
    return turns

  def eval_starts(self, ecfg, library=None):
    """The eval.num_prompts held-out start states (key eval.seed), reading `library` if given."""
    start = _reset(jax.random.fold_in(jax.random.PRNGKey(ecfg.seed), 0), env=self.env,
                   n=ecfg.num_prompts)
    return start if library is None else _attach(start, self._library(library), env=self.env)

  def greedy_episodes(self, params, ecfg, library=None, start=None) -> ags.Episodes:
    """The greedy episodes `evaluate` scores, one per held-out start state (`start`: those
    of `eval_starts(ecfg, library)`, if the caller has them)."""
    if start is None:
      start = self.eval_starts(ecfg, library)
    return ags.sample_episodes(params, self.pcfg, self.env,
                               jax.random.fold_in(jax.random.PRNGKey(ecfg.seed), 1),
                               ecfg.num_prompts, 1, 0.0, num_turns=self.num_turns,
                               start=start, vocab=self.vocab)

  def evaluate(self, params, ecfg, library=None) -> dict:
    """Greedy success rate and return on eval.num_prompts held-out episodes (a fixed key,
    eval.seed), and pass@k / mean return of k temperature-1 episodes on eval.pass_prompts;
    with `library`, the episodes read the experience library (SLEA-RL's policy and library)."""
    key = jax.random.PRNGKey(ecfg.seed)
    start = self.eval_starts(ecfg, library)
    greedy = self.greedy_episodes(params, ecfg, start=start)
    sub = jax.tree.map(lambda x: x[:ecfg.pass_prompts], start)
    samples = ags.sample_episodes(params, self.pcfg, self.env, jax.random.fold_in(key, 2),
                                  ecfg.pass_prompts, ecfg.pass_k, 1.0, num_turns=self.num_turns,
                                  start=sub, vocab=self.vocab)
    return {'greedy_acc': float(jnp.mean(greedy.success)),
            'eval_return': float(jnp.mean(greedy.returns)),
            'eval_turns': float(jnp.mean(greedy.lengths)),
            f'pass@{ecfg.pass_k}': float(jnp.mean(jnp.any(samples.success, -1))),
            'eval_sample_reward': float(jnp.mean(samples.returns))}

  def demonstrations(self, key, n: int):
    """(prompts [n, O], responses [n, L], loss mask [n, L]): n expert episodes, the loss on
    their action tokens only."""
    if not hasattr(self.env, 'expert_action'):
      raise ValueError(f'environment {self.env.name!r} has no expert (env.expert_action) to '
                       f'warm-start from; set sft.steps=0')
    prompts, tokens, policy = _demos(key, env=self.env, n=n, num_turns=self.num_turns)
    return self.lm_ids(prompts), self.lm_ids(tokens), policy
