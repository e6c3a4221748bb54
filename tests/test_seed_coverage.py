"""The seed-method coverage table (`credit/seed_coverage.py`, `python -m credit --coverage`):
docs/coverage.md is what it generates, and its data agrees with the catalogue."""

import os

from credit import __main__ as cli
from credit import catalogue, seed_coverage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_coverage_md_is_generated_from_the_catalogue():
  with open(os.path.join(ROOT, 'docs', 'coverage.md')) as f:
    assert f.read() == seed_coverage.markdown(), (
        'docs/coverage.md is stale: python -m credit --coverage > docs/coverage.md')


def test_cli_prints_the_table(capsys):
  assert cli.main(['--coverage']) == 0
  assert capsys.readouterr().out == seed_coverage.markdown()


def test_the_data_agrees_with_the_catalogue():
  seeds = set(seed_coverage.SEEDS)
  registered = {s for m in catalogue.catalogue() for s in m.seeds}
  assert len(seeds) == 125
  assert registered <= seeds, 'an estimator cites a seed id outside the in-scope set'
  built = registered | set(seed_coverage.ELSEWHERE)
  # A seed that gets built must leave NOT; every other seed is built somewhere.
  assert not built & set(seed_coverage.NOT), sorted(built & set(seed_coverage.NOT))
  assert seeds - set(seed_coverage.NOT) == built
  for table in (seed_coverage.PARTIAL, seed_coverage.STAND_IN_SOURCES):
    assert set(table) <= built


def test_status_rule():
  table = {r.seed: r for r in seed_coverage.rows()}
  stand_in = {s for m in catalogue.catalogue() if m.stand_in for s in m.seeds}
  for seed, r in table.items():
    if seed in seed_coverage.NOT:
      want = 'not implemented'
    elif seed in seed_coverage.PARTIAL:
      want = 'partial'
    elif seed in stand_in or seed in seed_coverage.STAND_IN_SOURCES:
      want = 'stand-in'
    else:
      want = 'implemented'
    assert r.status == want, (seed, r.status)
  assert table[35].status == 'stand-in' and 'appo' in table[35].note  # the catalogue's line
  assert table[10].names == ('spo_chain', 'spo_tree') and table[10].status == 'implemented'
  assert table[61].where == 'loss `rgra`'
  c = seed_coverage.counts()
  assert sum(c.values()) == 125
  assert sum(seed_coverage.counts(llm_only=True).values()) == 125 - sum(
      off for _, _, off in seed_coverage.SEEDS.values())
