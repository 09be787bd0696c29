"""Acceptance of every drafter on stories260K, chain and tree, trained and training-free,
as one Markdown table.

  python scripts/drafter_table.py                    # gamma 3, trees of depth 3, greedy
  python scripts/drafter_table.py --gamma 4 --tree 4,3,16 --temperature 0.8

Same prompts (by default those of the test suite's `story_prompts`), gamma (chains), tree
budget (trees: depth, top-k, nodes) and settings for every row; the draft-model rows (the
target itself, a noisy copy, a random small model) are references. The trained drafters
(Medusa heads, EAGLE, MTP modules; as many heads/modules as gamma) are distilled from
stories260K's own sampled generations with spec_jax.training.distill, exported to --trained-dir and
reused from there on later runs. Each row also checks that greedy output equals
autoregressive output. "draft cost" (chains) is one propose of gamma drafts over one
one-token target step, both timed at the table's batch (spec_jax.adaptive.measure_costs:
the fastest of 25 after compiling): what drafting a round costs in target steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]

from spec_jax.testing import (  # noqa: E402
    REFERENCE_DIR, REFERENCE_STEM, STORIES_DIR, perturbed, tiny_llama)
from spec_jax.models.llama2c import load_llama2c  # noqa: E402
from spec_jax.training import distill  # noqa: E402
from spec_jax import (SamplingConfig, TreeOptions, generate, make_drafter, pad_prompts,  # noqa: E402
                      prepare_program, speculate, summarize)
from spec_jax.adaptive import AdaptiveConfig, measure_costs  # noqa: E402
from spec_jax.drafters.registry import families  # noqa: E402


def prompts(kind: str) -> list[list[int]]:
  ref = [int(t) for t in (REFERENCE_DIR / f"{REFERENCE_STEM}.tokens.txt").read_text().split()]
  if kind == "repetitive":  # tests/test_drafters.py's: a passage the model repeats, twice
    return [[1] + ref[131:160] * 2]
  return [ref[:5], [1, 403, 407], ref[:11], [1, 300, 263, 400, 271],
          [1, 413, 409, 416, 327, 263, 415, 294]]


# every registered family that only exists trained (draft models also run untrained here)
TRAINED = tuple(name for name, fam in families().items() if fam.trained and fam.build is None)


def trained_drafters(model, params, args) -> dict[str, str]:
  """kind -> exported folder, training (and exporting) the kinds not there yet."""
  folders = {}
  corpus = None
  for kind in TRAINED:
    folder = Path(args.trained_dir) / f"{kind}-{args.gamma}"
    if not (folder / distill.DRAFTER_WEIGHTS).is_file():
      if corpus is None:
        print(f"sampling a corpus of {args.train_sequences} sequences from stories260K ...",
              file=sys.stderr, flush=True)
        corpus = distill.generated_corpus(model, params, num_sequences=args.train_sequences,
                                          seq_len=64, heldout=8, seed=0, temperature=0.6)
      spec = distill.make_spec(kind, model, num_heads=args.gamma)
      trainer = distill.Trainer(spec, model, params, corpus, args.train_steps, batch_size=16,
                                learning_rate=1e-2, warmup_steps=20)
      own, _ = trainer.run(progress=False)
      distill.export_drafter(folder, spec, own)
      print(f"trained {kind} ({args.train_steps} steps) -> {folder}", file=sys.stderr, flush=True)
    folders[kind] = str(folder)
  return folders


def drafters(model, params, args):
  """(row label, kind, options) for make_drafter."""
  small = tiny_llama(vocab_size=model.vocab_size, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                     hidden_dim=32, max_seq_len=512, seed=5)
  noisy = (model, perturbed(params, 0.15, seed=1))
  rows = [("draft model: the target itself", "draft_model", dict(draft=(model, params))),
          ("draft model: target + noise 0.15", "draft_model", dict(draft=noisy)),
          ("draft model: random 1-layer", "draft_model", dict(draft=small)),
          ("prompt lookup (n 3..1)", "prompt_lookup", {})]
  rows += [(f"layer skip k={k}/{model.config.n_layers}", "layer_skip", dict(num_layers=k))
           for k in range(1, model.config.n_layers)]
  rows += [("quantized int8 target", "quantized", {}),
           ("lookup (n 3..2) + layer skip k=4", "lookup+layer_skip", dict(num_layers=4)),
           ("lookup (n 3..2) + int8 target", "lookup+quantized", {}),
           ("lookup (n 3..2) + noisy target", "lookup+draft_model", dict(draft=noisy))]
  folders = trained_drafters(model, params, args)
  heads = f"{args.gamma} heads"
  rows += [(f"{kind} ({heads} / modules where it has them)", kind,
            dict(checkpoint=folders[kind])) for kind in TRAINED]
  tree = TreeOptions.parse(args.tree)
  label = f"tree {args.tree}"
  rows += [(f"{label}: draft model = target + noise 0.15", "draft_model",
            dict(draft=noisy, tree=tree))]
  rows += [(f"{label}: {kind}", kind, dict(checkpoint=folders[kind], tree=tree))
           for kind in TRAINED if families()[kind].tree]
  return rows


def draft_cost_in_steps(model, params, drafter, draft_params, batch, gamma: int) -> float:
  """One propose of `gamma` drafts over one one-token target step, at this batch."""
  config = AdaptiveConfig(gamma_max=gamma, widths=(1, gamma + 1))
  program, args = prepare_program(model, drafter, *batch, gamma=config, max_new_tokens=8)
  target_costs, draft_cost, _ = measure_costs(program, params, draft_params, args, repeats=25)
  return draft_cost / target_costs[0]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gamma", type=int, default=3, help="chain draft length (and trained heads)")
  p.add_argument("--tree", default="3,3,10", help="tree rows' depth,top_k,nodes (depth <= gamma)")
  p.add_argument("--trained-dir", default=str(REPO / "runs" / "drafters" / "stories260K"),
                 help="where the trained drafters are exported / found")
  p.add_argument("--train-steps", type=int, default=600)
  p.add_argument("--train-sequences", type=int, default=256)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--prompts", choices=("stories", "repetitive"), default="stories",
                 help="the test suite's story_prompts, or one repetitive prompt")
  args = p.parse_args(argv)
  model, params = load_llama2c(str(STORIES_DIR / "stories260K.bin"))
  batch = pad_prompts(prompts(args.prompts))
  sampling = SamplingConfig(args.temperature)
  common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling,
                key=jax.random.key(args.seed))  # no EOS: every row generates them all
  reference = generate(model, params, *batch, **common)
  rows = drafters(model, params, args)
  print(f"stories260K, {args.prompts} prompts ({len(batch[1])}), chains gamma {args.gamma}, trees "
        f"{args.tree} (depth,top-k,nodes), temperature {args.temperature}, "
        f"{args.max_new_tokens} new tokens\n")
  print("| drafter | mean accepted | with bonus | acceptance rate | draft cost (target steps) "
        "| same as autoregressive |")
  print("|---|---|---|---|---|---|")
  for label, kind, opts in rows:
    draft_model, draft_params = opts.pop("draft", (None, None))
    drafter, dparams = make_drafter(kind, model, params, draft_model=draft_model,
                                    draft_params=draft_params, **opts)
    out = speculate(model, params, drafter, dparams, *batch,
                    gamma=None if drafter.is_tree else args.gamma, **common)
    m = summarize(out.metrics)
    same = (np.array_equal(out.tokens, reference.tokens) if sampling.is_greedy else "n/a")
    cost = ("-" if drafter.is_tree else
            f"{draft_cost_in_steps(model, params, drafter, dparams, batch, args.gamma):.2f}")
    print(f"| {label} | {m['mean_accepted']:.2f} | {m['mean_accepted_with_bonus']:.2f} | "
          f"{m['acceptance_rate']:.1%} | {cost} | {same} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
