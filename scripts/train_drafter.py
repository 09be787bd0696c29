"""Distil a drafter from a frozen target, then measure its acceptance on held-out prompts.

  python scripts/train_drafter.py --kind medusa --model ../shared/models/stories260K/stories260K.bin \
      --checkpoint-dir /tmp/medusa --steps 2000
  python scripts/train_drafter.py --kind eagle --model ... --corpus stories.txt --steps 3000

Kinds: draft_model (a small separate Llama), medusa (K heads), eagle (one feature-level
layer), mtp (K DeepSeek-V3 modules). Corpus: a text file (tokenised with the target's
tokenizer) or, by default, the target's own sampled generations. Training is the shared
loop of spec_jax.training (AdamW, warm-up + cosine, clipping, orbax checkpoints: rerun the
same command to resume; the best params by held-out loss or acceptance are kept in
<checkpoint-dir>/best). At the end it prints mean accepted lengths on held-out prompts,
untrained vs trained, via speculative_generate.

With --export-dir it also writes the drafter (the best params if kept, else the last) as
drafter.json + drafter.safetensors, which `scripts/generate.py --draft KIND
--draft-checkpoint DIR` loads. The library behind this is spec_jax.training.distill.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from spec_jax.training.distill import (Trainer, export_drafter, generated_corpus,  # noqa: E402
                              make_spec, mean_accepted, stdlib_corpus, text_corpus,
                              write_description)
from spec_jax.drafters.registry import trained_kinds  # noqa: E402
from spec_jax.training import restore_best  # noqa: E402
from spec_jax import cli  # noqa: E402
from spec_jax.core.errors import BadArgument  # noqa: E402


# --- command line -----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
  p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  count, count0, weight = cli.positive_int, cli.non_negative_int, cli.real_range(0.0)
  p.add_argument("--kind", required=True, choices=trained_kinds())
  p.add_argument("--model", required=True,
                 help="target: 'builtin' (the built-in pair's target) or a checkpoint (llama2.c "
                      ".bin, HF or native folder)")
  p.add_argument("--tokenizer", default=None, help="for --corpus FILE (default: beside the model)")
  p.add_argument("--corpus", default="self",
                 help="a text file, 'self' for the target's own sampled generations, or "
                      "'stdlib' for the Python standard library's source (the built-in "
                      "pair's training text, same held-out files)")
  p.add_argument("--num-sequences", type=count, default=1024, help="generated training sequences")
  p.add_argument("--heldout", type=count, default=32, help="generated held-out sequences")
  p.add_argument("--gen-temperature", type=weight, default=1.0)
  p.add_argument("--seq-len", type=cli.int_range(2), default=64)
  p.add_argument("--num-heads", type=count, default=4, help="Medusa heads / MTP modules")
  p.add_argument("--draft-dim", type=count, default=None, help="draft_model width")
  p.add_argument("--draft-layers", type=count, default=1, help="draft_model layers")
  p.add_argument("--draft-hidden", type=count, default=None, help="MLP width of the drafter's block")
  p.add_argument("--loss", default="kl", choices=("kl", "ce"), help="token loss")
  p.add_argument("--feature-weight", type=weight, default=1.0, help="feature regression weight (EAGLE)")
  p.add_argument("--token-weight", type=weight, default=0.1, help="token-loss weight (EAGLE)")
  p.add_argument("--feature-noise", type=weight, default=0.0, help="input feature noise (EAGLE)")
  p.add_argument("--anchors", type=count, default=None,
                 help="blocks per training row (DFlash, DSpark; default: a quarter of --seq-len)")
  p.add_argument("--steps", type=count, default=1000)
  p.add_argument("--batch-size", type=count, default=16)
  p.add_argument("--lr", type=cli.real_range(0.0, open_minimum=True), default=3e-3)
  p.add_argument("--warmup", type=count0, default=50)
  p.add_argument("--weight-decay", type=weight, default=0.0)
  p.add_argument("--clip", type=cli.real_range(0.0, open_minimum=True), default=1.0)
  p.add_argument("--checkpoint-dir", default=None)
  p.add_argument("--export-dir", default=None,
                 help="write the trained drafter here (drafter.json + drafter.safetensors)")
  p.add_argument("--export-dtype", default="float32", choices=("float32", "float16", "int8"),
                 help="weights in the exported drafter (int8: per-column float32 scales)")
  p.add_argument("--save-every", type=count, default=200)
  p.add_argument("--eval-every", type=count0, default=0)
  p.add_argument("--best-by", default=None, choices=("loss", "acceptance"))
  p.add_argument("--gamma", type=count, default=4, help="draft length for the acceptance evaluation")
  p.add_argument("--eval-prompts", type=count, default=16)
  p.add_argument("--eval-new-tokens", type=count, default=64)
  p.add_argument("--seed", type=cli.seed_int, default=0)
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  from spec_jax.models.loading import find_tokenizer_path, load_model
  tokenizer = None  # the built-in pair's comes with it; others' are read for a text corpus
  if args.model == "builtin":
    from spec_jax.models.builtin import load_builtin
    target, target_params, _, _, tokenizer = load_builtin()
  else:
    target, target_params = load_model(args.model)
  spec = make_spec(args.kind, target, num_heads=args.num_heads, draft_dim=args.draft_dim,
                   draft_layers=args.draft_layers, draft_hidden=args.draft_hidden)
  if spec.max_gamma is not None and args.gamma > spec.max_gamma:
    raise BadArgument(f"--gamma {args.gamma} > {spec.max_gamma} ({args.kind} drafts at most "
                      "that many per round)")
  if args.corpus == "self":
    corpus = generated_corpus(target, target_params, num_sequences=args.num_sequences,
                              seq_len=args.seq_len, heldout=args.heldout, seed=args.seed,
                              temperature=args.gen_temperature)
  else:
    if tokenizer is None:
      from spec_jax.models.tokenizer import load_tokenizer
      tok_path = args.tokenizer or find_tokenizer_path(args.model)
      if tok_path is None:
        raise BadArgument(f"no tokenizer found beside {args.model}; pass --tokenizer")
      tokenizer = load_tokenizer(tok_path)
    kw = dict(seq_len=args.seq_len, max_heldout=max(args.eval_prompts, 8), seed=args.seed)
    corpus = (stdlib_corpus(tokenizer, **kw) if args.corpus == "stdlib"
              else text_corpus(args.corpus, tokenizer, **kw))
  # each family's loss takes the options it names (spec_jax.drafters.registry.Trained.loss)
  accepted = inspect.signature(spec.trained.loss).parameters
  options = {k: v for k, v in dict(token=args.loss, feature_weight=args.feature_weight,
                                   token_weight=args.token_weight,
                                   feature_noise=args.feature_noise,
                                   anchors=args.anchors).items() if k in accepted}
  trainer = Trainer(spec, target, target_params, corpus, args.steps, args.batch_size, args.lr,
                    args.warmup, args.weight_decay, args.clip, options, args.seed)
  if args.checkpoint_dir:
    write_description(args.checkpoint_dir, spec, vars(args))
  with contextlib.redirect_stdout(sys.stderr):  # progress and eval lines; stdout is the report
    params, info = trainer.run(checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                               eval_every=args.eval_every, best_by=args.best_by,
                               gamma=args.gamma, eval_prompts=args.eval_prompts,
                               eval_new_tokens=args.eval_new_tokens,
                               progress=not args.no_progress)
  report = {"kind": args.kind, "steps": args.steps, "start_step": info["start_step"],
            "train": info["train"],
            "tokens_per_s": info.get("tokens_per_s"), "evals": info["evals"]}
  prompts = corpus.heldout[:args.eval_prompts, :8]
  candidates = {"untrained": trainer.initial_params(), "trained": params}
  if args.best_by and args.checkpoint_dir:
    best = restore_best(args.checkpoint_dir, params)
    if best is not None:
      candidates["best"] = best[0]
      report["best_step"] = int(best[1])
  for name, own in candidates.items():
    m = mean_accepted(target, target_params, spec, own, prompts, gamma=args.gamma,
                      max_new_tokens=args.eval_new_tokens)
    report[name] = {k: m[k] for k in ("mean_accepted", "mean_accepted_with_bonus",
                                      "acceptance_rate", "position_acceptance")}
  if args.export_dir:
    export_drafter(args.export_dir, spec, candidates.get("best", params), dtype=args.export_dtype)
    report["exported"] = str(args.export_dir)
  # positions never reached have no rate (NaN): null in strict JSON
  report = json.loads(json.dumps(report).replace("NaN", "null"))
  print(json.dumps(report, indent=2))
  return report


if __name__ == "__main__":
  sys.exit(cli.run(main))
