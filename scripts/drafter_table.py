"""Acceptance of every training-free drafter on stories260K, as a Markdown table.

  python scripts/drafter_table.py                    # gamma 4, greedy, 64 new tokens
  python scripts/drafter_table.py --gamma 6 --temperature 0.8

Same prompts (by default those of the test suite's `story_prompts`), gamma and settings for
every row; the draft-model rows (the target itself, a noisy copy, a random small model) are
references. Each row also checks that greedy output equals autoregressive output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test suite's noisy and small models

from conftest import REFERENCE_DIR, REFERENCE_STEM, STORIES_DIR, perturbed, tiny_llama  # noqa: E402
from models.llama2c import load_llama2c  # noqa: E402
from spec_jax.drafters import make_drafter  # noqa: E402
from spec_jax.generate import generate, pad_prompts  # noqa: E402
from spec_jax.metrics import summarize  # noqa: E402
from spec_jax.sampling import SamplingConfig  # noqa: E402
from spec_jax.speculative import speculative_generate  # noqa: E402


def prompts(kind: str) -> list[list[int]]:
  ref = [int(t) for t in (REFERENCE_DIR / f"{REFERENCE_STEM}.tokens.txt").read_text().split()]
  if kind == "repetitive":  # tests/test_drafters.py's: a passage the model repeats, twice
    return [[1] + ref[131:160] * 2]
  return [ref[:5], [1, 403, 407], ref[:11], [1, 300, 263, 400, 271],
          [1, 413, 409, 416, 327, 263, 415, 294]]


def drafters(model, params):
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
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gamma", type=int, default=4)
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
  print(f"stories260K, {args.prompts} prompts ({len(batch[1])}), gamma {args.gamma}, temperature "
        f"{args.temperature}, {args.max_new_tokens} new tokens\n")
  print("| drafter | mean accepted | with bonus | acceptance rate | same as autoregressive |")
  print("|---|---|---|---|---|")
  for label, kind, opts in drafters(model, params):
    draft_model, draft_params = opts.pop("draft", (None, None))
    drafter, dparams = make_drafter(kind, model, params, draft_model=draft_model,
                                    draft_params=draft_params, **opts)
    out = speculative_generate(model, params, drafter, dparams, *batch, gamma=args.gamma,
                               **common)
    m = summarize(out.metrics)
    same = (np.array_equal(out.tokens, reference.tokens) if sampling.is_greedy else "n/a")
    print(f"| {label} | {m['mean_accepted']:.2f} | {m['mean_accepted_with_bonus']:.2f} | "
          f"{m['acceptance_rate']:.1%} | {same} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
