"""The golden matrix (tests/golden/record.py): today's trainer reproduced bit for bit.

A fast subset runs in the default suite; the full matrix is slow-marked
(`python -m pytest -q tests/test_golden.py -m slow`). A failure lists every field that
differs; after an intended change of numbers, rerecord with `python tests/golden/record.py`.
"""

import pytest

from golden import record

GOLDEN, OWN = record.load()
# The default suite's cases: one run per pass (experiments/training/passes), with the quick
# i.i.d. run first (its SFT start is the JAX cases' own) and the resumed run (equal to it).
# The samplers and the rest of the trainer's branches: the full matrix (-m slow).
FAST = ('grpo_iid', 'resume_grpo_iid', 'grpo_lagged', 'grpo_knapsack', 'r3_pool', 'gepo_iid',
        'ppo_warmup', 'progrpo_kl', 'gcpo_iid', 'pbsd_iid', 'siop_iid', 'grail_iid', 'spae_iid',
        'intervention_iid', 'distil_iid', 'agents_experience')
# A float tie that flips on another CPU (siop's modal answer): only this machine's own records
# decide these; a machine without them skips them (its rows differ by more than rounding).
TIE_FLIPS = ('siop_iid',)


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  with record.full_optimization():  # the records' programs, compiled once for the module
    yield str(tmp_path_factory.mktemp('golden'))  # one SFT start for the module's cases


def check(name, root):
  """Bit for bit against this machine's records; on a machine that has none and rounds
  differently from golden.json's, the rows to float tolerance (`record.close`)."""
  got = record.run_case(name, root)
  diffs = record.diff(name, GOLDEN[name], got)
  if diffs and not OWN:
    diffs = record.close(name, GOLDEN[name], got)
    if diffs and name in TIE_FLIPS:
      pytest.skip(f'{name}: a float tie flips on this CPU (no records of its own): '
                  f'{diffs[0]}')
  assert not diffs, '\n'.join(diffs)


@pytest.mark.parametrize('name', FAST)
def test_golden_fast(name, root):
  check(name, root)


@pytest.mark.slow
@pytest.mark.parametrize('name', list(record.CASES))
def test_golden_matrix(name, root):
  check(name, root)


def test_matrix_is_recorded():
  """Every case has a record, the resumed run equals the uninterrupted one."""
  assert sorted(GOLDEN) == sorted(record.CASES)
  assert GOLDEN['resume_grpo_iid'] == GOLDEN['grpo_iid']
