"""The golden matrix: tiny training runs that together take the main branches of
`loop.train`, each recorded as numbers a pure refactor must reproduce bit for bit
(docs: ../shared/design/trainer.md, "Proving it: the golden matrix").

    python tests/golden/record.py [--only NAME,...]   # (re)record into golden.json
    python tests/golden/record.py --check [--only ...]  # rerun, compare; exit 1 on a difference
    python tests/golden/record.py --machine --no-opt --only NAME,...  # the suite's fast cases
    python tests/golden/record.py --write-checkpoints DIR   # with the old code: step 1 of each
    python tests/golden/record.py --resume-checkpoints DIR  # with the new: resume, compare

A record: the metric rows without timing fields, sha256 of the final params, sha256 of the
saved loop state beside them (None if none) and the run's fingerprint (checkpoint meta).

Float rounding of XLA's CPU programs depends on the CPU (measured: the same commit and jaxlib
give other last bits on an AVX-512/AMX Xeon than where golden.json was recorded), so a
machine whose records differ keeps its own: `--machine` records into
machines/<machine_id()>.json, which `load` prefers on that machine; machines/aliases.json
points a machine at another's file once all its cases were checked identical to it.
`--no-opt` runs with XLA's optimizations off, as the default suite compiles, into
machines/<id>.no-opt.json: the suite's fast subset is compared with those (bit for bit; a
machine without them: its rows to rtol 1e-3 of the optimized records). A case is checked bit
for bit where this machine's file has it: after an intended change of numbers recorded on one
machine, the others' files drop the case until it is rerecorded there (`--machine --only`).
The Turns-field cases (cast_iid ... matchtir_iid) came later: golden.json holds them as
recorded on cb3003afe061, the agent cases and tempo_tree_fixed as recorded on 6cda3184560e
after their samplers' switches to the cascade layouts (its other cases are the first
machine's).
"""

import os
import sys

# As tests/conftest.py, before jax is imported: script and pytest give identical numbers.
os.environ.setdefault('XLA_FLAGS',
                      '--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Callable, Optional  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from configs import agents as agents_config  # noqa: E402
from configs import lm as lm_config  # noqa: E402
from configs import tempo as tempo_config  # noqa: E402
from experiments.training import loop  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, 'golden.json')
TRAIN_KEYS = ('params', 'opt_state', 'step', 'rng')  # the rest of a checkpoint: loop state


@dataclasses.dataclass(frozen=True)
class Case:
  """One run: `method` on configs.<module>[:variant] (quick), then `edit(cfg)`."""
  method: str
  module: str = 'tempo'
  variant: str = ''
  edit: Optional[Callable] = None
  covers: str = ''
  resume: bool = False  # run 1 step, then rl.steps = 2 in the same workdir
  devices: int = 1      # > 1: in a subprocess with that many host devices


def _set(**fields):
  """An edit setting dotted config paths ('rl.prompt_pool' -> rl__prompt_pool)."""
  def edit(cfg):
    for path, value in fields.items():
      *parents, key = path.split('__')
      node = cfg
      for p in parents:
        node = node[p]
      with node.unlocked() if hasattr(node, 'unlocked') else contextlib.nullcontext():
        node[key] = value
  return edit


def _critic(warmup: int):
  """An edit adding configs/ppo.py's critic section, `warmup` critic-only steps first."""
  def edit(cfg):
    from configs import ppo
    with cfg.unlocked():
      cfg.critic = ppo.get_config().critic
    cfg.critic.critic_warmup = warmup
  return edit


