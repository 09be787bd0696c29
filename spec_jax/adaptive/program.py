"""Programs that run adaptive rounds: a SpeculativeProgram configured with an AdaptiveConfig."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from spec_jax.adaptive.config import AdaptiveConfig, memoised_when_hashable
from spec_jax.adaptive.rounds import AdaptiveRound, AdaptiveTreeRound, acceptance_is_the_rule
from spec_jax.core.control import cond_in_place, zeros_like_outputs
from spec_jax.drafters.base import HINDSIGHT_WIDTH
from spec_jax.drafters.common import first_draft_scores
from spec_jax.generate import at_positions
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

    def initial_stats(self, batch: int, costs=None) -> AdaptiveStats:
      """costs: the cost table the rounds plan from, an argument of the program (CostTable
      of arrays; None: the config's, static, compiled in). A tree plans from the config's."""
      r = self.adaptive.rules
      return AdaptiveStats.zeros(batch, self.gamma, self.adaptive.widths, r.initial_gamma,
                                 r.prior, self.probe_every, self.adaptive.tree_nodes,
                                 sources=self.drafter.has_sources,
                                 costs=None if self.drafter.is_tree else costs,
                                 scheduled=r.schedule and not self.drafter.is_tree,
                                 exact_acceptance=self.learns_exact_acceptance)

    @property
    def learns_exact_acceptance(self) -> bool:
      """Static: drafted rounds teach the exact acceptance of each reached draft, not the
      verifier's draw (AdaptiveRules.exact_acceptance)."""
      return (self.adaptive.rules.exact_acceptance and not self.sampling.is_greedy
              and not self.drafter.is_tree
              and acceptance_is_the_rule(self.verifier))

    @property
    def probe_every(self) -> int:
      """The rounds' idle rounds between probes (AdaptiveRound.probe_every)."""
      return self.round_fn.probe_every(self.drafter, self.sampling)

    @property
    def records_followed_probs(self) -> bool:
      """Static: a sampled run whose stretches learn in hindsight (AdaptiveRound.watches):
      its plain steps record the target's probability of each token they draw."""
      return (not self.sampling.is_greedy
              and self.round_fn.watches(self.drafter, self.sampling, self.verifier))

    def followed_probs(self, seq_BS):
      if not self.records_followed_probs or self.drafts_never(seq_BS.shape[0]):
        return None
      return jnp.zeros(seq_BS.shape, jnp.float32)

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

    def init_drafter(self, draft_params, prompt, metrics, *, remaining_tokens_B,
                     target_logits_BPV, costs=None):
      """The drafter's state and the initial statistics (in metrics.adaptive).

      A drafter that skips rounds is not read in a plain stretch to the end; where the
      first round will be one (the plan drafts nothing and no probe can come: a useless
      draft, or a budget too short to repay one), its prefill is skipped too, and its state
      left zero: a 12-of-30-layer skip of SmolLM2 otherwise spent ~10% of a 32-token answer
      prefilling a draft cache nothing read.

      A program that watches in hindsight first looks at the prompt (look_at_prompt): its
      drafter's prefill also gives the distribution it would have drawn its first draft
      from after each of the prompt's last positions, and the target's logits there the
      target's (prompt_look)."""
      batch = prompt.tokens_BP.shape[0]
      stats = self.initial_stats(batch, costs)
      init = functools.partial(self.drafter.init, draft_params)
      with_stats = lambda s: metrics.replace(adaptive=s)
      if self.drafts_never(batch):
        return zeros_like_outputs(init, prompt), with_stats(stats)
      if self.drafter.is_tree or not self.drafter.skips_rounds:
        return init(prompt), with_stats(stats)
      never = jnp.bool_(False)
      if not self.adaptive.keeps_drafter_in_step:
        never = self.round_fn.never_drafts(stats, remaining_tokens_B, self.probe_every)
      if costs is not None and costs.force is not None:
        # a timed run (in_program): force 0 never drafts, a forced width always does,
        # whatever its budget (a short one would otherwise skip the prefill that a long
        # one pays, and charge it to the long run's rounds)
        never = jnp.where(costs.force < 0, never, costs.force == 0)
      look = self.prompt_look(draft_params, prompt, target_logits_BPV)
      if look is None:
        state = cond_in_place(never, lambda state: state, lambda _: init(prompt),
                              zeros_like_outputs(init, prompt))
        return state, with_stats(stats)
      start, valid_BA = look
      state, agree_BA, guessed_BA = cond_in_place(never, lambda out: out, lambda _: start(),
                                                  zeros_like_outputs(start))
      stats = self.round_fn.look_at_prompt(
          stats, agree_BA, valid_BA & guessed_BA & ~never, remaining_tokens_B, self.drafter,
          self.probe_every)
      return state, with_stats(stats)

    def prompt_look(self, draft_params, prompt, target_logits_BPV):
      """(start, valid_BA), or None where this program does not look at the prompt: start()
      -> (the drafter's state, score_BA [B, A]: how the first draft of a round whose pending
      token sat at each of the last A = min(HINDSIGHT_WIDTH, P) prompt positions would have
      fared, drafters.common.first_draft_scores: greedy, whether its greedy draft is the
      target's greedy token there; sampled, the exact probability sum_x min(p, q) that it
      is accepted there, both distributions known at the prompt, whose own tokens are not
      samples of the target; has_BA: where the drafter has such a draft); valid_BA: the
      positions a row's prompt has. Only for programs that watch in hindsight (a sampled one
      only where the drafter scores sampled stretches too) with no logit processing (a
      past position's warped distribution would need its history), and drafters whose
      prefill gives their first drafts' logits (Drafter.init_with_first_logits)."""
      if (not self.adaptive.rules.prompt_look or self.sampling.processes_logits
          or not self.drafter.guesses_at_init
          or not self.round_fn.watches(self.drafter, self.sampling, self.verifier)):
        return None
      width = prompt.tokens_BP.shape[1]
      seen = min(HINDSIGHT_WIDTH, width)
      positions_BA = prompt.lengths_B[:, None] - seen + jnp.arange(seen, dtype=jnp.int32)
      valid_BA = positions_BA >= 0
      positions_BA = jnp.maximum(positions_BA, 0)
      target_BAV = at_positions(target_logits_BPV, positions_BA)

      def start():
        state, logits_BAV, has_BA = self.drafter.init_with_first_logits(draft_params, prompt,
                                                                        positions_BA)
        if logits_BAV is None:
          raise TypeError(f"{type(self.drafter).__name__}.guesses_at_init is True but its "
                          "init_with_first_logits returned no logits")
        return state, first_draft_scores(target_BAV, logits_BAV, self.sampling), has_BA
      return start, valid_BA

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
