"""The golden matrix (tests/golden/record.py): today's trainer reproduced bit for bit.

A fast subset runs in the default suite; the full matrix is slow-marked
(`python -m pytest -q tests/test_golden.py -m slow`). A failure lists every field that
differs; after an intended change of numbers, rerecord with `python tests/golden/record.py`.
"""

import pytest

from golden import record

GOLDEN, OWN = record.load()
# The default suite's cases: the quick i.i.d. run (its SFT start and GRPO programs are
# test_families' shapes), then two that reuse its programs: the lagged sampler (loop state
# in the checkpoint) and the resumed run (equal to the uninterrupted one).
FAST = ('grpo_iid', 'grpo_lagged', 'resume_grpo_iid')


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  return str(tmp_path_factory.mktemp('golden'))  # one SFT start for the module's cases


def check(name, root):
  """Bit for bit against this machine's records; on a machine that has none and rounds
  differently from golden.json's, the rows to float tolerance (`record.close`)."""
  got = record.run_case(name, root)
  diffs = record.diff(name, GOLDEN[name], got)
  if diffs and not OWN:
    diffs = record.close(name, GOLDEN[name], got)
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
