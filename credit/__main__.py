"""Lists the registered estimators: `python -m credit [--family F] [--needs KEY] [NAME ...]`.

NAME (or a verl alias) prints that method in full; `--markdown` prints docs/methods.md,
`--coverage` docs/coverage.md (seed id -> method -> implemented / stand-in / partial / not).
"""

import argparse
import sys

import credit  # noqa: F401  (registers the estimators)
from credit import catalogue, seed_coverage


def _full(m: catalogue.Method) -> str:
  hp = ', '.join(f'{k}={v!r}' for k, v in m.hparams.items()) or 'none'
  lines = [f'{m.name}  [{m.family}]', f'  paper:    {m.paper}', f'  reading:  {m.reading}',
           f'  needs:    {", ".join(m.needs) or "-"}', f'  hparams:  {hp}',
           f'  config:   {m.config or "-"}', f'  script:   {m.script or "-"}']
  lines += [f'  stand-in: {m.stand_in}'] if m.stand_in else []
  lines += [f'  aliases:  {", ".join(m.aliases)}'] if m.aliases else []
  lines += [f'  {flag}' for flag, on in (('stateful', m.stateful),
                                         ('has a loss mask', m.loss_mask)) if on]
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m credit', description=__doc__.split('\n')[0])
  parser.add_argument('names', nargs='*', help='methods to show in full')
  parser.add_argument('--family', help='only this family (outcome, tree, agent, ...)')
  parser.add_argument('--needs', help='only estimators that need this Rollouts/Turns field')
  parser.add_argument('--markdown', action='store_true', help='print docs/methods.md')
  parser.add_argument('--coverage', action='store_true',
                      help='print docs/coverage.md (the seed methods and their status)')
  args = parser.parse_args(argv)
  if args.markdown:
    print(catalogue.markdown())
    return 0
  if args.coverage:
    print(seed_coverage.markdown(), end='')
    return 0
  if args.names:
    print('\n\n'.join(_full(catalogue.entry(n)) for n in args.names))
    return 0
  rows = catalogue.catalogue(args.family, args.needs)
  if not rows:
    families = sorted({m.family for m in catalogue.catalogue()})
    print(f'no method matches; families: {", ".join(families)}', file=sys.stderr)
    return 1
  width = max(len(m.name) for m in rows)
  for m in rows:
    needs = f' needs {",".join(m.needs)}' if m.needs else ''
    print(f'{m.name:<{width}}  {m.family:<15} {m.paper}{needs}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