CASES = {
    # Samplers (JAX task), packing modes merged into the tree samplers' runs.
    'grpo_iid': Case('grpo:iid', covers="sampler iid; packing 'tree', attention 'auto'"),
    'tempo_tree_fixed': Case('tempo:tree_fixed', edit=_set(train__packing='prompt'),
                             covers="sampler tree_fixed; tempo credit; packing 'prompt'"),
    'tempo_tree_entropy': Case('tempo:tree_entropy', edit=_set(train__pack_attention='blocks'),
                               covers="sampler tree_entropy; pack_attention 'blocks'"),
    'spo_chain_tree_cutpoints': Case('spo_chain:tree_cutpoints',
                                     edit=_set(train__pack_attention='paths'),
                                     covers="sampler tree_cutpoints; pack_attention 'paths'"),
    'elpo_tree_bisect': Case('elpo:tree_bisect', edit=_set(train__packing='none'),
                             covers="sampler tree_bisect; packing 'none' (flat rows)"),
    'grpo_tree_steps': Case('grpo:tree_steps', edit=_set(sampler__num_levels=1),
                            covers='sampler tree_steps'),
    'grpo_lagged': Case('grpo:lagged', edit=_set(sampler__lag=2),
                        covers='sampler lagged (behaviour params in aux state)'),
    'grpo_hinted': Case('grpo:hinted', module='hints', covers="sampler hinted, 'staged'"),
    'adhint_hinted': Case('adhint:hinted', module='hints', variant='adhint',
                          covers="sampler hinted, 'difficulty' schedule; adhint credit"),
    'grpo_knapsack': Case('grpo:knapsack', edit=_set(rl__prompt_pool=8),
                          covers='sampler knapsack (pool; pass rates in aux state)'),
    'appo_tree_branching': Case('appo:tree_branching', module='tree_search', variant='appo',
                                covers='sampler tree_branching; appo credit'),
    # Passes.
    'gepo_iid': Case('gepo:iid', module='confidence',
                     covers='stateful credit (credit_state); entropy'),
    'ppo_iid': Case('ppo:iid', edit=_critic(0), covers='learned critic, no warm-up'),
    'ppo_warmup': Case('ppo:iid', edit=_critic(1), covers='critic warm-up (step 1 critic only)'),
    'r3_pool': Case('r3:iid', edit=_set(rl__prompt_pool=8),
                    covers='prompt pool + replay, one-sided (replay store in aux state)'),
    'avatar_pool': Case('avatar:iid', edit=_set(rl__prompt_pool=8),
                        covers='prompt pool + replay, two-sided'),
    'intervention_iid': Case('intervention:iid',
                             edit=_set(credit__hparams={'intervention_steps': 2}),
                             covers='InT phase before RL'),
    'distil_iid': Case('distil:iid', covers='DistIL expert SFT step (expert_opt in aux state)'),
    'spae_iid': Case('spae:iid', module='probes',
                     covers='step probes; process rewards (step_ends)'),
    'pbsd_iid': Case('pbsd:iid', module='hindsight', variant='plain',
                     covers='hindsight log-probs (gold answer in context)'),
    'siop_iid': Case('siop:iid', module='hindsight', variant='plain', covers='self-hindsight'),
    'progrpo_kl': Case('progrpo:iid', edit=_set(loss__kl_coef=0.01, rl__recompute_logprobs=True),
                       covers='prompt log-probs; KL loss (reference log-probs); recomputed '
                              'old log-probs'),
    'gcpo_iid': Case('gcpo:iid', module='context_shift', covers='context log-probs'),
    'grail_iid': Case('grail:iid', module='saliency', covers='saliency pass'),
    'hrpo_iid': Case('hrpo:iid', covers='process rewards (token_rewards, step_ends)'),
    # Agent problems, resume, a 2-device mesh.
    'agents_tree_turns': Case('tree_grpo:tree_turns', module='agents',
                              covers='agent problem (multi-turn sampler); sampler tree_turns'),
    'agents_experience': Case('gigpo:experience', module='turn_norm', variant='slea',
                              edit=_set(sampler__min_count=1),
                              covers='sampler experience (library in aux state); turn credit'),
    # The Turns fields a multi-turn problem computes for an estimator (`AgentProblem.turns`).
    'cast_iid': Case('cast:iid', module='cast', edit=_set(sft__steps=100),  # moves that progress
                     covers='turn fields solver_steps, values_star'),
    'rebel_iid': Case('rebel:iid', module='milestones',
                      covers='turn fields milestones, feedback_logprobs'),
    'taco_tools_iid': Case('taco_tools:iid', module='tool_credit',
                           covers='turn fields answer_logprobs, tool_probes'),
    'ica_iid': Case('ica:iid', module='tool_credit', covers='turn field evidence_probes'),
    'infopo_iid': Case('infopo:iid', module='expert_traces', covers='turn field info_gains'),
    'matchtir_iid': Case('matchtir:iid', module='expert_traces',
                         covers='turn field expert_matches'),
    'text_grpo_iid': Case('grpo:iid', module='lm', covers='text task (chain_sum) on a '
                          'pretrained HF fixture model (no SFT)',
                          edit=_set(lm__source='tests/fixtures/hf/llama_tied',
                                    lm__max_prompt_len=104)),
    'resume_grpo_iid': Case('grpo:iid', resume=True,
                            covers='resume after step 1 (equals grpo_iid)'),
    'mesh2_grpo_iid': Case('grpo:iid', devices=2, covers='2-device CPU mesh (fsdp 2)',
                           edit=_set(mesh__fsdp=2)),
}


