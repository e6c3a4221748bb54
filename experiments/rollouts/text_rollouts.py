"""The text-task side of the loop: chat prompts in, host-verified rewards out.

A `TextProblem` gives the RL loop (`experiments/training/loop.py`) what a JAX task gives
it, for a pretrained model and a text task (`envs.text_tasks`):
  draw(step, n)         -> Draw: prompts [n, P] right-padded chat-template token ids,
                           prompt_len [n], stable prompt ids, the examples;
  rewards(draw, s)      -> (rewards [n, G] f32, metrics): responses decoded on the
                           host and scored by the task's own verifier, outside jit;
  evaluate(params, ecfg) -> greedy accuracy / pass@k / mean sampled reward.
Shapes are static: P = lm.max_prompt_len, L = lm.max_new_tokens, so sampling,
credit and the update compile once and stay jitted; only scoring runs in Python.

The loop samples text prompts with the same samplers as JAX tasks
(`loop.sample` -> `sampling.Samples`), so an estimator that needs `Rollouts.entropy` gets the
sampler's untempered next-token entropy (equal to a teacher-forced pass's up to float
rounding); prompt log-probs, changed-context log-probs and saliency are computed by the loop
on the right-padded prompts with their `prompt_len`.

Responses end at the first stop token (the tokenizer's end-of-turn / end-of-text
ids) or at L tokens. A response without a stop token is *truncated*;
lm.truncation = 'score' scores it as it is, 'zero' gives it reward 0.
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from envs import text as text_lib
from envs import text_tasks
from experiments.rollouts import sampling
from experiments.training import train_step
from experiments.models import decoder, pretrained


@functools.lru_cache(maxsize=16)
def _examples(task, split: str, n: int, seed: int) -> tuple:
  """task.examples, once per process (every run of a comparison reuses them)."""
  return tuple(task.examples(split, n, seed=seed))


@dataclasses.dataclass
class Draw:
  """One step's prompts. prompts [B, P] int32; prompt_len, prompt_ids [B] int32."""
  prompts: jax.Array
  prompt_len: Optional[jax.Array]
  prompt_ids: jax.Array
  handle: Any  # the JAX task's info pytree, or the list of TextExamples


def loading_mesh(cfg):
  """The loop's mesh (`train_step.make_mesh(cfg.mesh.fsdp, model=cfg.mesh.model)`) for
  `pretrained.load` to place the checkpoint on, straight from the files; None on one
  device."""
  if jax.device_count() == 1:
    return None
  return train_step.make_mesh(cfg.mesh.fsdp, model=cfg.mesh.get('model', 1))


