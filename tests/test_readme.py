"""The README's examples run as written, and its commands match CI."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
  with open(os.path.join(ROOT, "README.md")) as f:
    return f.read()


def test_readme_python_examples_run(capsys):
  namespace = {}
  blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
  assert blocks
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
  assert "root  n=4" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"```bash\n(.*?)```", _readme(), re.S)
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    ci = f.read()
  assert commands[1].strip() in ci
  assert 'pip install --quiet -e ".[test]"' in ci and 'pip install -e ".[test]"' in commands[0]
