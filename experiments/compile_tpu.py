"""Compile check for TPU pods on any host: the whole RL step, AOT-compiled for a topology.

    python -m experiments.compile_tpu --topology v5e:2x2 --model smollm2-135m \\
        --rows 256 --group_size 8 --prompt_len 512 --response_len 512 --fsdp 4 \\
        --micro_batches 8 --dtype bfloat16 --remat

Needs libtpu (`pip install "jax[tpu]>=0.10.2"`), no TPU: `experiments.training.aot`
takes the topology's devices (all hosts') from libtpu and compiles each piece of the
loop's RL step with the loop's functions and shardings (the sampler's prefill, decode
loop and forks, packing, old / reference log-probs, credit, the packed and the flat
update). It prints per device: memory (arguments, temporaries, outputs, and the train
state the loop holds) against HBM, analytic FLOPs, the roofline time at the chip's
vendor peak bf16 FLOP/s and HBM bandwidth, the MFU bound and compile times; when the
step does not fit (a stage XLA cannot fit in HBM, or a peak above 90% of HBM), it
prints "does not fit", the largest arrays and a mesh estimated to fit, and exits with
status 1.

--model: a built-in shape (toy, smollm2-135m, qwen2.5-1.5b, qwen2.5-7b, llama-3.1-8b) or a
Hugging Face config.json (file or directory). The mesh is ('data', 'fsdp', 'model') with
--fsdp and --model_axis (tensor parallelism; default 1), data the remaining devices.
--decode_layout: the sampler's KV cache layout (`sampling.LAYOUTS`; default the sampler's,
'cascade': each prompt once; 'rows': a whole cache per response, as before issue 41).
--sampler_only: compile only the i.i.d. sampler's prefill and decode, for both layouts
(`sampler_report`): per-device decode memory, XLA's bytes accessed by one decode step and
the decode's analytic HBM bytes and roofline, rows against cascade. With --sampler tree_fixed
(--branching, --segment_len): its one program in 'rows', 'cascade' and 'cascade_tree'
(`tree_sampler_report`).
"""

import argparse
import dataclasses
import sys
import time

from experiments.training import aot


def main(argv=None) -> 'aot.Result':
  """Compiles and prints the report; returns the `aot.Result`."""
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--topology', default='v5e:2x2',
                  help='TPU topology, e.g. v5e:2x2, v5e:4x4, v5p:4x4x4, v6e:8x8, v4:2x2x2')
  ap.add_argument('--model', default='toy', help=f'{", ".join(aot.MODELS)} or a config.json')
  ap.add_argument('--rows', type=int, default=16, help='responses per step, N = B * G')
  ap.add_argument('--group_size', type=int, default=4, help='G')
  ap.add_argument('--prompt_len', type=int, default=32)
  ap.add_argument('--response_len', type=int, default=32)
  ap.add_argument('--sampler', default='iid', choices=aot.SAMPLERS)
  ap.add_argument('--num_chains', type=int, default=2, help='tree_entropy only')
  ap.add_argument('--num_forks', type=int, default=1, help='tree_entropy only')
  ap.add_argument('--num_continuations', type=int, default=1, help='tree_entropy only')
  ap.add_argument('--branching', default='2,2', help='tree_fixed only: children per level')
  ap.add_argument('--segment_len', type=int, default=4,
                  help='tree_fixed only: tokens between forks')
  ap.add_argument('--fsdp', type=int, default=1, help="size of the mesh's 'fsdp' axis")
  ap.add_argument('--model_axis', type=int, default=1,
                  help="size of the mesh's 'model' axis (tensor parallelism: heads, kv heads, "
                       "MLP width and vocabulary split; it must divide them); data = devices / "
                       "(fsdp * model_axis)")
  ap.add_argument('--micro_batches', type=int, default=1)
  ap.add_argument('--minibatches', type=int, default=1)
  ap.add_argument('--epochs', type=int, default=1)
  ap.add_argument('--packing', default='tree', choices=('tree', 'prompt', 'none'),
                  help='packed update (the flat one is compiled too unless none)')
  ap.add_argument('--pack_len', type=int, default=0,
                  help='packed slots per group; 0 = P + G * L (nothing shared but the prompt)')
  ap.add_argument('--pack_attention', default='auto', choices=('paths', 'mask', 'blocks', 'auto'),
                  help="packed attention as train.pack_attention ('auto', the loop's default: "
                       "ancestor blocks where cheaper than paths, see aot.packed_layout)")
  ap.add_argument('--no_flat', action='store_true',
                  help='with packing, skip the flat log-probs and update')
  ap.add_argument('--no_ref', action='store_true', help='no reference model (kl_coef 0)')
  ap.add_argument('--ref_sharding', default='policy', choices=('policy', 'replicated'),
                  help="reference params: the policy's sharding (as the loop places them) or "
                       "replicated (to compare)")
  ap.add_argument('--credit', default='grpo', help='credit estimator compiled for the step')
  ap.add_argument('--lora_rank', type=int, default=0)
  ap.add_argument('--dtype', default='bfloat16', choices=('float32', 'bfloat16'),
                  help='compute dtype (params stay float32)')
  ap.add_argument('--remat', action='store_true', help='recompute blocks in the backward pass')
  ap.add_argument('--quiet', action='store_true', help='no per-stage progress lines')
  ap.add_argument('--decode_layout', default=None, choices=('cascade', 'rows', 'cascade_tree'),
                  help="sampler KV cache layout (default: the sampler's, 'cascade'; "
                       "tree_fixed's 'cascade_tree')")
  ap.add_argument('--decode_window', type=int, default=None,
                  help='cascade decode phases of this many own slots (default: the model '
                       "config's, 256; 0 = every own slot each step)")
  ap.add_argument('--sampler_only', action='store_true',
                  help='compile the sampler only, in each layout: i.i.d. prefill and decode '
                       '(rows, cascade in one phase, cascade in phases) or with --sampler '
                       'tree_fixed its one program (rows, cascade, cascade_tree)')
  a = ap.parse_args(argv)

  import jax.numpy as jnp
  t0 = time.perf_counter()
  topo = aot.topology(a.topology)
  cfg, notes = aot.model_config(a.model, max_len=a.prompt_len + a.response_len,
                                dtype=getattr(jnp, a.dtype), remat=a.remat,
                                lora_rank=a.lora_rank)
  if a.decode_window is not None:
    cfg = dataclasses.replace(cfg, decode_window=a.decode_window)
  shape = aot.RLShape(
      rows=a.rows, group_size=a.group_size, prompt_len=a.prompt_len,
      response_len=a.response_len, sampler=a.sampler, num_chains=a.num_chains,
      num_forks=a.num_forks, num_continuations=a.num_continuations,
      branching=tuple(int(x) for x in a.branching.split(',')), segment_len=a.segment_len,
      fsdp=a.fsdp,
      model=a.model_axis,
      micro_batches=a.micro_batches, minibatches=a.minibatches, epochs=a.epochs,
      packing=a.packing, pack_len=a.pack_len, pack_attention=a.pack_attention,
      ref=not a.no_ref, ref_sharding=a.ref_sharding, credit=a.credit,
      compile_flat=not a.no_flat, decode_layout=a.decode_layout)
  for n in notes:
    print('note:', n)
  if a.sampler_only:
    report = tree_sampler_report if a.sampler == 'tree_fixed' else sampler_report
    print(report(cfg, shape, topo))
    print(f'wall time {time.perf_counter() - t0:.1f} s')
    return None
  result = aot.compile_rl_step(cfg, shape, topo, verbose=not a.quiet)
  print(aot.format_report(result))
  print(f'wall time {time.perf_counter() - t0:.1f} s')
  sys.stdout.flush()
  return result


