"""Multi-turn agents: turn-level credit vs GRPO on a JAX environment, from an expert warm start.

`python -m experiments.agents` runs every agent estimator against GRPO; the per-paper
scripts (experiments/gigpo.py, gagpo, salt, graphgpo, gtpo, cast, igpo, tree_grpo_turns)
run one estimator against GRPO with configs built by `paper` below.

Default budget (2 CPU cores, minutes per run): `household` (ALFWorld-style: find the
object, maybe clean it at the sink, put it in the goal receptacle; reward 1 on success,
K = 8 turns), a d=64/2-layer policy warm-started by 150 SFT steps on the environment's
privileged expert (it knows where the object lies, so imitating it teaches the action
format and the sub-goal order but not where to look: the warm start succeeds on about
a fifth of the held-out episodes, 0.22, and RL has to learn the search), then 30 RL steps of 16 start
states x G=8 trajectories (the same 3,840 episodes per run), 3 seeds.
With --config.agent.lm_source=smollm2 the agent is the pretrained LM (use lr ~1e-5 for SFT
and ~1e-6 for RL, and fewer start states per step on a CPU).
Samplers: 'iid' (G i.i.d. trajectories per start state) and 'tree_turns' (num_chains
chains, each forked into 1 + num_continuations at turn boundary fork_turn by copying the
environment state and the KV cache: G = num_chains (1 + num_continuations)).
"""

import ml_collections

from configs import tempo


def get_config() -> ml_collections.ConfigDict:
  c = tempo.get_config()
  c.seeds = (0, 1, 2)
  c.methods = ('grpo:iid,tempo:iid,gigpo:iid,gagpo:iid,salt:iid,graphgpo:iid,gtpo:iid,'
               'cast:iid')
  c.task = ml_collections.ConfigDict(dict(name='household', kwargs={'max_turns': 8}))
  # num_turns: K of the sampler (0 = the environment's max_turns); gamma: the discount of
  # solver values (CAST) — the estimators' own gamma is in credit.hparams.
  # lm_source: '' = the toy decoder (c.model) on the environment's vocabulary; else a
  # pretrained LM ('smollm2', a .gguf file, a Hugging Face directory) reading the
  # environment's words as its own tokens (lm_aliases: one-token spellings, see
  # experiments/rollouts/agent_rollouts.py); lm_dtype its compute dtype.
  # experience_slots > 0: the environment inside SLEA-RL's experience wrapper (envs/experience.py:
  # observations followed by the library's hints for their cluster, 'observation' or 'state'),
  # whose library the 'experience' sampler fills; 0: the environment itself.
  c.agent = ml_collections.ConfigDict(dict(num_turns=0, gamma=0.95, lm_source='',
                                           lm_dtype='float32', lm_aliases={},
                                           experience_slots=0,
                                           experience_cluster='observation'))
  # attn_chunk > 0: causal attention in query chunks (decoder.causal_attention; the same
  # numbers up to float rounding, ~3x faster training steps at 1,454 tokens).
  c.model = ml_collections.ConfigDict(dict(d_model=64, num_layers=2, num_heads=4, d_ff=192,
                                           attn_chunk=0))
  c.sampler.update(group_size=8, num_chains=4, num_continuations=1)
  c.sampler.fork_turn = 2
  c.sft.update(steps=150, batch_size=32, lr=1e-3, warmup_steps=20)
  c.rl.update(steps=30, prompts_per_step=16, ckpt_every=10)
  c.optimizer.lr = 3e-4
  c.loss.update(num_minibatches=2)
  c.eval.update(every=5, num_prompts=256, pass_k=8, pass_prompts=32)
  return c


def paper(methods: str, **overrides) -> ml_collections.ConfigDict:
  """A per-paper comparison: `get_config()` with `methods` (always including GRPO, the
  outcome baseline, on the same environment and rollout budget) and config overrides
  given as {'task': {...}, 'credit': {...}, 'sampler': {...}}."""
  c = get_config()
  c.methods = methods
  for section, values in overrides.items():
    c[section].update(values)
  return c


def shrink(c: ml_collections.ConfigDict, defaults=None, explicit=()) -> ml_collections.ConfigDict:
  """The --config.quick=True smoke run (about a minute on 2 CPU cores); keeps what the user
  set (`configs.tempo.apply_quick`; `defaults` None: `get_config()`)."""
  quick = {'model.d_model': 32, 'model.num_layers': 1, 'model.num_heads': 2, 'model.d_ff': 64,
           'task.kwargs.max_turns': 6 * c.task.kwargs.get('attempts', 1),  # household_retry
           'sampler.group_size': 4, 'sampler.num_chains': 2, 'sampler.num_continuations': 1,
           'sampler.fork_turn': 1,
           'sft.steps': 10, 'sft.batch_size': 32, 'sft.warmup_steps': 2,
           'rl.steps': 2, 'rl.prompts_per_step': 4, 'rl.ckpt_every': 2,
           'eval.every': 2, 'eval.num_prompts': 16, 'eval.pass_k': 4, 'eval.pass_prompts': 4,
           'seeds': (0,)}
  return tempo.apply_quick(c, quick, get_config() if defaults is None else defaults, explicit)