def build_config(case: Case):
  """The quick config of tests/test_families.py::test_family_quick, 2 RL steps."""
  get_config = importlib.import_module(f'configs.{case.module}').get_config
  args = (case.variant,) if case.variant else ()
  defaults, cfg = get_config(*args), get_config(*args)
  cfg.quick, cfg.progress = True, False
  agent, text = loop.is_agent(cfg), loop.is_text(cfg)
  (agents_config if agent else lm_config if text else tempo_config).shrink(cfg,
                                                                          defaults=defaults)
  cfg.quick = False
  if not (agent or text):
    cfg.task.kwargs = {'num_digits': 1}
    cfg.sft.steps = 400
  cfg.rl.steps, cfg.eval.every, cfg.rl.ckpt_every, cfg.seeds = 2, 1, 1, (0,)
  if case.edit is not None:
    case.edit(cfg)
  return cfg


_SFT = {}  # sft fingerprint -> params, shared by the cases of one process


def warm_start(cfg, root: str):
  """The SFT start (cached in <root>/sft-<fingerprint>, as compare caches it per workdir);
  a text task's: the pretrained params."""
  if loop.is_text(cfg):
    return loop.build_problem(cfg).init_params
  sub = loop.run_config(cfg, 0)
  key = json.dumps({k: sub[k].to_dict() for k in ('task', 'model', 'sft')}, sort_keys=True,
                   default=repr)
  if loop.is_agent(cfg):
    key += json.dumps(cfg.agent.to_dict(), sort_keys=True, default=repr)
  fp = hashlib.sha1(key.encode()).hexdigest()[:12]
  if not optimized():  # another program: another start
    fp += '-no-opt'
  if fp not in _SFT:
    _SFT[fp] = loop.sft(cfg, os.path.join(root, f'sft-{fp}'), progress=False)[0]
  return _SFT[fp]


def tree_hash(tree) -> str:
  """sha256 over the leaves in key-path order: each leaf's path, dtype, shape and bytes."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  for path, leaf in sorted(leaves, key=lambda pl: jax.tree_util.keystr(pl[0])):
    a = np.asarray(jax.device_get(leaf))
    h.update(jax.tree_util.keystr(path).encode())
    h.update(f'{a.dtype}{a.shape}'.encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


def timing_free(row: dict) -> dict:
  """A metric row without its wall-clock fields."""
  drop = lambda k: k in ('wall_s', 'credit_frac') or k.endswith(('_s', '_per_s'))
  return {k: (float(v) if isinstance(v, (float, np.floating)) else v)
          for k, v in row.items() if not drop(k)}


def checkpoint_record(workdir: str) -> dict:
  """Fingerprint and aux-state hash of the run's newest checkpoint."""
  mngr = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, 'checkpoints')))
  step = mngr.latest_step()
  meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  tree = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
  mngr.close()
  aux = {k: v for k, v in tree.items() if k not in TRAIN_KEYS}
  return dict(fingerprint=meta['fingerprint'], aux_sha256=tree_hash(aux) if aux else None,
              aux_keys=sorted(aux))


FLAG = 'jax_disable_most_optimizations'


def optimized() -> bool:
  return not jax.config.values[FLAG]


@contextlib.contextmanager
def optimization(on: bool = True):
  """XLA's default optimizations on inside (the records' programs, as users compile them) or
  off (`on` False: as the suite compiles, tests/conftest.py): programs compiled the other way
  are dropped on a switch, as jit's in-memory cache does not tell them apart."""
  if optimized() == on:
    yield
    return
  jax.clear_caches()
  jax.config.update(FLAG, not on)
  try:
    yield
  finally:
    jax.clear_caches()
    jax.config.update(FLAG, on)


def run_case(name: str, root: str, optimize: bool = True) -> dict:
  """Runs case `name` under `root` (its SFT start shared there), with XLA's optimizations on
  or off; returns its record."""
  with optimization(optimize):
    return _run_case(name, root)


