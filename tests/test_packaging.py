"""The libraries need only the core dependencies (pyproject.toml's `dependencies`)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The extras' packages; absl is left out (jax imports it). A blocked import raises.
EXTRAS = ('orbax', 'scipy', 'ml_collections', 'matplotlib', 'tqdm', 'gguf', 'tokenizers',
          'safetensors', 'jinja2', 'reasoning_gym', 'qwix', 'tensorboardX', 'wandb', 'mkdocs')


def test_trees_credit_envs_import_and_run_with_the_extras_blocked():
  script = textwrap.dedent(f"""
      import sys
      class Block:
        def find_spec(self, name, path=None, target=None):
          if name.split('.')[0] in {EXTRAS!r}:
            raise ImportError('blocked: ' + name)
      sys.meta_path.insert(0, Block())
      import jax.numpy as jnp
      import credit, envs, trees
      tokens = jnp.array([[[5, 6, 7], [5, 6, 8], [5, 9, 0]]])
      mask = tokens > 0
      adv = credit.get('tempo')(credit.Rollouts(tokens, mask, jnp.array([[1., 0., 1.]])))
      assert adv.shape == tokens.shape, adv.shape
      envs.get('scratch_add'), envs.get_env('household')
      print('ok')
      """)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr[-3000:]
