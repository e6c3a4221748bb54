"""The method catalogue (`credit/catalogue.py`, `python -m credit`): every registered
estimator has a row, docs/methods.md is what the catalogue generates, verl's names resolve."""

import os
import re

import pytest

import credit
from credit import __main__ as cli
from credit import catalogue, registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_registered_estimator_has_a_row_and_no_row_is_stale():
  assert set(catalogue.PAPERS) == set(credit.names())
  assert set(catalogue.STAND_INS) <= set(credit.names())
  assert set(registry.ALIASES.values()) <= set(credit.names())
  assert not set(registry.ALIASES) & set(credit.names())


def test_docs_methods_md_is_generated_from_the_catalogue():
  with open(os.path.join(ROOT, 'docs', 'methods.md')) as f:
    assert f.read().rstrip('\n') == catalogue.markdown().rstrip('\n'), (
        'docs/methods.md is stale: python -m credit --markdown > docs/methods.md')


def test_rows_point_at_files_that_exist():
  for m in catalogue.catalogue():
    for path in (m.config, m.script):
      if path:
        head = re.split(r'[: ]', path)[0]
        assert os.path.isfile(os.path.join(ROOT, head)), (m.name, path)
    assert m.reading and m.paper, m.name


def test_rows_read_the_registry():
  m = catalogue.entry('spo_chain')
  assert m.family == 'tree' and m.loss_mask and not m.stateful and m.needs == ()
  assert m.hparams == {'threshold': 0.9, 'whiten': True, 'eps': 1e-8}
  assert catalogue.entry('gepo').stateful and 'entropy' in catalogue.entry('gepo').needs
  assert catalogue.entry('gigpo').family == 'agent'
  assert catalogue.entry('appo').stand_in and not catalogue.entry('verl_rank').stand_in
  assert {m.name for m in catalogue.catalogue(need='turns')} == {
      n for n in credit.names() if 'turns' in credit.needs(n)}


def test_verl_names_are_aliases():
  assert credit.get('reinforce_plus_plus') is credit.get('reinforce_pp')
  assert credit.get('rloo_vectorized') is credit.get('rloo')
  assert credit.needs('grpo_vectorized') == credit.needs('grpo')
  assert not credit.stateful('reinforce_plus_plus_baseline')
  assert catalogue.entry('reinforce_plus_plus').name == 'reinforce_pp'
  assert catalogue.entry('reinforce_pp').aliases == ('reinforce_plus_plus',)
  with pytest.raises(ValueError, match='alias'):
    credit.register('rloo_vectorized')(lambda rollouts: None)
  with pytest.raises(ValueError, match='unknown credit estimator'):
    credit.get('reinforce_plus_plus_plus')


def test_cli_lists_filters_and_shows(capsys):
  assert cli.main(['--family', 'tree']) == 0
  out = capsys.readouterr().out
  assert 'spo_chain' in out and not re.search(r'^grpo ', out, re.M)
  assert cli.main(['--needs', 'step_ends']) == 0
  assert all('step_ends' in line for line in capsys.readouterr().out.strip().splitlines())
  assert cli.main(['reinforce_plus_plus']) == 0
  assert 'aliases:  reinforce_plus_plus' in capsys.readouterr().out
  assert cli.main(['--family', 'none-such']) == 1
  assert 'families:' in capsys.readouterr().err
