"""Programs that run adaptive rounds: a SpeculativeProgram configured with an AdaptiveConfig."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from spec_jax.adaptive.config import AdaptiveConfig, memoised_when_hashable
from spec_jax.adaptive.rounds import AdaptiveRound, AdaptiveTreeRound
from spec_jax.core.control import cond_in_place, zeros_like_outputs
from spec_jax.metrics import AdaptiveStats


def _adaptive_program_class():
  from spec_jax.speculative import SpeculativeProgram

  @dataclasses.dataclass(frozen=True)
  class AdaptiveProgram(SpeculativeProgram):
    """A SpeculativeProgram whose rounds are AdaptiveRound (gamma = config.gamma_max) or, for
    a tree drafter, AdaptiveTreeRound (gamma = the tree's depth); the loop's carry holds the
    adaptive state in metrics.adaptive."""
    adaptive: AdaptiveConfig | None = None
    __hash__ = SpeculativeProgram.__hash__  # (a dataclass would generate one hashing each call)

    def init(self, params, draft_params, tokens_BP, lengths_B, budget_B, eos_id, key):
      state = super().init(params, draft_params, tokens_BP, lengths_B, budget_B, eos_id, key)
      stats = self.initial_stats(tokens_BP.shape[0])
      return state.replace(metrics=state.metrics.replace(adaptive=stats))

    def initial_stats(self, batch: int) -> AdaptiveStats:
      r = self.adaptive.rules
      return AdaptiveStats.zeros(batch, self.gamma, self.adaptive.widths, r.initial_gamma,
                                 r.prior, self.probe_every, self.adaptive.tree_nodes)

    @property
    def probe_every(self) -> int:
      """The rounds' idle rounds between probes (AdaptiveRound.probe_every)."""
      return self.round_fn.probe_every(self.drafter, self.sampling)

    def drafts_never(self, batch: int) -> bool:
      """Static, from the cost table and the rules alone: no round of any run of this
      program at this batch size drafts. That holds where the first round plans a plain
      stretch to the end (nothing planned, no probe due now or later: never_drafts at the
      initial statistics) both for the whole batch with its whole budgets left and for one
      row left alone with its whole budget (the rest done): a batch's plan weighs the rows
      still to finish, so a row left alone can pay where the whole batch cannot, and fewer
      tokens left only pay less (tests/test_adaptive.py checks random tables, budgets and
      done rows). Such a program runs generate's loop alone (AdaptiveRound.plain_to_the_end)
      and never builds the drafter's state, sparing their compile, prefill and per-call
      work: a 1-layer skip of stories260K ran 5-9% slower than autoregressive for them.
      Not for trees, nor where the final drafter state is read (keeps_drafter_in_step)."""
      if self.drafter.is_tree or self.adaptive.keeps_drafter_in_step:
        return False
      name = f"_drafts_never_{batch}"  # memoised: computed once per program and batch size
      if name not in self.__dict__:
        with jax.ensure_compile_time_eval():
          stats, left = self.initial_stats(batch), self.max_new_tokens - 1
          whole_B = jnp.full((batch,), left, jnp.int32)
          alone_B = jnp.zeros((batch,), jnp.int32).at[0].set(left)
          self.__dict__[name] = all(
              bool(self.round_fn.never_drafts(stats, remaining_B, self.probe_every))
              for remaining_B in (whole_B, alone_B))
      return self.__dict__[name]

    def loop_round(self, batch: int):
      if self.drafts_never(batch):
        return self.round_fn.plain_to_the_end
      return self.round_fn

    def init_drafter(self, draft_params, prompt, remaining_tokens_B):
      """A drafter that skips rounds is not read in a plain stretch to the end; where the
      first round will be one (the plan drafts nothing and no probe can come: a useless
      draft, or a budget too short to repay one), its prefill is skipped too, and its state
      left zero: a 12-of-30-layer skip of SmolLM2 otherwise spent ~10% of a 32-token answer
      prefilling a draft cache nothing read."""
      init = functools.partial(self.drafter.init, draft_params)
      if self.drafts_never(prompt.tokens_BP.shape[0]):
        return zeros_like_outputs(init, prompt)
      if (self.drafter.is_tree or not self.drafter.skips_rounds
          or self.adaptive.keeps_drafter_in_step):
        return init(prompt)
      stats = self.initial_stats(prompt.tokens_BP.shape[0])
      never = self.round_fn.never_drafts(stats, remaining_tokens_B, self.probe_every)
      return cond_in_place(never, lambda state: state, lambda _: init(prompt),
                           zeros_like_outputs(init, prompt))

  return AdaptiveProgram


@functools.cache
def adaptive_program_class():
  return _adaptive_program_class()


@memoised_when_hashable
def configure(program, config: AdaptiveConfig):
  """A program running adaptive rounds: a chain program prepared with gamma =
  config.gamma_max, or a tree program (its rounds then verify the tree cut to a node budget,
  or run plain steps: AdaptiveTreeRound). Memoised (programs and configs are immutable): the
  same settings come back as the same program, without rebuilding it on every call."""
  drafter = program.drafter
  if drafter.is_tree:
    config = dataclasses.replace(config, gamma_max=drafter.max_depth,
                                 tree_nodes=drafter.num_nodes).resolved()
    round_fn = AdaptiveTreeRound(config)
  else:  # (a config taken from a tree program drops its node budget)
    config = dataclasses.replace(config, tree_nodes=None).resolved()
    round_fn = AdaptiveRound(config)
  if program.gamma != config.gamma_max:
    raise ValueError(f"the program drafts {program.gamma}, the config's gamma_max is "
                     f"{config.gamma_max}")
  fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(program)
            if f.name != "adaptive"}
  fields["round_fn"] = round_fn
  return adaptive_program_class()(**fields, adaptive=config)


def keeping_draft_state(program):
  """The program with AdaptiveConfig.final_draft_state on, for callers that read the final
  drafter state; a program that does not run adaptive rounds, unchanged."""
  return _reconfigured(program, final_draft_state=True)


def with_max_stretch(program, steps: int):
  """The program with AdaptiveConfig.max_stretch = steps (streaming: no plain stretch runs
  past a chunk); a program that does not run adaptive rounds, unchanged."""
  return _reconfigured(program, max_stretch=steps)


def _reconfigured(program, **changes):
  """The program with these AdaptiveConfig fields changed (itself where they already hold,
  or where it does not run adaptive rounds)."""
  cfg = getattr(program, "adaptive", None)
  if cfg is None or all(getattr(cfg, k) == v for k, v in changes.items()):
    return program
  return configure(program, dataclasses.replace(cfg, **changes))
