"""The main job's numbers, pinned: `python -m experiments.tempo --config.seeds="(0,1,2)"` (GRPO and
TEMPO, the default's first three seeds) prints, per seed, the final accuracies stored for this
machine (exactly), or on a machine without its own record, those of
docs/results/main_job_seeds012.json to 0.05: XLA's CPU rounding differs between CPUs, and over
40 RL steps it moves a run's final accuracy by up to 0.04 (measured, one commit on two machines:
GRPO 0.7832 / 0.7773 / 0.8047 on the 2-core machine that wrote main_job_seeds012.json, 0.8047 /
0.8164 / 0.8164 on an AVX-512 Xeon), and so does another summation order on one machine (the
cascade decode, 6c6508d: 0.8340 / 0.7754 / 0.8398 on that Xeon,
docs/results/main_job/11c6dc0a55e7.json). Record this machine's with
`python tests/test_main_job.py` (5 minutes on 2 cores).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, 'docs', 'results')
REFERENCE = os.path.join(RESULTS, 'main_job_seeds012.json')
TOLERANCE = 0.05


def machine_file() -> str:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from golden import record
  return os.path.join(RESULTS, 'main_job', record.records_id() + '.json')


SEEDS = '(0,1,2)'  # the pinned seeds: the default's first three (a run's numbers do not
# depend on the other seeds; 16 seeds take a quarter of an hour)


def run_main_job(workdir: str) -> dict:
  """The command as a user runs it (without the suite's single-thread XLA flags), on the
  pinned seeds."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('XLA_FLAGS', 'JAX_DISABLE_MOST_OPTIMIZATIONS')}
  env['PYTHONPATH'] = ROOT
  subprocess.run([sys.executable, '-m', 'experiments.tempo', f'--workdir={workdir}',
                  f'--config.seeds={SEEDS}'], cwd=ROOT, env=env, check=True,
                 stdout=subprocess.DEVNULL)
  with open(os.path.join(workdir, 'summary.json')) as f:
    return json.load(f)


def final_accs(summary: dict) -> dict:
  return {m: [r['final_acc'] for r in runs] for m, runs in summary['methods'].items()}


@pytest.mark.slow  # 3.5 minutes on 2 cores: 6 runs of 40 steps and the SFT start
def test_main_job_prints_its_recorded_numbers(tmp_path):
  got = final_accs(run_main_job(str(tmp_path)))
  own = os.path.exists(machine_file())
  with open(machine_file() if own else REFERENCE) as f:
    want = final_accs(json.load(f))
  assert sorted(got) == sorted(want)
  for method in want:
    if own:
      assert got[method] == want[method], method
    else:
      assert got[method] == pytest.approx(want[method], abs=TOLERANCE), method


if __name__ == '__main__':  # records this machine's summary
  out = machine_file()
  os.makedirs(os.path.dirname(out), exist_ok=True)
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    summary = run_main_job(tmp)
  summary.pop('plots', None)
  with open(out, 'w') as f:
    json.dump(summary, f, indent=1)
  print(out, final_accs(summary))
