"""Benchmark: the jitted `tempo` estimator (tree build included) against a plain-Python dict trie.

    python -m experiments.bench_credit [--shapes 64x16x1024,16x64x1024,8x16x8192] [--repeats 10]
        [--estimators spo_tree,treerl,...]

For each (B, G, L) it makes synthetic groups that share prefixes, checks that
both compute the same advantages, and prints the median time after
compilation, tokens per second, compile time, peak memory of the compiled
program and the speed-up over the trie measured in the same run. Then it times
the other `--estimators` (default: the tree estimators) on the same groups,
relative to `tempo` in the same run.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import credit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
import reference_trie  # noqa: E402  (the plain-Python reference lives beside the tests)


def synthetic_groups(rng, b, g, l, vocab=16):
  """Groups whose responses copy a random-length prefix of an earlier one, ragged lengths."""
  tokens = rng.integers(0, vocab, (b, g, l)).astype(np.int32)
  for i in range(1, g):
    src = rng.integers(0, i, b)
    cut = (rng.random(b) ** 0.5 * l).astype(int)  # long shared prefixes are common
    keep = np.arange(l)[None] < cut[:, None]
    tokens[:, i] = np.where(keep, tokens[np.arange(b), src], tokens[:, i])
  lengths = rng.integers(l // 2, l + 1, (b, g))
  mask = np.arange(l)[None, None] < lengths[..., None]
  rewards = (rng.random((b, g)) < 0.5).astype(np.float32)
  return tokens, mask, rewards


def trie_advantages(tokens, mask, rewards):
  out = np.zeros(tokens.shape, np.float32)
  for b in range(tokens.shape[0]):
    rows = reference_trie.tempo_advantages(reference_trie.unpad(tokens[b], mask[b]),
                                           [float(r) for r in rewards[b]])
    for i, row in enumerate(rows):
      out[b, i, :len(row)] = row
  return out


def median_time(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="64x16x1024,16x64x1024,8x16x8192")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--trie-repeats", type=int, default=1)
  parser.add_argument("--estimators", default="spo_tree,sibling_grpo,treerl,treepo,"
                                              "tree_grpo,mars2_shaping,grpo")
  args = parser.parse_args(argv)

  estimator = credit.get("tempo")

  @jax.jit
  def tempo(tokens, mask, rewards):
    return estimator(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards))

  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cpus")
  print(f"{'B x G x L':>14} {'jax ms':>9} {'trie ms':>9} {'speed-up':>9} {'Mtok/s':>8} "
        f"{'compile s':>9} {'peak MiB':>9} {'max |diff|':>10}")
  rng = np.random.default_rng(0)
  timings = []
  for shape in args.shapes.split(","):
    b, g, l = map(int, shape.split("x"))
    tokens, mask, rewards = synthetic_groups(rng, b, g, l)
    args_dev = tuple(map(jnp.asarray, (tokens, mask, rewards)))
    start = time.perf_counter()
    compiled = tempo.lower(*args_dev).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    peak = (memory.temp_size_in_bytes + memory.argument_size_in_bytes
            + memory.output_size_in_bytes) / 2**20 if memory is not None else float("nan")
    jax_s = median_time(lambda: compiled(*args_dev), args.repeats)
    trie_s = median_time(lambda: trie_advantages(tokens, mask, rewards), args.trie_repeats)
    diff = float(np.max(np.abs(np.asarray(compiled(*args_dev)) - trie_advantages(
        tokens, mask, rewards))))
    if diff > 1e-3:
      raise SystemExit(f"{shape}: jax and the trie disagree (max |diff| = {diff}).")
    n_tokens = int(mask.sum())
    print(f"{shape:>14} {1e3 * jax_s:9.2f} {1e3 * trie_s:9.0f} {trie_s / jax_s:8.0f}x "
          f"{n_tokens / jax_s / 1e6:8.1f} {compile_s:9.2f} {peak:9.1f} {diff:10.2e}")
    timings.append((shape, args_dev, jax_s))
  names = [n for n in args.estimators.split(",") if n]
  if names:
    print("\nother estimators, jitted, tree build included (ms; x = time / tempo's, same run)")
    print(f"{'B x G x L':>14} " + " ".join(f"{n:>14}" for n in names))
  for shape, args_dev, tempo_s in timings:
    cells = []
    for name in names:
      fn = jax.jit(lambda t, m, r, est=credit.get(name): est(
          credit.Rollouts(tokens=t, mask=m, rewards=r)))
      jax.block_until_ready(fn(*args_dev))  # compiles
      seconds = median_time(lambda: fn(*args_dev), args.repeats)
      cells.append(f"{1e3 * seconds:7.1f} {seconds / tempo_s:5.1f}x")
    print(f"{shape:>14} " + " ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
  main()
