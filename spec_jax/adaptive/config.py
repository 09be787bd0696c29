"""gamma="auto"'s settings: the compiled widths, the stopping rules and the cost table.

Host-side and static (hashable): a config is part of the compiled program."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from spec_jax.core.errors import is_int, is_real

DEFAULT_GAMMA_MAX = 8


def default_widths(gamma_max: int) -> tuple[int, ...]:
  """1, 2, 3, 5, 9, ... tokens per target pass (the pending token + drafts), capped by
  gamma_max + 1, which is always included."""
  widths, w = [1, 2, 3], 5
  while w < gamma_max + 1:
    widths.append(w)
    w = 2 * w - 1
  return tuple(sorted({x for x in widths if x <= gamma_max} | {gamma_max + 1}))


def tree_widths(num_nodes: int) -> tuple[int, ...]:
  """A tree program's widths: a plain step (1), then the tree cut to its first 2, 3, 5, 9,
  ... nodes, and the whole tree (num_nodes)."""
  return (1,) + tuple(w for w in default_widths(num_nodes - 1) if 1 < w < num_nodes) + (
      num_nodes,)


def default_costs(widths) -> tuple[float, ...]:
  """A guess when nothing was measured: a pass costs 1 + 0.1 per extra token."""
  return tuple(1.0 + 0.1 * (w - 1) for w in widths)


def memoised_when_hashable(fn):
  """fn with an lru_cache for hashable arguments (immutable settings); arguments that are not
  hashable (settings given as lists) call fn uncached."""
  cached = functools.lru_cache(maxsize=64)(fn)

  @functools.wraps(fn)
  def call(*args):
    try:
      hash(args)
    except TypeError:
      return fn(*args)
    return cached(*args)
  return call


@dataclasses.dataclass(frozen=True)
class AdaptiveRules:
  """Stopping rules and scheduler settings (hashable: part of the compiled program).

  confidence: stop after a draft whose own probability is below it, or before a position
    whose top draft probability is below it (0 disables).
  survival: admit position i while the running product of acceptance estimates is >= it.
  schedule: HF's per-row gamma (+2 after a fully accepted block, -1 otherwise), starting at
    initial_gamma, caps each row's drafts (a drafter with sources: one schedule per source).
    Off by default since stop 59: the plan already weighs each position's estimate, and the
    cap, one miss at a time, held rows below the length their estimates paid for. Side by
    side on one table (one process each, medians of 5): the built-in pair's draft model
    1.276x / 1.275x without it against 1.243x / 1.241x with it, lookup + draft model 1.495x
    / 1.530x against 1.466x / 1.491x, batch 4 the same rounds; stories260K's lookup, layer
    skip and int8 target +1% to +3%, lookup + layer skip -0.2%.
  prior / learning_rate: the online per-row, per-position acceptance estimates (an
    exponential moving average of "accepted, given reached and verified").
  forget: in each drafted round, a row's estimates of later positions it did not verify move
    this much of the way back to the prior, so that a position once rejected is tried again
    (the scheduler stops verifying it, and an estimate nothing updates would stay low for
    the whole generation: on the built-in pair, two early rejections of the second draft
    held a prompt at one draft a round, 0.69x of its best fixed gamma).
  probe_every: after this many rounds without drafting, draft anyway to refresh the
    estimates, while the slowest row's remaining budget, in plain steps, takes at least
    probe_every times the dearest drafted round (a probe near the end has no time to pay
    for itself: at 64 rows of a 292M target a 5-token round costs 3.5 plain steps, and three
    probes in 32 tokens cost `auto` 10%); probe_growth: the interval grows this many times
    after each probe that was not promising (drafted_or_plain; up to 64x probe_every), and
    returns to probe_every after one that was, or after a round that drafts because drafting
    pays (for chains, probe_every as probe_share scales it). x2: probes after 8, 24, 56, 120 idle steps. x4 (8, 40, 168) saved a useless
    draft one probe in 128 tokens (about 3 plain steps on stories260K: 2-4%), but left good
    drafts unused: on the built-in pair at batch 1 two probes that happened to meet the
    draft model's rare misses (7 in 64 positions on one prompt) left three of six code
    prompts plain for the whole generation (geometric mean 1.20x against 1.35x with x2,
    gamma 4 1.43x). Any accepted draft in any row used to count as promising: in a large
    batch some row always accepts something.
  probe_share: for chain drafters, probes (or the checks a stretch watching in hindsight
    makes instead) come at least loss / (probe_share * gain) idle rounds apart, where gain
    is the best speed-up a drafted round could bring (all its drafts accepted) and loss
    what a probe at the prior costs beyond its expected tokens (planning.scaled_probe_every;
    the probe window and the cap on the interval's growth scale with it). 0: probe_every as
    given.
    A drafter whose best case barely beats plain steps then probes rarely, or not at all in
    a short generation: on stories260K trained DSpark and DFlash drafters (rounds of 4 drafts
    at 4.3 plain steps) probed every 8 steps at 0.82-0.84x autoregressive, where never
    drafting read 0.955-0.97x; a trained EAGLE, watching every 8 steps (recording each plain
    step's features for it), 0.87x against 0.94x.
  min_gain: probes, and the checks a stretch makes in hindsight in their place, run only
    where a drafted round whose drafts were all accepted would beat plain steps by more than
    this (planning.best_gain, from the start-up table; trees: their deepest path). Below it
    the program never carries the drafter unless its plan drafts at the prior (drafts_never:
    generate's loop). Two reasons, both measured on stories260K at batch 1 (stop 64):
    six start-up tables of one trained DFlash program, timed one after another in one
    process, put its best gain at -0.18, 0.26, 0.09, 0.25, 0.18 and 0.16 (its 4-token round
    at 2.65-4.17 plain steps), so a margin this small is the table's noise; and carrying a
    drafter costs before anything is drafted: a program that gave up at its look at the
    prompt (then generate's loop body to the end) ran 0.85-1.4 ms (about 10 plain steps)
    behind one that never drafts, at 128 and at 256 tokens, and each later check about one
    plain step more. Such a drafter read 0.86-0.93x autoregressive with `auto` where never
    drafting read 0.97-0.99x; the drafted rounds its bursts of agreement paid for gained 5
    plain steps in 128 tokens. 0: any gain (the rule before stop 64).
  loss_budget / loss_share: the run keeps an account, in plain steps, of what drafting has
    gained or lost against plain decoding, priced by the cost table (AdaptiveStats.account):
    each drafted round adds how far it moved the batch's finish (the largest remaining
    budget of the rows active before it: its tokens, at one row) less its cost (its target
    pass, verification and drafting; the drafting also where it verified nothing), each
    catch-up after plain steps (a drafter that skips rounds: the checks a watching stretch
    makes, the catch-up before a probe) takes its cost off. Once the account is below
    -(loss_budget + loss_share * the rounds run so far, plain steps counted as rounds), the
    run stops drafting: no plan drafts, no probe or check comes, and the rest of the run is
    one plain stretch to the end (with AdaptiveConfig.max_stretch, streaming, each chunk's
    round reads the account again, against an allowance that grows with the rounds). Past
    rounds only (lossless). The estimates say what a round should yield; the account says
    what the rounds did yield, so a drafter whose bursts of agreement pay less than watching
    for them costs is stopped. On the built-in pair's 6
    code prompts (batch 1, 128 tokens) the account read +36 to +78 plain steps where the
    measured gain was 29-71; what it cannot see is what the table leaves out (on stories260K
    the fixed cost of carrying a drafter, about 8 plain steps). math.inf: no budget.
  admit: research hook replacing the row rules: admit(AdmitInputs) -> [B] admitted lengths.
    It must obey the lossless condition (tests use it for a deliberately leaky rule). Its
    AdmitInputs.gamma_B is the schedule's length, which moves only with schedule=True.
  lookahead: the width scheduler's scan values lengths past each position with past rounds'
    estimates (schedule_length); False: it compares neighbours only, DSpark's scan.
  hindsight: in greedy runs (sampled ones: below) of a drafter that reports its greedy
    guesses at each catch-up
    (Drafter.has_hindsight: a draft model, a layer skip, a quantized target, an EAGLE or
    Medusa chain, a DFlash or DSpark block (one block per position looked at), prompt
    lookup alone, lookup + one of those: each source its own record), plain stretches
    learn the estimates from them (the last HINDSIGHT_WIDTH positions of each catch-up), as
    a verified round of drafts would, and end when drafting pays: no probes. A stretch that
    found nothing counts as a probe that was not promising (the wait grows, and restarts
    from that look), so watching stops where probing would. The first look comes before
    the first round, at the prompt, where the drafter's prefill yields its first drafts'
    logits (Drafter.init_with_first_logits: a draft model, a layer skip, a quantized
    target, lookup + one of those, an EAGLE chain, whose prefill runs every prompt element
    on true features, a Medusa chain, at the positions whose token is the target's greedy
    one, a DFlash or DSpark block, at positions after the first; prompt lookup, its
    drafts, no match a miss): its greedy first draft after each of the prompt's last 8
    positions against the target's greedy token there (AdaptiveProgram.prompt_look; off
    with prompt_look=False). A look whose drafts agreed nowhere and after which the first
    round would not draft counts, as such a stretch does, as a check that found nothing
    (since stop 69; since stop 70 only where no row's look expects one accepted draft: no
    agreement, or sampled scores summing below 1, as the prompt is the user's text, where
    a draft agrees less than on the target's answer; not for a drafter with sources): the
    first check comes probe_growth times later.
    Measured side by side (stop 39, one table each; the last run with these rules): the
    built-in pair's 6 code prompts 1.48x / 1.29x / 1.41x against probes' 1.46x / 1.27x /
    1.37x (gamma 4 1.43x / 1.29x / 1.42x); stories260K's useless drafts 0.94x / 0.90x
    against 0.93x / 0.90x. Sampled runs watch too where the drafter scores them
    (Drafter.has_sampled_hindsight: a draft model, a layer skip, a quantized target, a
    Medusa or EAGLE chain, DFlash, DSpark, prompt lookup, lookup + one of those) and no
    penalty or min_new_tokens processes the logits: each position's score is min(1, q(y) / p(y)) for
    the token y its plain step drew (drafters.SampledHindsight); at the prompt, whose
    tokens are not samples of the target but where both distributions are known, the
    exact acceptance sum_x min(p, q) (drafters.common.first_draft_scores). False: probes,
    as for every other drafter and sampled run.
  give_up: after a probe that was not promising, or a stretch that watched in hindsight to
    its end without finding drafting worth it, the wait before the next one jumps to its
    longest (64 x probe_every: in a short generation the rest of it runs as generate's loop,
    with no catch-ups) when no row could pay for a round even if its first drafts were
    accepted at the upper end of what their record allows, at this one-sided confidence
    (planning.wilson_upper over the first drafts verified or guessed in hindsight), and every
    later draft were accepted (AdaptiveRound.least_first). A random draft model of
    stories260K agrees with the target on no first draft in 8 (upper end 0.40 at 0.99) where
    breaking even needs 0.63; it was watched every 12 steps, then 24, 48, each check a
    catch-up and a new round. With the look at the prompt it gives up before the first
    round where that look rules drafting out (8 guesses, none right; sampled, 8 exact
    acceptances whose sum is that low), and the run is
    generate's loop from its first token. 0 disables it (the wait grows by probe_growth
    alone).
  record_holds_wait: a stretch that watched in hindsight to its end without finding drafting
    worth it grows the wait before the next check (probe_growth) only where the plan would
    not draft at the rows' whole records of first drafts (every one verified or guessed in
    hindsight, as give_up reads it; AdaptiveRound.record_pays: for one row, where its rate
    does not beat a plain step with a round of one draft; for a batch, as the plan weighs
    its slowest row). Acceptance comes in runs: on the built-in pair's first code prompt the
    draft model agreed on 76% of first drafts, a run of misses grew the wait to 32 steps,
    and the hindsight at its end found 96% agreement there, so `auto` ran 72 plain steps
    where gamma 1 drafted every round and gained 10%. False: the wait grows after every such
    stretch (the rule before stop 57).
  later_follow_first: in a drafted round, the estimates of the later positions a row did not
    verify move `forget` of the way back towards the larger of the prior and its first
    draft's estimate, for a drafter whose later drafts are teacher-forced continuations of
    its first (a draft model, a layer skip, a quantized target, lookup + one of those:
    Drafter.has_hindsight and hindsight_speaks_for_later_drafts; not EAGLE, Medusa, block
    drafters or lookup alone), so rounds of one draft, which verify no later draft, do not
    hold a row whose first drafts are accepted 95% of the time at the prior's 0.7 for good
    (AdaptiveStats.update). False: back towards the prior alone (the rule before stop 57).
  follow_accepted: with later_follow_first, where the row's first draft was verified and
    accepted, those later positions move learning_rate of the way, not forget (a first
    draft accepted is an agreement after the true prefix, as a later draft's is after
    accepted ones; so also in a round where a later draft was then rejected, whose own
    position learns the rejection). One rejected later draft brought a row whose first
    drafts were accepted 99% of the time from 0.9 to 0.64 at that position, and rounds of
    one draft then drifted it back 5% a round: 15-30 rounds of one draft where gamma 4
    gained more (the built-in pair's third code prompt). False: forget (the rule of stop 57).
  record_floor: for the same drafters, the plan and the drafted round read each row's
    first-draft estimate as at least its whole record's rate (first drafts verified or
    guessed in hindsight, once HINDSIGHT_WIDTH of them: AdaptiveRound.floored). The
    estimate follows the last few rounds (learning_rate 0.3): one miss after a run of hits
    took a row agreeing 76% of the time from 0.75 to 0.53, below the 0.59 a round of one
    draft needs, and `auto` ran plain stretches where gamma 1 drafted through the misses and
    gained 10% (the built-in pair's first code prompt). A draft whose record cannot pay is
    planned as before, so a useless draft still runs plain. False: the estimate alone.
  horizon: the plan values a draft length by the expected time to finish the batch
    (the slowest row: planned_drafts, finishing_rounds); False: by tokens per second summed
    over the rows, which overvalues drafting in large batches, whose rows finish rounds
    apart.
  exact_acceptance: a sampled chain round learns, at each position it reached, the exact
    probability sum_x min(p_i, q_i) that the draft there would be accepted given the drafts
    before it (both distributions are in hand after the target pass), instead of the coin
    its verifier drew (AdaptiveStats.round_accept_BG): the same mean, without the draw's
    variance. A moving average at learning_rate 0.3 of 0/1 outcomes at 0.75 wanders by
    about 0.18: on the built-in pair at temperature 0.8 the first-draft estimates ended
    anywhere from 0.19 to 0.85 where the exact acceptance was 0.71-0.79. Past rounds only:
    lossless. Greedy runs learn their outcome, which is that probability; not for trees or
    a verifier whose acceptance is another rule (agreement_is_acceptance = False). False:
    the outcome.
  """
  confidence: float = 0.05
  survival: float = 0.1
  schedule: bool = False
  initial_gamma: int = 4
  prior: float = 0.7
  learning_rate: float = 0.3
  forget: float = 0.05
  probe_every: int = 8
  probe_growth: int = 2
  probe_share: float = 0.5
  min_gain: float = 0.3
  loss_budget: float = 4.0
  loss_share: float = 0.02
  admit: Callable | None = None
  lookahead: bool = True
  horizon: bool = True
  hindsight: bool = True
  prompt_look: bool = True
  give_up: float = 0.99
  record_holds_wait: bool = True
  later_follow_first: bool = True
  follow_accepted: bool = True
  record_floor: bool = True
  exact_acceptance: bool = True

  def __post_init__(self):
    # checked when built: AdaptiveConfig.resolved is memoised, and equal rules (record_floor=1
    # equals record_floor=True) would be served from its cache unchecked
    check_rules(self)


# AdaptiveRules' numeric fields: (low, high, whether low itself is allowed, whether high is)
_RULE_RANGES = {"confidence": (0.0, 1.0, True, True), "survival": (0.0, 1.0, True, True),
                "prior": (0.0, 1.0, True, True), "learning_rate": (0.0, 1.0, False, True),
                "forget": (0.0, 1.0, True, True), "probe_share": (0.0, math.inf, True, False),
                "min_gain": (0.0, math.inf, True, False),
                "loss_budget": (0.0, math.inf, True, True),
                "loss_share": (0.0, math.inf, True, False),
                "give_up": (0.0, 1.0, True, False)}
_RULE_COUNTS = ("initial_gamma", "probe_every", "probe_growth")  # integers >= 1


def check_rules(rules: AdaptiveRules) -> None:
  """A ValueError naming the first AdaptiveRules field out of its type or range (a string
  where a switch belongs would read as on; a NaN would compare false everywhere)."""
  for f in dataclasses.fields(rules):
    value, name = getattr(rules, f.name), f"AdaptiveRules.{f.name}"
    if f.type in ("bool", bool):
      if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    elif f.name in _RULE_COUNTS:
      if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    elif f.name in _RULE_RANGES:
      low, high, low_ok, high_ok = _RULE_RANGES[f.name]
      if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number))
          or not (math.isfinite(value) or (value == high == math.inf and high_ok))
          or not (low <= value if low_ok else low < value)
          or not (value <= high if high_ok else value < high)):
        top = "" if high == math.inf else f" and {'<=' if high_ok else '<'} {high:g}"
        raise ValueError(f"{name} must be a number {'>=' if low_ok else '>'} {low:g}{top}, "
                         f"got {value!r}")
    elif f.name == "admit":
      if value is not None and not callable(value):
        raise ValueError(f"{name} must be None or a function, got {value!r}")
    else:  # a new field needs a check here
      raise TypeError(f"check_rules has no check for {name}")


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """gamma="auto" with its settings. target_costs: seconds of one target pass at each width
  (same order as widths); draft_cost: seconds of one `propose` of gamma_max drafts;
  first_draft_cost: of one `propose` told to stop after its first draft (max_drafts 1).
  Drafting m drafts is charged by the line through the two (a draft model's steps grow with
  m; a block drafter or lookup costs the same at any m). None: `speculate` measures them
  once (measure_costs), prepare_program uses default_costs; first_draft_cost alone None: half
  of draft_cost."""
  gamma_max: int | None = None  # None: DEFAULT_GAMMA_MAX, or the drafter's max_gamma if less
  widths: tuple[int, ...] | None = None
  target_costs: tuple[float, ...] | None = None
  draft_cost: float | None = None
  first_draft_cost: float | None = None
  rules: AdaptiveRules = AdaptiveRules()
  # a tree drafter's node count (set by configure: widths are then a plain step, 1, and node
  # budgets up to tree_nodes, tree_widths; gamma_max is the tree's depth)
  tree_nodes: int | None = None
  # A plain stretch that runs to the end of the generation leaves the drafter's state behind:
  # nothing drafts again, and its catch-ups cost 5-7% of a 64-row run on the built-in pair.
  # True keeps it caught up, for callers that read the final drafter state (speculate's
  # return_state sets it: keeping_draft_state). A combination's resynced draft model may
  # still lag (its catch-ups wait for its next pass): its cache is valid below its length_B,
  # and its next propose feeds the rest.
  final_draft_state: bool = False
  # The most plain steps one round runs (None: no cap). Streaming sets it to its chunk's
  # rounds: a plain stretch counts its steps as rounds, and one that ran to the end came out
  # as a single chunk. A capped stretch keeps the drafter in step, as final_draft_state does
  # (the next round decides again), and stretches that a cap split add up to the same wait.
  max_stretch: int | None = None
  # Where `speculate` measures the table (target_costs None), True: after the start-up table
  # has shaped the program, time each width again in the program's own executable and run
  # with that table, passed as the program's argument (in_program.measure_in_program). Off
  # by default: on the built-in pair it moved `auto` by a few percent either way (within a
  # process's spread; docs/adaptive_log.md, stop 56), for seconds more start-up.
  in_program_costs: bool = False

  def __post_init__(self):
    # Types here, at construction: resolved() is memoised on equality, where True == 1 ==
    # 1.0, so a config holding a bool would come back as an equal valid one's result.
    if self.widths is not None and (not isinstance(self.widths, (tuple, list)) or not all(
        is_int(w) for w in self.widths) or not self.widths):
      raise ValueError(f"widths must be a tuple of integers (tokens a round verifies), got "
                       f"{self.widths!r}")
    for name in ("final_draft_state", "in_program_costs"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    costs = self.target_costs
    if costs is not None and isinstance(costs, (tuple, list, np.ndarray)):
      for w, c in enumerate(costs):
        if not is_real(c):
          raise ValueError(f"target_costs[{w}] must be a number (a time), got {c!r}")
    for name in ("draft_cost", "first_draft_cost"):
      c = getattr(self, name)
      if c is not None and not is_real(c):
        raise ValueError(f"the draft cost ({name}) must be a number (a time), got {c!r}")

  @property
  def keeps_drafter_in_step(self) -> bool:
    """Whether every plain stretch records its steps for the drafter and catches it up (no
    stretch to the end that leaves it behind, no skipped prefill)."""
    return self.final_draft_state or self.max_stretch is not None

  @memoised_when_hashable
  def resolved(self) -> "AdaptiveConfig":
    """Validated, with defaults filled in (raises ValueError with the reason). Memoised: each
    `speculate` call resolves its config twice, and a generation of ~10 ms on a small model
    feels the ~0.1 ms this takes on a cold host."""
    g = DEFAULT_GAMMA_MAX if self.gamma_max is None else self.gamma_max
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
      raise ValueError(f"gamma_max must be an integer >= 1, got {g!r}")
    if self.tree_nodes is not None:
      if not is_int(self.tree_nodes) or self.tree_nodes < 1:
        raise ValueError(f"tree_nodes must be an integer >= 1, got {self.tree_nodes!r}")
      n = int(self.tree_nodes)
      widths = tree_widths(n) if self.widths is None else tuple(int(w) for w in self.widths)
      if list(widths) != sorted(set(widths)) or widths[0] != 1 or widths[-1] != n:
        raise ValueError(f"a tree round verifies the tree cut to its first w nodes, or runs a "
                         f"plain step (w = 1): widths must be increasing, start at 1 and end "
                         f"at the tree's {n} nodes, got {widths}")
    else:
      widths = default_widths(int(g)) if self.widths is None else tuple(int(w) for w in self.widths)
      if list(widths) != sorted(set(widths)) or widths[0] != 1 or widths[-1] != g + 1:
        raise ValueError(f"widths must be increasing, start at 1 and end at gamma_max + 1 = "
                         f"{g + 1}, got {widths}")
    if self.target_costs is not None:
      check_costs(widths, self.target_costs, 0.0 if self.draft_cost is None else self.draft_cost)
    elif self.draft_cost is not None:
      check_costs(widths, default_costs(widths), self.draft_cost)
    if self.first_draft_cost is not None:
      check_costs(widths, default_costs(widths), self.first_draft_cost, "first_draft_cost")
    if not isinstance(self.rules, AdaptiveRules):  # (whose fields are checked when built)
      raise TypeError(f"rules must be an AdaptiveRules, got {self.rules!r}")
    m = self.max_stretch
    if m is not None and (not is_int(m) or m < 1):
      raise ValueError(f"max_stretch must be None or an integer >= 1, got {m!r}")
    costs = None if self.target_costs is None else tuple(float(c) for c in self.target_costs)
    return dataclasses.replace(self, gamma_max=int(g), widths=widths, target_costs=costs)

  def target_cost_table(self) -> tuple[float, ...]:
    """Target costs per width: the supplied or measured ones, else defaults."""
    return default_costs(self.widths) if self.target_costs is None else self.target_costs

  @functools.cached_property
  def cost_table(self) -> "CostTable":
    """The table a chain round plans from (host-side, static; derived once per config)."""
    target_W = np.asarray(self.target_cost_table(), np.float32)
    return CostTable(target_W, cost_of_lengths(self.widths, target_W),
                     drafting_costs(self.gamma_max, self.draft_cost, self.first_draft_cost))


class CostTable(NamedTuple):
  """A chain round's costs, in seconds. Static (numpy: AdaptiveConfig.cost_table, which the
  program's static decisions read: whether it can ever draft, its probe spacing) or an
  argument of the program (jax arrays, with `force`: what its rounds plan from, carried in
  AdaptiveStats.costs; `arguments` makes one), so a table timed in the executable that runs
  it is not a new program."""
  target_W: Any  # [W] a target pass at each compiled width (widths[0] == 1: a step)
  verify_G1: Any  # [G + 1] the pass that verifies k = 0..G drafts (cost_of_lengths)
  drafting_G: Any  # [G] a propose that makes m = 1..G drafts (drafting_costs)
  # [] int32, in an argument only: -1 the rounds plan freely; 0 they run one plain stretch
  # to the end; k >= 1 every round drafts and verifies k on every active row (the timing of
  # a width in the executable itself: in_program.measure_in_program)
  force: Any = None

  def arguments(self, force: int = -1) -> "CostTable":
    """This table as the program's argument (host numpy: no device op per call)."""
    return CostTable(*(np.asarray(x, np.float32) for x in self[:3]), np.int32(force))

  @property
  def plain(self) -> float:
    return float(self.verify_G1[0])

  @property
  def primary_drafting_G(self):
    """[G] for a drafter with sources (Drafter.has_sources), a round whose rows all take the
    primary: lookup's search and the secondary's catch-up, whatever m. Priced as the
    secondary's first-draft propose (the table's m = 1 point, timed on the secondary: its
    window pass and one draft read from it). The resynced draft model defers that catch-up
    to its next pass (one wider window for several such rounds), so this charges the round
    the feed it defers, and on a small draft model more than its share of that pass."""
    xp = np if isinstance(self.drafting_G, np.ndarray) else jnp
    return xp.full_like(self.drafting_G, self.drafting_G[0])

  @property
  def rounds_G(self) -> np.ndarray:
    """[G] a drafted round of m = 1..G drafts: drafting them and verifying them."""
    return self.verify_G1[1:] + self.drafting_G


def drafting_costs(gamma_max: int, full: float | None, first: float | None) -> np.ndarray:
  """[gamma_max] float32: the cost of a propose that makes m = 1..gamma_max drafts, on the
  line from `first` (m = 1) to `full` (m = gamma_max). first None: half of full (as if half
  of a call were fixed); first above full (timing noise of a drafter whose cost does not
  grow with m): full; gamma_max 1: full."""
  full = float(full or 0.0)
  if gamma_max == 1:
    return np.array([full], np.float32)
  first = 0.5 * full if first is None else min(float(first), full)
  m_G = np.arange(1, gamma_max + 1, dtype=np.float32)
  return (first + (full - first) * (m_G - 1) / (gamma_max - 1)).astype(np.float32)


# The range a target pass's cost (in seconds, or any one unit) may take: the plan divides by
# a plain step and multiplies ratios in float32, where 1e-300 is 0 and 1e300 infinite. A
# drafting cost may be anything from 0 (a drafter that costs nothing) up to MAX_COST.
MIN_COST, MAX_COST = 1e-12, 1e6


def check_cost(value, what: str, *, drafting: bool = False) -> float:
  """One time of a cost table as a float: a number (not a bool or a string) in [MIN_COST,
  MAX_COST], or in [0, MAX_COST] for drafting; ValueError naming `what` otherwise."""
  lowest = 0.0 if drafting else MIN_COST
  if not is_real(value) or not lowest <= value <= MAX_COST:  # (nan and inf fail the range)
    raise ValueError(f"{what} must be a {'' if drafting else 'positive '}finite time from "
                     f"{lowest:g} to {MAX_COST:g}, got {value!r}")
  return float(value)


def check_costs(widths, target_costs, draft_cost, draft_name: str = "draft_cost") -> None:
  """The cost table: one time per width, and the drafting cost (check_cost)."""
  if not isinstance(target_costs, (tuple, list, np.ndarray)) or \
      len(target_costs) != len(widths):
    raise ValueError(f"the cost table needs one target time per width {tuple(widths)}, got "
                     f"{target_costs!r}")
  for w, c in zip(widths, target_costs):
    check_cost(c, f"the cost of width {w}")
  check_cost(draft_cost, f"the draft cost ({draft_name})", drafting=True)


def as_config(gamma, drafter=None) -> AdaptiveConfig | None:
  """gamma="auto" -> the default config; an AdaptiveConfig -> itself; an int -> None. A
  config without gamma_max gets DEFAULT_GAMMA_MAX capped at what the drafter can draft
  (Drafter.max_gamma: MTP's modules, Medusa's heads, a block's slots); an explicit gamma_max
  the drafter cannot hold is its check's error."""
  if isinstance(gamma, str):
    if gamma != "auto":
      raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    gamma = AdaptiveConfig()
  if not isinstance(gamma, AdaptiveConfig):
    return None
  limit = None if drafter is None else drafter.max_gamma
  if gamma.gamma_max is None and limit is not None:
    gamma = dataclasses.replace(gamma, gamma_max=min(DEFAULT_GAMMA_MAX, int(limit)))
  return gamma


def cost_of_lengths(widths, costs) -> np.ndarray:
  """[G + 1]: the cost of verifying k drafts, k = 0..G (the smallest width >= k + 1)."""
  return np.array([costs[next(j for j, w in enumerate(widths) if w >= k + 1)]
                   for k in range(widths[-1])], np.float32)
