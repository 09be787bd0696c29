"""One entry point for speculative generation with any drafter, chain or tree.

    out = speculate(target, params, drafter, draft_params, tokens_BP, lengths_B,
                    gamma=4, max_new_tokens=64)              # a chain drafter
    out = speculate(target, params, tree_drafter, draft_params, tokens_BP, lengths_B,
                    max_new_tokens=64)                       # a tree drafter: its depth

The drafter says which it is (`Drafter.is_tree`); callers never branch on its type. The
lower-level steps are public too: `prepare_program` validates on the host and returns the
hashable program and its array arguments; `speculative_jit(program, params, draft_params,
*args)` runs it; `lower` gives the jax.stages.Lowered program (for AOT compiles, HLO dumps).
"""

from __future__ import annotations

import dataclasses
import inspect

import jax

from spec_jax import adaptive, recent_programs
from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters import registry
from spec_jax.drafters.factory import make_drafter
from spec_jax.drafters.registry import TreeOptions
from spec_jax.speculative import (SpeculativeProgram, call_args, check_all_params,
                                  passed_draft_params, prepare, speculative_jit)
from spec_jax.tree_speculative import prepare_tree
from spec_jax.tree_verify import verify_tree
from spec_jax.verify import verify


def prepare_program(target, drafter, prompt_tokens_BP, prompt_lengths_B, *,
                    gamma: int | str | None = None, max_new_tokens: int,
                    sampling: SamplingConfig = SamplingConfig(), eos_id=None, key=None,
                    budgets_B=None, pad_id: int = 0, cache_len: int | None = None,
                    verifier=None) -> tuple[SpeculativeProgram, tuple]:
  """Validates everything on the host -> (program, its array arguments after the params).

  Chains draft `gamma` tokens a round; a tree drafter's depth sets its draft length (gamma
  must be None or "auto"). gamma="auto" (or a spec_jax.adaptive.AdaptiveConfig) adapts the
  draft length per row and the verification width per round (spec_jax.adaptive; a tree's
  rounds verify the tree cut to a node budget, or run plain steps); without a cost table
  this uses default costs (`speculate` measures them). `verifier` defaults to verify
  (chains) or verify_tree (trees).
  """
  common = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, key=key,
                budgets_B=budgets_B, pad_id=pad_id, cache_len=cache_len)
  adaptive_config = adaptive.as_config(gamma, drafter)
  if adaptive_config is not None:  # gamma="auto": per-row lengths, per-round widths
    if drafter.is_tree:  # each round: a node budget, or plain steps
      program, args = prepare_tree(target, drafter, prompt_tokens_BP, prompt_lengths_B,
                                   verifier=verifier or verify_tree, **common)
      return adaptive.configure(program, adaptive_config), args
    config = adaptive_config.resolved()
    program, args = prepare(target, drafter, prompt_tokens_BP, prompt_lengths_B,
                            gamma=config.gamma_max, verifier=verifier or verify, **common)
    return adaptive.configure(program, config), args
  if drafter.is_tree:
    if gamma is not None:
      raise ValueError(f"a tree drafter's depth ({drafter.max_depth}) sets the draft length: "
                       f"pass gamma=None (or 'auto'), got {gamma}")
    return prepare_tree(target, drafter, prompt_tokens_BP, prompt_lengths_B,
                        verifier=verifier or verify_tree, **common)
  if gamma is None:
    raise ValueError(f"a chain drafter ({type(drafter).__name__}) needs gamma, the number of "
                     "tokens it drafts per round")
  return prepare(target, drafter, prompt_tokens_BP, prompt_lengths_B, gamma=gamma,
                 verifier=verifier or verify, **common)


def speculate(target, params, drafter, draft_params, prompt_tokens_BP, prompt_lengths_B, *,
              gamma: int | str | None = None, max_new_tokens: int,
              sampling: SamplingConfig = SamplingConfig(), eos_id=None, key=None,
              budgets_B=None, pad_id: int = 0, cache_len: int | None = None,
              return_state: bool = False, verifier=None):
  """Speculative generation with a chain or tree drafter, in one jitted call.

  Arguments and output as `spec_jax.generate.generate` (padded prompts [B, P], per-row
  lengths, budgets, EOS, sampling, key -> GenerationOutput with SpecMetrics), plus the
  drafter and its params. With `return_state=True` also the final target cache and drafter
  state. gamma="auto": adaptive speculation (spec_jax.adaptive), its cost table measured
  on the first call for this target, drafter and batch shape.
  """
  program, args = measured_program(target, params, drafter, draft_params, prompt_tokens_BP,
                                   prompt_lengths_B, gamma=gamma, max_new_tokens=max_new_tokens,
                                   sampling=sampling, eos_id=eos_id, key=key, budgets_B=budgets_B,
                                   pad_id=pad_id, cache_len=cache_len, verifier=verifier)
  costs = adaptive.run_costs(program, args[0].shape)  # (None: the program's own table)
  if return_state:
    program = adaptive.keeping_draft_state(program)
  out, cache, draft_state = speculative_jit(program, params,
                                            passed_draft_params(params, draft_params), *args,
                                            costs, keep_state=return_state)
  return (out, cache, draft_state) if return_state else out


