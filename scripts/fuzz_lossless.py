"""Randomised greedy-identity check: speculative output against autoregressive output, on
stories260K, over drafters, gamma (fixed and "auto"), rules, cost tables and ragged batches
drawn at random.

  python scripts/fuzz_lossless.py --cases 50 --seed 1
  python scripts/fuzz_lossless.py --seed 1 --only 17          # rerun case 17 of seed 1
  python scripts/fuzz_lossless.py --trained-dir runs/drafters/stories260K   # + trained families

Each case draws a drafter kind (every registered one; a tree for some), a batch of 1-4
prompts of different lengths (pieces of the reference story, or short token loops that
prompt lookup can copy), budgets per row, an EOS id or none, and either a fixed gamma or an
`AdaptiveConfig` with random rules (confidence, survival, schedule, prior, probe spacing,
hindsight, the prompt look, the look-ahead, give-up) and a random supplied cost table, so the plan takes
every kind of round. Greedy speculative output must equal `generate`'s token for token, and
`gamma="auto"`'s rounds per width must add up to its rounds. Trained families (Medusa,
EAGLE, MTP, DFlash, DSpark) join only with --trained-dir (folders `<kind>-<heads>` written
by scripts/drafter_table.py or scripts/train_drafter.py --export-dir); without it they are
left out, and the run says so.

A mismatch prints the case (and how to rerun it) and the target's top-2 logit margin at the
first differing token: a margin near 0 is a tie that float32 breaks differently in a
one-token step and a multi-token pass, not a lost token. The exit status is 1 if any case
mismatched or raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spec_jax import generate, make_drafter, pad_prompts, speculate, summarize  # noqa: E402
from spec_jax.adaptive import AdaptiveConfig, AdaptiveRules  # noqa: E402
from spec_jax.drafters.registry import (  # noqa: E402
    TreeOptions, families, kinds, model_family, tree_kinds)
from spec_jax.testing import REFERENCE_DIR, REFERENCE_STEM, STORIES_DIR, perturbed  # noqa: E402

NEW_TOKENS = (5, 17, 33, 48)
PROMPT_WIDTH = 24
# widths for each gamma_max: 1 (a plain step) up to gamma_max + 1
WIDTHS = {1: (1, 2), 2: (1, 2, 3), 3: (1, 2, 4), 4: (1, 2, 3, 5), 8: (1, 2, 3, 5, 9)}
TRAINED = tuple(name for name, fam in families().items() if fam.trained and fam.build is None)


def trained_family(kind: str) -> str | None:
  """The trained family a kind loads from --trained-dir ("lookup+eagle": eagle), or None."""
  name = model_family(kind).name
  return name if name in TRAINED else None


@dataclasses.dataclass
class Case:
  kind: str
  tree: TreeOptions | None
  prompts: list[list[int]]
  budgets: list[int]
  max_new_tokens: int
  eos_id: int | None
  gamma: object  # int, or an AdaptiveConfig
  draft_noise: float  # a draft model's params: the target's, perturbed by this much
  num_layers: int  # layer skip
  max_ngram: int  # prompt lookup


def draw_case(rng: random.Random, story: list[int], usable: list[str]) -> Case:
  kind = rng.choice(usable)
  tree = None
  if kind in tree_kinds() and rng.random() < 0.3:
    tree = TreeOptions(depth=rng.choice([2, 3]), top_k=rng.choice([2, 3]),
                       nodes=rng.choice([6, 10]))
  prompts = []
  for _ in range(rng.randint(1, 4)):
    length = rng.randint(2, 20)
    if rng.random() < 0.5:  # a piece of the story (the model continues it fluently)
      start = rng.randint(0, len(story) - length)
      prompts.append([1] + story[start:start + length - 1])
    else:  # a short loop: prompt lookup finds matches, the model may break them
      loop = [rng.randint(2, 511) for _ in range(rng.randint(1, 4))]
      prompts.append(([1] + loop * 20)[:length])
  new = rng.choice(NEW_TOKENS)
  budgets = [rng.randint(1, new) if rng.random() < 0.4 else new for _ in prompts]
  return Case(kind, tree, prompts, budgets, new, rng.choice([None, 1, 13]), None,
              rng.choice([0.05, 0.15, 0.5]), rng.choice([1, 3]), rng.choice([1, 2, 3]))


def draw_gamma(rng: random.Random, max_gamma: int, tree: bool):
  """A fixed gamma (a quarter of cases; a tree's is its depth: None), else an AdaptiveConfig
  with random rules; chains get a random supplied cost table (increasing in width), trees
  measure theirs."""
  gamma_max = min(rng.choice([4, 8]), max_gamma)
  if rng.random() < 0.25:
    return None if tree else rng.randint(1, gamma_max)
  rules = AdaptiveRules(
      confidence=rng.choice([0.0, 0.05, 0.3]), survival=rng.choice([0.0, 0.1, 0.5]),
      schedule=rng.random() < 0.3, initial_gamma=rng.randint(1, 4),
      prior=rng.choice([0.3, 0.7, 0.95]), probe_every=rng.choice([2, 8]),
      hindsight=rng.random() < 0.7, prompt_look=rng.random() < 0.7,
      lookahead=rng.random() < 0.7, give_up=rng.choice([0.99, 0.5]))
  if tree:
    return AdaptiveConfig(gamma_max, rules=rules)
  widths = WIDTHS.get(gamma_max, tuple(range(1, gamma_max + 2)))
  costs = tuple(sorted(rng.uniform(0.5, 4.0) for _ in widths))
  return AdaptiveConfig(gamma_max, widths=widths, target_costs=costs,
                        draft_cost=rng.choice([0.0, 0.05, 0.3]),
                        max_stretch=rng.choice([None, None, 3]), rules=rules)


def top2_margin(model, params, sequence: list[int]) -> float:
  """The target's top-1 minus top-2 logit for the token after `sequence` (one full pass)."""
  seq = np.asarray([sequence], np.int32)
  pos = np.arange(seq.shape[1], dtype=np.int32)[None]
  logits, _, _ = model.apply(params, seq, pos, model.init_cache(*seq.shape))
  top = np.sort(np.asarray(logits[0, -1], np.float64))[-2:]
  return float(top[1] - top[0])


def run_case(model, params, case: Case, rng: random.Random, trained_dir: Path | None):
  """-> (ok, message)."""
  checkpoint = None
  family = trained_family(case.kind)
  if family:
    checkpoint = str(next(iter(sorted(trained_dir.glob(f"{family}-*")))))
    if case.tree is not None:  # a trained tree is as deep as the drafter's heads at most
      heads = make_drafter(case.kind, model, params, checkpoint=checkpoint)[0].max_gamma
      if heads is not None:  # (None: no limit, as EAGLE's)
        case.tree = dataclasses.replace(case.tree, depth=min(case.tree.depth, heads))
  drafter, draft_params = make_drafter(
      case.kind, model, params, draft_model=model,
      draft_params=perturbed(params, case.draft_noise, seed=rng.randint(0, 999)),
      num_layers=case.num_layers, max_ngram=case.max_ngram, checkpoint=checkpoint,
      tree=case.tree)
  case.gamma = draw_gamma(rng, drafter.max_gamma or 8, case.tree is not None)
  tokens_BP, lengths_B = pad_prompts(case.prompts, width=PROMPT_WIDTH)
  kw = dict(max_new_tokens=case.max_new_tokens, budgets_B=case.budgets, eos_id=case.eos_id)
  want = generate(model, params, tokens_BP, lengths_B, **kw)
  out = speculate(model, params, drafter, draft_params, tokens_BP, lengths_B,
                  gamma=case.gamma, **kw)
  m = summarize(out.metrics)
  got_BT, want_BT = np.asarray(out.tokens), np.asarray(want.tokens)
  if not np.array_equal(out.num_tokens, want.num_tokens) and np.array_equal(got_BT, want_BT):
    return False, (f"num_tokens {np.asarray(out.num_tokens).tolist()} against "
                   f"{np.asarray(want.num_tokens).tolist()} (the tokens agree)")
  if not np.array_equal(got_BT, want_BT):
    row = int(np.argmax(np.any(got_BT != want_BT, axis=1)))
    col = int(np.argmax(got_BT[row] != want_BT[row]))
    margin = top2_margin(model, params, case.prompts[row] + want_BT[row, :col].tolist())
    return False, (f"row {row} differs at generated token {col}: {got_BT[row, col]} against "
                   f"{want_BT[row, col]} (target top-2 margin there {margin:.3g}); "
                   f"num_tokens {np.asarray(out.num_tokens).tolist()} against "
                   f"{np.asarray(want.num_tokens).tolist()}")
  if isinstance(case.gamma, AdaptiveConfig):
    widths = sum(m["adaptive"]["width_rounds"].values())
    if widths != m["rounds"]:
      return False, f"rounds per width add up to {widths}, not the {m['rounds']} rounds"
    reached = int(np.asarray(out.metrics.position_reached_G)[0])
    if reached != sum(m["adaptive"]["admitted_hist"][1:]):
      return False, (f"first drafts reached {reached} times, verified in "
                     f"{sum(m['adaptive']['admitted_hist'][1:])} row-rounds")
  shown = m["adaptive"].get("width_rounds", "a tree") if "adaptive" in m else \
      f"gamma {case.gamma}"
  return True, f"accepted {m['mean_accepted']:.2f} a round; {shown}"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", type=int, default=20)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--only", type=int, default=None, help="run this case of the seed alone")
  ap.add_argument("--kinds", default=None, help="comma-separated drafter kinds (default: all)")
  ap.add_argument("--trained-dir", default=None,
                  help="folder of trained drafters (<kind>-<heads>/); without it the trained "
                       "families are left out")
  args = ap.parse_args(argv)
  model_file = STORIES_DIR / "stories260K.bin"
  if not model_file.is_file():
    print(f"error: needs {model_file} (the ../shared folder beside the repository)",
          file=sys.stderr)
    return 2
  usable = args.kinds.split(",") if args.kinds else list(kinds())
  unknown = sorted(set(usable) - set(kinds()))
  if unknown:
    print(f"error: unknown drafter kinds {unknown}; one of {', '.join(kinds())}",
          file=sys.stderr)
    return 2
  trained_dir = Path(args.trained_dir) if args.trained_dir else None
  missing = [k for k in usable if trained_family(k)
             and (trained_dir is None or not any(trained_dir.glob(f"{trained_family(k)}-*")))]
  if missing:
    print(f"left out (no trained drafter in --trained-dir): {', '.join(missing)}")
    usable = [k for k in usable if k not in missing]
  if not usable:
    print("error: no drafter kind left to run", file=sys.stderr)
    return 2

  from spec_jax.models.llama2c import load_llama2c
  model, params = load_llama2c(str(model_file))
  story = [int(t) for t in (REFERENCE_DIR / f"{REFERENCE_STEM}.tokens.txt").read_text().split()]
  failures = 0
  for index in range(args.cases) if args.only is None else [args.only]:
    # a generator per case: --only draws the case as the whole run did
    rng = random.Random(args.seed * 1_000_003 + index)
    case = draw_case(rng, story[1:], usable)
    start = time.perf_counter()
    try:
      ok, message = run_case(model, params, case, rng, trained_dir)
    except Exception:  # a case that raises is a failure too: report it and go on
      ok, message = False, "raised:\n" + traceback.format_exc()
    label = f"{case.kind}{' tree' if case.tree else ''}"
    print(f"case {index}: {'ok' if ok else 'FAILED'} {label}, {len(case.prompts)} rows, "
          f"{time.perf_counter() - start:.0f} s: {message}", flush=True)
    if not ok:
      failures += 1
      rerun = f"--seed {args.seed} --only {index}"
      rerun += f" --kinds {args.kinds}" if args.kinds else ""  # (the kinds drawn from)
      rerun += f" --trained-dir {args.trained_dir}" if args.trained_dir else ""
      print(f"  rerun: python scripts/fuzz_lossless.py {rerun}\n  {case}", flush=True)
  print(f"{failures} of {args.cases if args.only is None else 1} cases failed")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