def _run_case(name: str, root: str) -> dict:
  case = CASES[name]
  if case.devices != jax.device_count():
    if os.environ.get('GOLDEN_CHILD'):  # the subprocess did not get its devices: stop here
      raise RuntimeError(f'{name}: {jax.device_count()} devices, not {case.devices}')
    return _run_elsewhere(name, case.devices)
  cfg = build_config(case)
  workdir = os.path.join(root, name)
  cwd = os.getcwd()
  os.chdir(ROOT)  # a fixture model's path (in the fingerprint) is relative to the repo
  try:
    params0 = warm_start(cfg, root)
    if case.resume:
      short = cfg.copy_and_resolve_references()
      short.rl.steps = 1
      loop.train(short, workdir, params0, method=case.method, progress=False)
    summary = loop.train(cfg, workdir, params0, method=case.method, progress=False)
  finally:
    os.chdir(cwd)
  rows = loop.read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  return dict(rows=[timing_free(r) for r in rows], params_sha256=tree_hash(summary['params']),
              **checkpoint_record(workdir))


def _run_elsewhere(name: str, devices: int) -> dict:
  """Case `name` in a subprocess with `devices` host devices (fixed when JAX starts), compiled
  as here (optimizations on or off)."""
  # First: XLA stops reading flags at the suite's bare 'intra_op_parallelism_threads=1'.
  env = dict(os.environ, GOLDEN_CHILD='1', XLA_FLAGS=(
      f'--xla_force_host_platform_device_count={devices} {os.environ.get("XLA_FLAGS", "")}'))
  with tempfile.TemporaryDirectory(prefix='golden-') as tmp:
    out = os.path.join(tmp, 'record.json')
    subprocess.run([sys.executable, os.path.abspath(__file__), '--only', name, '--out', out,
                    *([] if optimized() else ['--no-opt'])],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
      return json.load(f)[name]


def diff(name: str, want: dict, got: dict) -> list[str]:
  """Every field of record `got` that differs from `want`, one line each."""
  out = []
  for key in sorted(set(want) | set(got)):
    if key == 'rows':
      continue
    if want.get(key) != got.get(key):
      out.append(f'{name}.{key}: {want.get(key)!r} -> {got.get(key)!r}')
  a, b = want.get('rows', []), got.get('rows', [])
  if len(a) != len(b):
    out.append(f'{name}.rows: {len(a)} rows -> {len(b)}')
  for i, (ra, rb) in enumerate(zip(a, b)):
    for k in sorted(set(ra) | set(rb)):
      if ra.get(k, '<absent>') != rb.get(k, '<absent>'):
        out.append(f'{name}.rows[{i}].{k}: {ra.get(k, "<absent>")!r} -> '
                   f'{rb.get(k, "<absent>")!r}')
  return out


def machine_id() -> str:
  """What XLA's CPU rounding depends on: the CPU's model and instruction-set flags, and
  jaxlib's version (a short hash)."""
  import platform
  model = flags = ''
  if os.path.exists('/proc/cpuinfo'):
    with open('/proc/cpuinfo') as f:
      for line in f:
        key, _, value = line.partition(':')
        model = model or (value.strip() if key.strip() == 'model name' else '')
        flags = flags or (' '.join(sorted(value.split())) if key.strip() == 'flags' else '')
  blob = f'{platform.machine()}|{model}|{flags}|{jax.__version__}'
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


def records_id() -> str:
  """The machine whose records this one shares: machines/aliases.json maps a machine id to
  another's where the two were checked to give identical records (all cases, one commit)."""
  with open(os.path.join(HERE, 'machines', 'aliases.json')) as f:
    aliases = json.load(f)
  return aliases.get(machine_id(), machine_id())


def machine_path(optimize: bool = True) -> str:
  return os.path.join(HERE, 'machines', records_id() + ('.json' if optimize else '.no-opt.json'))


def load(optimize: bool = True) -> tuple[dict, set]:
  """(records, the names among them that are this machine's own, compiled the same way):
  its own (machines/<machine_id()>[.no-opt].json) where it has them, else the optimized
  records (its own or golden.json's). A machine's file may lack cases that an intended change
  moved on another machine (rerecord them there with --machine --only)."""
  path = machine_path(optimize)
  records = _read(GOLDEN) if optimize else load(True)[0]
  own = _read(path) if os.path.exists(path) else {}
  return {**records, **own}, set(own)


def _read(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def close(name: str, want: dict, got: dict, rtol: float = 1e-3) -> list[str]:
  """The rows of `got` that differ from `want` by more than float rounding of another CPU:
  strings, ints, keys and row counts exactly, floats to `rtol` (hashes are not compared)."""
  out = []
  a, b = want.get('rows', []), got.get('rows', [])
  if len(a) != len(b):
    out.append(f'{name}.rows: {len(a)} rows -> {len(b)}')
  for i, (ra, rb) in enumerate(zip(a, b)):
    for k in sorted(set(ra) | set(rb)):
      x, y = ra.get(k, '<absent>'), rb.get(k, '<absent>')
      floats = isinstance(x, float) and isinstance(y, float)
      if (not np.isclose(x, y, rtol=rtol, atol=rtol * 1e-2)) if floats else x != y:
        out.append(f'{name}.rows[{i}].{k}: {x!r} -> {y!r}')
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--only', default='', help='comma-separated case names (default: all)')
  p.add_argument('--check', action='store_true', help='compare with golden.json, record nothing')
  p.add_argument('--out', default=GOLDEN, help='where to write the records (default golden.json)')
  p.add_argument('--machine', action='store_true',
                 help="record into this machine's own file (machines/<machine_id()>.json)")
  p.add_argument('--no-opt', action='store_true',
                 help="XLA's optimizations off, as the suite compiles (with --machine: into "
                      "machines/<machine_id()>.no-opt.json)")
  p.add_argument('--write-checkpoints', default='', metavar='DIR',
                 help="run step 1 of each single-device case into DIR (with the old code)")
  p.add_argument('--resume-checkpoints', default='', metavar='DIR',
                 help='resume the runs in DIR to the end (with the new code) and compare')
  args = p.parse_args(argv)
  if args.write_checkpoints or args.resume_checkpoints:
    return old_checkpoints(args.write_checkpoints, args.resume_checkpoints, args.only)
  optimize = not args.no_opt
  if args.machine:
    os.makedirs(os.path.dirname(machine_path()), exist_ok=True)
    args.out = machine_path(optimize)
  names = [n for n in args.only.split(',') if n] or list(CASES)
  unknown = [n for n in names if n not in CASES]
  if unknown:
    p.error(f'unknown cases {unknown}; known: {", ".join(CASES)}')
  got, failures = {}, []
  # One compile mode for the whole run (a switch drops the compiled programs).
  with tempfile.TemporaryDirectory(prefix='golden-') as root, optimization(optimize):
    for name in names:
      t0 = time.time()
      try:
        got[name] = run_case(name, root, optimize)
      except Exception:  # noqa: BLE001 (reported; the other cases still run)
        traceback.print_exc()
        failures.append(f'{name}: failed to run')
      print(f'{name}: {time.time() - t0:.1f} s', flush=True)
      if not args.check and name in got:  # kept as it goes (a killed run keeps its cases)
        save(args.out, got)
  if args.check:
    want, own = load(optimize)
    for name in got:
      if name not in want:
        failures.append(f'{name}: not recorded')
      else:
        failures += (diff if name in own else close)(name, want[name], got[name])
    print('\n'.join(failures) or f'{len(names)} cases identical to {machine_path(optimize)} '
          f'(those it has) or close to the optimized records')
    return 1 if failures else 0
  if failures:
    print('\n'.join(failures))
  return 1 if failures else 0


def old_checkpoints(write: str, resume: str, only: str = '') -> int:
  """Checkpoints written by one version of the code, resumed by another: `write` runs step 1
  of each single-device case into that directory (its SFT starts there too); `resume` runs
  the same cases there to the end, resuming from those checkpoints, and compares the records
  (rows, params, loop state, fingerprint) with this machine's. Exit 1 on a difference."""
  names = [n for n in only.split(',') if n] or [
      n for n, c in CASES.items() if c.devices == 1 and not c.resume]
  root = os.path.abspath(write or resume)
  if write:
    os.chdir(ROOT)
    for name in names:
      case = CASES[name]
      cfg = build_config(case)
      short = cfg.copy_and_resolve_references()
      short.rl.steps = 1
      loop.train(short, os.path.join(root, name), warm_start(cfg, root), method=case.method,
                 progress=False)
    print(f'{len(names)} runs at step 1 in {root}')
    return 0
  want, _ = load()
  failures = []
  for name in names:
    failures += diff(name, want[name], run_case(name, root))
  print('\n'.join(failures) or f'{len(names)} cases resumed identically from {root}')
  return 1 if failures else 0


def save(path: str, got: dict):
  """Writes `got` into the records at `path` (those of other cases kept)."""
  old = {}
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  old.update(got)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(old, f, indent=0, sort_keys=True)
    f.write('\n')
  os.replace(tmp, path)


if __name__ == '__main__':
  sys.exit(main())
