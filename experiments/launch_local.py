"""Runs a multi-process JAX job on this machine: N processes, coordinator on 127.0.0.1.

    python -m experiments.launch_local --num_processes 2 [--devices_per_process 2] \
        -- experiments.tempo --config.quick=True --workdir=/tmp/treecredit/mh

Everything after `--` is a module (`python -m`) or a script path (`*.py`) and its
arguments. Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>,
JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=i (read by
`experiments.training.train_step.maybe_initialize_distributed`), JAX_PLATFORMS=cpu unless
--platform says otherwise, and with --devices_per_process D the flag
--xla_force_host_platform_device_count=D, so the job has N * D CPU devices in all.
Output lines are prefixed with [p<i>]. If a process fails (or --timeout passes) the
others are killed and the launcher exits with the failing process's status.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def process_env(base: dict, port: int, num_processes: int, process_id: int,
                devices_per_process: int = 0, platform: str = 'cpu') -> dict:
  """The environment of process `process_id` of a localhost job."""
  env = dict(base, JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
             JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(process_id))
  if platform:
    env['JAX_PLATFORMS'] = platform
  if devices_per_process:
    flags = [f for f in env.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    # First: XLA stops parsing XLA_FLAGS at a token that is not a flag.
    env['XLA_FLAGS'] = ' '.join([f'--xla_force_host_platform_device_count={devices_per_process}']
                                + flags)
  return env


def command(target: list[str]) -> list[str]:
  """[module or script.py, args...] -> the python command line."""
  if not target:
    raise SystemExit('launch_local: nothing to run; usage: ... -- <module or script.py> [args]')
  head, rest = target[0], target[1:]
  if head.endswith('.py'):
    return [sys.executable, head] + rest
  return [sys.executable, '-m', head] + rest


def _pump(stream, prefix: str, out):
  for line in iter(stream.readline, ''):
    out.write(prefix + line)
    out.flush()
  stream.close()


def launch(target: list[str], num_processes: int, devices_per_process: int = 0,
           platform: str = 'cpu', timeout: float = 0, cwd=None, env=None) -> int:
  """Starts the processes and waits; returns 0, or the status of the first one to fail."""
  port = free_port()
  cmd = command(target)
  base = dict(os.environ if env is None else env)
  procs, pumps = [], []
  for i in range(num_processes):
    p = subprocess.Popen(cmd, cwd=cwd, env=process_env(base, port, num_processes, i,
                                                      devices_per_process, platform),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    t = threading.Thread(target=_pump, args=(p.stdout, f'[p{i}] ', sys.stdout), daemon=True)
    t.start()
    procs.append(p)
    pumps.append(t)
  deadline = time.time() + timeout if timeout else None
  status, failed = 0, None
  while True:
    codes = [p.poll() for p in procs]
    bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if bad:
      failed, status = bad[0]
      break
    if all(c == 0 for c in codes):
      break
    if deadline is not None and time.time() > deadline:
      failed, status = next(i for i, c in enumerate(codes) if c is None), 124
      break
    time.sleep(0.1)
  for p in procs:  # a failed peer leaves the others blocked in collectives
    if p.poll() is None:
      p.kill()
  for p in procs:
    p.wait()
  for t in pumps:
    t.join(timeout=5)
  if failed is not None:
    why = 'timed out' if status == 124 else f'exited with status {status}'
    print(f'launch_local: process {failed} of {num_processes} {why}: {" ".join(cmd)}',
          file=sys.stderr, flush=True)
  return status


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if '--' not in argv:
    raise SystemExit('launch_local: usage: python -m experiments.launch_local '
                     '--num_processes N [--devices_per_process D] -- <module or script.py> [args]')
  split = argv.index('--')
  parser = argparse.ArgumentParser(prog='python -m experiments.launch_local')
  parser.add_argument('--num_processes', type=int, default=2)
  parser.add_argument('--devices_per_process', type=int, default=0,
                      help='simulated CPU devices per process (0: leave XLA_FLAGS alone)')
  parser.add_argument('--platform', default='cpu', help="JAX_PLATFORMS ('' to leave it unset)")
  parser.add_argument('--timeout', type=float, default=0, help='seconds; 0 = none')
  args = parser.parse_args(argv[:split])
  sys.exit(launch(argv[split + 1:], args.num_processes, args.devices_per_process, args.platform,
                  args.timeout))


if __name__ == '__main__':
  main()
