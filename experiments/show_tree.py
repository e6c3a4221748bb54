"""Credit-assigns a built-in example group and prints its tree.

    python -m experiments.show_tree [--credit tempo]

Eight answers to "12+35=" (tokens are characters), four of them right: the
tree shows where they branch, n(v) and V(v) at each node, the TD step of each
edge, and each response's reward and mean advantage, then the per-token
advantages of the chosen estimator next to GRPO's.
"""

import argparse

import numpy as np

import credit
import trees

EXAMPLE = ["47", "47", "46", "57", "47", "45", "37", "4"]  # completions of "12+35="


def example_group(answers=EXAMPLE, answer="47", eos="$"):
  vocab = sorted(set("".join(answers)) | {eos})
  texts = [a + eos for a in answers]
  length = max(map(len, texts))
  tokens = np.zeros((len(texts), length), np.int32)
  mask = np.zeros((len(texts), length), bool)
  for g, text in enumerate(texts):
    tokens[g, :len(text)] = [vocab.index(c) for c in text]
    mask[g, :len(text)] = True
  rewards = np.array([a == answer for a in answers], np.float32)
  return tokens, mask, rewards, lambda ids: "".join(vocab[i] for i in ids)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--credit", default="tempo", choices=credit.names())
  args = parser.parse_args(argv)
  tokens, mask, rewards, detok = example_group()
  rollouts = credit.validate(credit.Rollouts(tokens=tokens, mask=mask, rewards=rewards))
  tree = trees.build(tokens, mask)
  adv = np.asarray(credit.get(args.credit)(rollouts))
  grpo = np.asarray(credit.get("grpo")(rollouts))
  print('Group: 8 answers to "12+35=" ($ = end of answer), reward 1 for "47".\n')
  print(trees.render_text(tree, rewards, advantages=adv, detokenize=detok))
  print(f"\n* marks a branch point. Per-token advantages ({args.credit} | grpo):")
  for g in range(len(tokens)):
    n = int(mask[g].sum())
    cells = "  ".join(f"{detok([tokens[g, t]])}:{adv[g, t]:+.2f}" for t in range(n))
    print(f"  {g} {detok(tokens[g, :n]):>4}  R={rewards[g]:.0f}  {cells:<40} | {grpo[g, 0]:+.2f}")


if __name__ == "__main__":
  main()