def lower(target, params, drafter, draft_params, prompt_tokens_BP, prompt_lengths_B,
          **settings) -> jax.stages.Lowered:
  """The lowered program `speculate` would run with these arguments (settings as there):
  `.compile()` it ahead of time, or read `.as_text()`. gamma="auto" without a cost table:
  the table is measured here as `speculate` measures it (the table is part of the program),
  so this compiles and times a few small programs first (and, with
  AdaptiveConfig.in_program_costs, compiles and times this program itself, then lowers it
  with that table as its argument); with abstract params
  (jax.ShapeDtypeStruct) nothing can be timed, and the program keeps the default table,
  with a warning (pass an AdaptiveConfig with target_costs to lower the one you will run)."""
  program, args = measured_program(target, params, drafter, draft_params, prompt_tokens_BP,
                                   prompt_lengths_B, **settings)
  return speculative_jit.lower(program, params, passed_draft_params(params, draft_params),
                              *args, adaptive.run_costs(program, args[0].shape),
                              keep_state=False)


def measured_program(target, params, drafter, draft_params, prompt_tokens_BP, prompt_lengths_B,
                     **settings):
  """The params checked, the program prepared (prepare_program) and, for gamma="auto"
  without a cost table, the table measured once per target, drafter and batch shape
  (adaptive.with_measured_costs) -> (program, args): what `speculate` and `lower` run."""
  found = recent_programs.find(target, params, drafter, draft_params, prompt_tokens_BP,
                               prompt_lengths_B, settings)
  if found is not None:  # the same objects and settings as a checked call: its program
    program, tokens_shape = found
    given = {**_PREPARE_DEFAULTS, **settings}
    args, cache_len = call_args(target, drafter, program.gamma, prompt_tokens_BP,
                                prompt_lengths_B, **{k: given[k] for k in _CALL_SETTINGS})
    if args[0].shape == tokens_shape and cache_len == program.cache_len:
      return program, args
  signatures = check_all_params(target, params, drafter, draft_params)
  program, args = prepare_program(target, drafter, prompt_tokens_BP, prompt_lengths_B,
                                  **settings)
  program = adaptive.with_measured_costs(program, params, draft_params, args, signatures)
  recent_programs.remember(target, params, drafter, draft_params, prompt_tokens_BP,
                           prompt_lengths_B, settings, program, args[0].shape)
  return program, args


# what a call found in recent_programs passes to call_args: its keyword settings, with
# prepare_program's defaults where the call gave none (read from the signatures, so the two
# paths cannot drift apart)
_PREPARE_DEFAULTS = {name: p.default for name, p in
                     inspect.signature(prepare_program).parameters.items()
                     if p.default is not inspect.Parameter.empty}
_CALL_SETTINGS = tuple(name for name, p in inspect.signature(call_args).parameters.items()
                       if p.kind is inspect.Parameter.KEYWORD_ONLY)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """What to speculate with, in the spirit of vLLM's speculative config.

    config = SpeculativeConfig("eagle", num_speculative_tokens=4, draft_checkpoint="runs/eagle")
    drafter, draft_params = config.build(target, params)
    out = speculate(target, params, drafter, draft_params, tokens, lengths,
                    gamma=config.gamma, max_new_tokens=64)

  method: a drafter kind (`spec_jax.drafter_kinds()`); num_speculative_tokens: drafts per
  round for chains; tree: a token tree's budget instead (families with trees); the other
  fields are the options of make_drafter.
  """
  method: str = "prompt_lookup"
  num_speculative_tokens: int = 4
  tree: TreeOptions | None = None
  draft_checkpoint: str | None = None  # a folder written by scripts/train_drafter.py
  num_layers: int | None = None  # layer_skip
  max_ngram: int = 3  # prompt lookup
  min_ngram: int | None = None

  def __post_init__(self):
    registry.resolve(self.method)  # unknown methods fail here, listing the kinds
    n = self.num_speculative_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {n!r}")

  @property
  def gamma(self) -> int | None:
    """What `speculate` takes as gamma: None for trees (their depth sets it)."""
    return None if self.tree is not None else self.num_speculative_tokens

  def build(self, target, params, *, draft_model=None, draft_params=None):
    """-> (drafter, draft_params), as make_drafter."""
    return make_drafter(self.method, target, params, draft_model=draft_model,
                        draft_params=draft_params, checkpoint=self.draft_checkpoint,
                        tree=self.tree, num_layers=self.num_layers, max_ngram=self.max_ngram,
                        min_ngram=self.min_ngram)
