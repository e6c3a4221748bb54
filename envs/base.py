"""The `Task` interface: prompts, verifiable rewards and demonstrations as pure array functions.

A task is a frozen (hashable) dataclass of static hyperparameters, so it can be
closed over or passed as a static argument to `jax.jit`. Its array methods are
pure jnp functions over token ids (int32) and masks (bool):

  prompts, info = task.sample(key, n)                   # int32 [n, P], pytree of [n, ...]
  responses, mask = task.demonstrations(prompts, info)  # int32 [n, R], bool [n, R]
  rewards = task.reward(prompts, responses, mask, info)  # float32 [n]

`reward` and `demonstrations` also take any leading batch dimensions `[...]`
(including none, so they vmap), provided `info` has the same leading ones.

Response convention (all tasks): `mask` is True on the generated tokens (one run
from position 0, including the EOS token) and False after. A response is the
masked prefix; only its tokens up to and including its first EOS are read.
The answer-only tasks (addition, countdown, token_tree) have fixed-length answers
and `response_len` R is exactly that length plus one, so a correct response is R
masked tokens whose last is the first EOS. Anything else (no EOS, EOS too early,
masked-out tokens) scores 0. The chain-of-thought tasks (scratch_add,
countdown_steps) have variable-length responses: R is the longest valid one, a
response may end at its first EOS anywhere, tokens after it are ignored, and one
without EOS scores 0.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

EOS = "<eos>"
PAD = "<pad>"

Info = dict[str, jax.Array]


class Vocabulary:
  """What tasks and multi-turn environments share: a name, a token vocabulary (a token's id
  is its index), hyperparameter validation on construction, and `detokenize`."""

  name: ClassVar[str] = ""
  separator: ClassVar[str] = ""  # joins tokens in `detokenize`

  def __post_init__(self):
    self.validate()

  def validate(self):
    """Raises ValueError for invalid hyperparameters."""

  # --- static properties ----------------------------------------------------------------------

  @property
  def vocab(self) -> tuple[str, ...]:
    """Token strings; a token's id is its index."""
    raise NotImplementedError

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def pad_id(self) -> int:
    return self.vocab.index(PAD)

  def token_id(self, token: str) -> int:
    return self.vocab.index(token)

  def detokenize(self, ids: Any) -> str:
    """The text of a 1-D id sequence, up to its first pad token."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
      raise ValueError(f"detokenize takes a 1-D id sequence; got shape {ids.shape}.")
    out = []
    for i in ids.tolist():
      if i == self.pad_id:
        break
      out.append(self.vocab[i] if 0 <= i < self.vocab_size else f"<{i}?>")
    return self.separator.join(out)


@dataclasses.dataclass(frozen=True)
class Task(Vocabulary):
  """Base class: static hyperparameters (dataclass fields) plus array functions.

  `capabilities` declares the optional parts a task defines, for the training loop:
  'reasoning_steps' (the property and `step_ends`), 'process_rewards' (`token_rewards`),
  'interventions' (`interventions`)."""
  capabilities = frozenset()

  @property
  def eos_id(self) -> int:
    return self.vocab.index(EOS)

  @property
  def prompt_len(self) -> int:
    """P, the (fixed) prompt length."""
    raise NotImplementedError

  @property
  def response_len(self) -> int:
    """R, the maximum response length, including the EOS token."""
    raise NotImplementedError

  # --- array functions ------------------------------------------------------------------------

  def sample(self, key: jax.Array, n: int) -> tuple[jax.Array, Info]:
    """Samples n prompts: int32 [n, P], and `info`, a dict of arrays with leading dim n."""
    raise NotImplementedError

  def reward(self, prompts, responses, mask, info: Info) -> jax.Array:
    """float32 [n] rewards of responses int32 [n, R] (mask bool [n, R]) to prompts [n, P]."""
    raise NotImplementedError

  def demonstrations(self, prompts, info: Info) -> tuple[jax.Array, jax.Array]:
    """Correct responses int32 [n, R] (ending in EOS, then pad_id) and their mask bool [n, R]."""
    raise NotImplementedError

  # --- shared array helpers -------------------------------------------------------------------

  def _read(self, responses, mask):
    """The response as the model emitted it: (tokens [..., R] with -1 where masked out, ok [...]).

    `ok` is True iff the response's first EOS is its last token (position R-1)
    and all R tokens are masked in, i.e. the response has the one valid length.
    """
    tokens = jnp.where(mask, responses, -1)
    is_eos = tokens == self.eos_id
    ok = is_eos[..., -1] & ~jnp.any(is_eos[..., :-1], axis=-1)
    return tokens, ok

  def _finish(self, answer):
    """Demonstration from answer tokens [..., R-1]: (answer + EOS [..., R], all-True mask)."""
    answer = answer.astype(jnp.int32)
    eos = jnp.full(answer.shape[:-1] + (1,), self.eos_id, jnp.int32)
    responses = jnp.concatenate([answer, eos], axis=-1)
    return responses, jnp.ones(responses.shape, bool)