def cli(argv=None) -> int:
  """Exit status: 0 if the step fits in 90% of HBM (or --sampler_only), else 1."""
  result = main(argv)
  return 0 if result is None or aot.step_summary(result)['fits'] else 1


def sampler_report(cfg, shape: 'aot.RLShape', topo) -> str:
  """Compiles `sampling._start` and `sampling._decode` (i.i.d.) on the topology's mesh, as
  `aot.compile_sampler` does: layout 'rows', 'cascade' in one phase (decode_window 0) and
  'cascade' in `cfg.decode_window` phases; one line each (see --sampler_only).

  peak: the decode program's arguments + temporaries + outputs - aliased, plus the optimizer
  state and reference params the loop holds meanwhile. step bytes: XLA's 'bytes accessed'
  of the decode program, which counts each phase's while-loop body (one step) once, divided
  by the phases: the mean step's bytes when the phases are equally long. decode HBM B:
  `aot.decode_hbm_bytes`, the analytic lower bound; roofline: it over the HBM bandwidth.
  """
  import jax
  import numpy as np
  from experiments.rollouts import sampling
  mesh, held, params, param_bytes, prompts, plen, u, knobs = _sampler_inputs(cfg, shape, topo)
  b, l, g = shape.num_prompts, shape.response_len, shape.group_size
  gib = 2.0 ** 30
  lines = [f'i.i.d. sampler on {topo.name}, mesh {dict(mesh.shape)}: {b} prompts x G {g}, '
           f'prompt {shape.prompt_len} + response {l}, {np.dtype(cfg.dtype).name}; per device:',
           f'  {"layout":8s} {"phases":>6s} {"cache GiB":>9s} {"args":>6s} {"temp":>6s} '
           f'{"out":>6s} {"peak GiB":>8s} {"step bytes":>10s} {"decode HBM B":>12s} '
           f'{"roofline s":>10s} {"compile s":>9s}']
  one = dataclasses.replace(cfg, decode_window=0)
  for layout, c in (('rows', cfg), ('cascade', one), ('cascade', cfg)):
    if c is cfg and layout == 'cascade' and len(sampling.decode_windows(cfg, l)) == 1:
      continue  # already the one-phase line
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      start = sampling._start.lower(params, prompts, u, plen, cfg=c, pad_id=0,
                                    layout=layout).compile()
      st = aot.plain(start.out_info)
      dec = sampling._decode.lower(params, st, l, knobs, cfg=c, eos_id=shape.eos_id).compile()
    mem = dec.memory_analysis()
    cost = dec.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    phases = len(sampling.decode_windows(c, l, layout == 'cascade'))
    hbm = aot.decode_hbm_bytes(c, shape, mesh, param_bytes, layout)
    lines.append(f'  {layout:8s} {phases:6d} {aot.chip_bytes(st.cache) / gib:9.3f} '
                 f'{_memory_cells(mem, held)} {cost.get("bytes accessed", float("nan")) / phases:10.3e} {hbm:12.3e} '
                 f'{hbm / topo.device_bandwidth:10.3f} {time.perf_counter() - t0:9.1f}')
  return '\n'.join(lines)


