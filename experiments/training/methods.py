"""Method specs of a comparison: 'credit[key=value,...]:sampler[:policy loss]'.

`config.methods` lists them, comma-separated; `parse_methods` validates the names and the
bracketed per-method `credit.hparams`, `method_name` writes the canonical spelling (run
directories and tables), `with_method` applies one to a config.
"""

import ast

import credit
from configs.tempo import SAMPLERS
from experiments.training import train_step as ts


def _split_methods(spec: str):
  """Splits 'a[x=1,y=2]:iid,b' at the commas outside brackets."""
  items, depth, start = [], 0, 0
  for i, ch in enumerate(spec + ','):
    depth += (ch == '[') - (ch == ']')
    if depth < 0 or depth > 1:
      raise ValueError(f'unbalanced or nested brackets in config.methods {spec!r}')
    if ch == ',' and depth == 0:
      items.append(spec[start:i].strip())
      start = i + 1
  if depth:
    raise ValueError(f'unbalanced brackets in config.methods {spec!r}')
  return items


def _method_hparams(text: str, item: str) -> tuple:
  """'tas=0,gamma=0.9' -> (('gamma', 0.9), ('tas', 0)): sorted (key, Python literal) pairs."""
  out = {}
  for pair in filter(None, (p.strip() for p in text.split(','))):
    key, eq, value = (x.strip() for x in pair.partition('='))
    try:
      ok, value = eq and key.isidentifier() and key not in out, ast.literal_eval(value)
    except (ValueError, SyntaxError):
      ok = False
    if not ok:
      raise ValueError(f'method {item!r}: hyperparameters are written [key=value,...], each key '
                       f'once, values Python literals (numbers, True/False, quoted strings); '
                       f'got {pair!r}')
    out[key] = value
  return tuple(sorted(out.items()))


def parse_methods(spec: str):
  """'grpo:iid,tempo:tree_entropy,grpo:iid:apa,avatar[tas=0]:iid' -> [('grpo', 'iid', '',
  ()), ('tempo', 'tree_entropy', '', ()), ('grpo', 'iid', 'apa', ()), ('avatar', 'iid', '',
  (('tas', 0),))]: credit estimator, sampler ('iid' if left out), an optional policy loss
  (`train_step.POLICY_LOSSES`; '' keeps `loss.policy_loss`) and the method's own
  `credit.hparams` (sorted (key, value) pairs over the shared dict; each checked against
  the estimator's signature by `credit.check_hparams`)."""
  out = []
  for item in _split_methods(spec):
    name, hp, rest = item, '', ''
    if '[' in item:  # name[key=value,...] then :sampler[:loss]
      name, hp = item.split('[', 1)
      hp, rest = hp.split(']', 1)
      if ':' in name or ':' in hp or (rest and not rest.startswith(':')):
        raise ValueError(f'method {item!r}: hyperparameters go right after the estimator, '
                         f'without colons, e.g. avatar[tas=0]:iid')
      rest = rest[1:]
    else:
      name, _, rest = item.partition(':')
    hparams = _method_hparams(hp, item)
    sampler, _, loss = rest.partition(':')
    sampler = sampler or 'iid'
    credit.get(name)
    if sampler not in SAMPLERS:
      raise ValueError(f'unknown sampler {sampler!r} in method {item!r}; valid: '
                       f'{", ".join(SAMPLERS)}')
    if loss and loss not in ts.POLICY_LOSSES:
      raise ValueError(f'unknown policy loss {loss!r} in method {item!r}; valid: '
                       f'{", ".join(ts.POLICY_LOSSES)}')
    out.append((name, sampler, loss, hparams))
  return out


def method_name(name: str, sampler: str, loss: str = '', hparams: tuple = ()) -> str:
  """The canonical 'credit[key=value,...]:sampler[:loss]' of a parsed method."""
  if hparams:
    name += '[' + ','.join(f'{k}={v!r}' for k, v in hparams) + ']'
  return f'{name}:{sampler}:{loss}' if loss else f'{name}:{sampler}'


def with_method(cfg, method: str):
  """A copy of cfg with credit.name, sampler.name (and loss.policy_loss, if the method
  names one) from 'credit[hparams]:sampler[:loss]'; the method's own hyperparameters
  override the shared `credit.hparams`."""
  (name, sampler, loss, hparams), = parse_methods(method)
  cfg = cfg.copy_and_resolve_references()
  cfg.credit.name = name
  cfg.sampler.name = sampler
  if loss:
    cfg.loss.policy_loss = loss
  if hparams:
    cfg.credit.hparams = {**dict(cfg.credit.hparams), **dict(hparams)}
  return cfg