class TextProblem:
  """A text task on a pretrained model (see the module docstring)."""
  capabilities = frozenset()  # none of the optional parts (experiments/training/problems.py)

  def __init__(self, cfg):
    lm = cfg.lm
    self.task = text_tasks.make_text_task(cfg.task.name, **dict(cfg.task.kwargs))
    self.max_prompt_len, self.response_len = lm.max_prompt_len, lm.max_new_tokens
    self.model = pretrained.load(lm.source, max_len=lm.max_prompt_len + lm.max_new_tokens,
                                 dtype=lm.dtype, remat=lm.remat, mesh=loading_mesh(cfg))
    self.pcfg, self.tokenizer = self.model.cfg, self.model.tokenizer
    if lm.lora_rank:  # frozen pretrained weights + fresh (neutral) qwix LoRA adapters
      self.pcfg = dataclasses.replace(self.pcfg, lora_rank=lm.lora_rank, lora_alpha=lm.lora_alpha)
    self.eos_id = tuple(self.tokenizer.stop_ids)  # every stop id ends a response
    self.pad_id = self.tokenizer.pad_id
    if lm.truncation not in text_lib.TRUNCATION_MODES:
      raise ValueError(f'lm.truncation must be one of {text_lib.TRUNCATION_MODES}, '
                       f'got {lm.truncation!r}')
    self.truncation = lm.truncation
    self.seed = lm.data_seed
    self.train_pool = _examples(self.task, 'train', lm.train_size, self.seed)
    self.eval_set = _examples(self.task, 'eval', cfg.eval.num_prompts, self.seed)

  @functools.cached_property
  def init_params(self):
    """The pretrained params, plus fresh LoRA adapters when lm.lora_rank > 0."""
    if not self.pcfg.lora_rank:
      return self.model.params
    return decoder.add_lora(jax.random.PRNGKey(self.seed), self.model.params, self.pcfg)

  def encode(self, examples) -> Draw:
    """Chat-template token ids of `examples`, right-padded to max_prompt_len."""
    texts = [self.tokenizer.render_chat(self.task.messages(ex)) for ex in examples]
    prompts, lens = self.tokenizer.encode_batch(texts, length=self.max_prompt_len)
    return Draw(jnp.asarray(prompts), jnp.asarray(lens),
                jnp.asarray([ex.id for ex in examples], jnp.int32), list(examples))

  def draw(self, key, step: int, n: int) -> Draw:
    """n distinct training examples for RL step `step` (a function of seed and step)."""
    del key
    if n > len(self.train_pool):
      raise ValueError(f'{n} prompts per step > lm.train_size = {len(self.train_pool)}')
    rng = np.random.default_rng([self.seed, step])
    return self.encode([self.train_pool[i] for i in rng.choice(len(self.train_pool), n, replace=False)])

  def decode(self, tokens, mask):
    """[B, G, L] samples -> (texts [B*G] without the stop token, truncated [B, G] bool)."""
    # Every process decodes all rows (host_value gathers a multi-process array).
    tokens, lengths = train_step.host_value(tokens), train_step.host_value(mask).sum(-1)
    stops = np.asarray(self.eos_id)
    last = np.take_along_axis(tokens, np.maximum(lengths - 1, 0)[..., None], -1)[..., 0]
    stopped = (lengths > 0) & np.isin(last, stops)
    texts = [self.tokenizer.decode(row[:n - int(s)])
             for row, n, s in zip(tokens.reshape(-1, tokens.shape[-1]), lengths.reshape(-1),
                                  stopped.reshape(-1))]
    return texts, ~stopped

  def rewards(self, draw: Draw, samples) -> tuple[jax.Array, dict]:
    """Host-side scores [B, G] of sampled responses (see lm.truncation)."""
    b, g = samples.tokens.shape[:2]
    texts, truncated = self.decode(samples.tokens, samples.mask)
    examples = [ex for ex in draw.handle for _ in range(g)]
    r = text_lib.score_responses(self.task, examples, texts, truncated.reshape(-1),
                                 truncation=self.truncation)
    return jnp.asarray(r.reshape(b, g)), dict(truncated_frac=float(truncated.mean()))

  def evaluate(self, params, ecfg) -> dict:
    """Greedy accuracy on the eval set; pass@k and mean reward of k samples on its first
    eval.pass_prompts examples (temperature 1)."""
    key = jax.random.PRNGKey(ecfg.seed)
    draw = self.encode(self.eval_set)
    greedy = sampling.sample_iid(params, self.pcfg, key, draw.prompts, 1, self.response_len,
                                 temperature=0.0, eos_id=self.eos_id, pad_id=self.pad_id,
                                 prompt_len=draw.prompt_len, prompt_ids=draw.prompt_ids)
    acc, m = self.rewards(draw, greedy)
    sub = self.encode(self.eval_set[:ecfg.pass_prompts])
    samples = sampling.sample_iid(params, self.pcfg, jax.random.fold_in(key, 2), sub.prompts,
                                  ecfg.pass_k, self.response_len, temperature=1.0,
                                  eos_id=self.eos_id, pad_id=self.pad_id,
                                  prompt_len=sub.prompt_len, prompt_ids=sub.prompt_ids)
    r, _ = self.rewards(sub, samples)
    return {'greedy_acc': float(jnp.mean(acc)), f'pass@{ecfg.pass_k}': float(jnp.mean(r.max(-1))),
            'eval_sample_reward': float(jnp.mean(r)), 'eval_truncated': m['truncated_frac']}

  def generate(self, params, messages_list, max_new_tokens: Optional[int] = None) -> list[str]:
    """Greedy replies to a list of chat conversations (for notebooks and tests)."""
    texts = [self.tokenizer.render_chat(list(m)) for m in messages_list]
    prompts, lens = self.tokenizer.encode_batch(texts, length=self.max_prompt_len)
    s = sampling.sample_iid(params, self.pcfg, jax.random.PRNGKey(0), jnp.asarray(prompts), 1,
                            max_new_tokens or self.response_len, temperature=0.0,
                            eos_id=self.eos_id, pad_id=self.pad_id, prompt_len=jnp.asarray(lens))
    return self.decode(s.tokens, s.mask)[0]