def _memory_cells(mem, held: int) -> str:
  """The reports' 'args temp out peak GiB' cells from XLA's memory analysis of a compiled
  program; peak: arguments + temporaries + outputs - aliased, plus the bytes the loop holds
  meanwhile."""
  gib = 2.0 ** 30
  peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
          - mem.alias_size_in_bytes + held)
  return (f'{mem.argument_size_in_bytes / gib:6.2f} {mem.temp_size_in_bytes / gib:6.2f} '
          f'{mem.output_size_in_bytes / gib:6.2f} {peak / gib:8.2f}')


def _sampler_inputs(cfg, shape, topo):
  """The sampler reports' mesh and abstract inputs: (mesh, bytes per device the loop holds
  while sampling (optimizer state and reference params, as `aot.Compiler`'s outside bytes),
  the policy's params, their bytes in all, prompts, prompt lengths, uniforms [B, G, L], the
  sampling knobs)."""
  import jax
  import jax.numpy as jnp
  mesh = aot.make_mesh(topo, shape.fsdp, shape.model)
  state = aot.abstract_state(cfg, mesh)
  held = aot.chip_bytes((state.opt_state, state.step, state.rng)) + (
      aot.chip_bytes(state.params) if shape.ref else 0)
  b = shape.num_prompts
  rep = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  prompts = jax.ShapeDtypeStruct((b, shape.prompt_len), jnp.int32,
                                 sharding=aot.rows_sharding(mesh, b))
  plen = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=aot.rows_sharding(mesh, b))
  u = rep((b, shape.group_size, shape.response_len), jnp.float32)
  knobs = dict(temperature=rep((), jnp.float32), top_k=rep((), jnp.int32),
               top_p=rep((), jnp.float32))
  return mesh, held, state.params, aot.full_bytes(state.params), prompts, plen, u, knobs


def tree_sampler_report(cfg, shape: 'aot.RLShape', topo) -> str:
  """Compiles `sampling._tree_fixed` (tree_fixed's one program, as `aot.compile_sampler`) in
  each layout on the topology's mesh, one line each: per-device memory from the compiled
  program (peak as in `sampler_report`) and the decode's analytic HBM bytes
  (`aot.decode_hbm_bytes`, with `aot.tree_slots_read`) and roofline.
  """
  import jax
  import numpy as np
  from experiments.rollouts import sampling
  mesh, held, params, param_bytes, prompts, plen, u, knobs = _sampler_inputs(cfg, shape, topo)
  b, l, g = shape.num_prompts, shape.response_len, shape.group_size
  lines = [f'tree_fixed sampler on {topo.name}, mesh {dict(mesh.shape)}: {b} prompts x '
           f'branching {shape.branching} (G {g}), forks every {shape.segment_len} tokens, '
           f'prompt {shape.prompt_len} + response {l}, decode_window {cfg.decode_window}, '
           f'{np.dtype(cfg.dtype).name}; per device:',
           f'  {"layout":12s} {"args":>6s} {"temp":>6s} {"out":>6s} {"peak GiB":>8s} '
           f'{"KV slots read":>13s} {"decode HBM B":>12s} {"roofline s":>10s} {"compile s":>9s}']
  for layout in ('rows', 'cascade', 'cascade_tree'):
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      exe = sampling._tree_fixed.lower(
          params, prompts, u, plen, knobs, cfg=cfg,
          branching=tuple(shape.branching), segment_len=shape.segment_len,
          eos_id=shape.eos_id, pad_id=0, layout=layout).compile()
    mem = exe.memory_analysis()
    hbm = aot.decode_hbm_bytes(cfg, shape, mesh, param_bytes, layout)
    lines.append(f'  {layout:12s} {_memory_cells(mem, held)} {aot.tree_slots_read(cfg, shape, layout):13.4e} '
                 f'{hbm:12.3e} {hbm / topo.device_bandwidth:10.3f} '
                 f'{time.perf_counter() - t0:9.1f}')
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(cli())
