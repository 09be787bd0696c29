"""The drafter protocol: a small bundle of pure functions, in the spirit of optax.

A drafter is a frozen (hashable) dataclass, so it can be a static argument of the jitted
generation; everything that changes lives in its `state` pytree, and its parameters (if
any) are passed in as a traced argument, never baked into the program:

    state = drafter.init(params, prompt)                               # after target prefill
    tokens_BG, probs_BGV | None, state = drafter.propose(params, state, ctx, gamma, sampling, key)
    state = drafter.commit(params, state, outcome)                     # after verification

`probs` are the warped probabilities the drafts were sampled from, or None for
deterministic drafters (the verifier then treats q as one-hot).

THE LOSSLESS CONTRACT. Read this before writing a drafter. Speculative sampling reproduces
the target's distribution exactly for ANY proposal q, provided that:
  1. draft i is drawn from q_i, and q_i is exactly what `propose` returns in probs[:, i]
     (or the drafter is deterministic and returns None: q_i is one-hot at draft i);
  2. q_i depends only on the context (prompt, committed tokens, the drafter's state from
     past rounds) and on the earlier drafts d_1..d_{i-1} of the same round, never on d_i
     itself, on later drafts, or on the target's verdict of this round;
  3. state carried to the next round is updated in `commit` from the true outcome.
A drafter that peeks at the target's logits, or re-ranks drafts after drawing them, breaks
(2) and biases the output; the distribution tests of every family catch that. Trees: the
tree's shape and tokens must be a deterministic function of the context (tree verification
uses one-hot q over siblings). Families declare themselves in spec_jax.drafters.registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.core.errors import BadArgument
from spec_jax.core.pytree_names import check_params_fit
from spec_jax.core.sampling import SamplingConfig, TokenHistory, greedy


@struct.dataclass
class PromptInfo:
  """What a drafter sees at initialisation (inside the jit, after the target's prefill)."""
  tokens_BP: jax.Array  # [B, P] padded prompts
  lengths_B: jax.Array  # [B] prompt lengths
  cache_len: int = struct.field(pytree_node=False)  # slots in every KV cache of this generation
  # target's last hidden states over the prompt; for a drafter with feature_layers, followed
  # along the last axis by those layers' outputs: [B, P, (1 + n) * D] (target_with_features)
  target_hidden_BPD: jax.Array | None = None


@struct.dataclass
class SampledHindsight:
  """What a sampled run's catch-up needs to say, in hindsight, how often a round started at
  a past position would have accepted its first draft (Drafter.catch_up_with_hindsight).

  A draft x ~ q is accepted with probability min(1, p(x) / q(x)), on average sum_x min(p, q).
  The token y that a plain step drew from the target's p is a sample of p, and
  E_y~p[min(1, q(y) / p(y))] = sum_y min(p(y), q(y)): so min(1, q(y) / p(y)) at each past
  position is an unbiased estimate of that position's acceptance, read from the target's
  probability of the token it drew (recorded by each plain step) and the draft's of the
  same token. Past positions only: lossless."""
  # [B, S] float32: the target's warped probability of the token at each position, written
  # by the plain steps that drew it (SpecState.followed_prob_BS; other positions unread)
  followed_prob_BS: jax.Array
  sampling: SamplingConfig = struct.field(pytree_node=False)  # how q is warped (no history)


@struct.dataclass
class DraftContext:
  """The state of generation at the start of a round."""
  seq_BS: jax.Array  # [B, S] prompt + generated tokens; the pending token is the last one
  position_B: jax.Array  # [B] position of the pending token (== target cache length)
  pending_B: jax.Array  # [B] newest token: generated, not yet seen by the target
  # What process_logits reads for the token after pending (penalties, min_new_tokens); None
  # when the sampling settings process nothing. Drafts drawn from processed logits are
  # accepted more often; the verifier stays exact either way (it gets the q drawn from).
  history: TokenHistory | None = None
  # [] int32, or None: drafts past this many will not be verified this round (the adaptive
  # rounds' schedule, from past rounds only). A drafter may stop drafting there, as if gamma
  # were this (autoregressive_drafts does); what it returns past it is never read.
  max_drafts: jax.Array | None = None
  # [B] bool, or None: for a drafter with sources (Drafter.has_sources), the rows allowed to
  # draft from the primary (the adaptive rounds' choice by each source's record, from past
  # rounds only); the others draft from the secondary. None: the drafter's own choice.
  primary_B: jax.Array | None = None
  # [] bool, or None: with primary_B, no row drafts from the secondary this round (the rows
  # that do not take the primary are not verified; the secondary only catches up)
  secondary_off: jax.Array | None = None
  # a sampled run's catch-up in hindsight (Drafter.has_sampled_hindsight): what it scores
  # its drafts with; None in greedy runs (agreement with the target's greedy token)
  sampled_hindsight: SampledHindsight | None = None


@struct.dataclass
class RoundOutcome:
  """What verification decided, given to `commit`."""
  context: DraftContext  # the context the round started from
  draft_tokens_BG: jax.Array
  num_accepted_B: jax.Array  # [B] drafts kept
  next_token_B: jax.Array  # [B] correction or bonus token: the next round's pending token
  new_target_length_B: jax.Array  # [B] target cache length after the round
  target_hidden_BG1D: jax.Array | None = None  # target's hidden states over [pending, drafts]
  # Tree rounds (spec_jax.tree_speculative): node indices of the accepted path, root first
  # [B, max_depth + 1]; draft_tokens_BG and target_hidden_BG1D are then the tokens and
  # hidden states along that path (entries past num_accepted are padding). None for chains.
  tree_path_BR1: jax.Array | None = None


# Positions a catch-up after a plain stretch reports its greedy guesses at (the last ones;
# Drafter.catch_up_with_hindsight). Without them a catch-up only writes keys and values (its
# last layer's attention output, MLP and head are dead code): on stories260K guesses at the
# 33 positions of a 32-step stretch cost EAGLE's catch-up ~4 plain steps, at 8 under one.
HINDSIGHT_WIDTH = 8


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class. Subclasses override init / propose / commit and set vocab_size."""
  is_tree = False  # a chain drafter: `propose` drafts gamma tokens (class attribute, not a field)
  # Target layers whose outputs the drafter reads (static; a property or class attribute).
  # When set, the generation runs the target asked for them, and every target hidden state
  # the drafter gets (PromptInfo, RoundOutcome) is [last ; layer l_1 ; ... ; layer l_n].
  feature_layers = ()  # tuple[int, ...]; not a dataclass field (no annotation)

  @property
  def vocab_size(self) -> int | None:
    return None  # None: proposes ids from the target's own vocabulary (e.g. prompt lookup)

  @property
  def max_gamma(self) -> int | None:
    """The most drafts a chain round can hold (heads, modules, a block's slots); None: any.
    gamma="auto" drafts up to min(its default gamma_max, this). `check` enforces it."""
    return None

  @property
  def max_gamma_reason(self) -> str:
    """Why max_gamma is the limit, for check's message (e.g. "one draft per head")."""
    return "its limit"

  def check(self, target, gamma: int) -> None:
    """Host-side validation against the target, before anything is compiled."""
    if self.vocab_size is not None and self.vocab_size != target.vocab_size:
      raise ValueError(f"drafter vocabulary ({self.vocab_size}) differs from the target's "
                       f"({target.vocab_size}); draft and target must share one tokenizer")
    limit = self.max_gamma
    if limit is not None and gamma > limit:
      raise ValueError(f"{type(self).__name__} drafts at most {limit} tokens per round "
                       f"({self.max_gamma_reason}), got gamma={gamma}")
    check_feature_layers(self.feature_layers, target, type(self).__name__)

  def check_context(self, positions: int) -> None:
    """Host-side, per call: a drafter with a model of its own (`model` with max_seq_len) runs
    it at the run's positions (prompt width + max_new_tokens; drafts past a row's budget are
    never kept), which must lie inside that model's context, as the target's must
    (check_generation_args): past it a model's positions mean nothing."""
    limit = getattr(getattr(self, "model", None), "max_seq_len", None)
    if limit is not None and positions > limit:
      raise BadArgument(f"prompt width + new tokens = {positions} positions is longer than "
                        f"the context of {type(self).__name__}'s model ({limit}): use fewer "
                        "new tokens or shorter prompts, or a draft model with a longer context")

  def check_params(self, params, signature: tuple | None = None) -> None:
    """Host-side: `params` fit this drafter's model (names and shapes), before tracing.
    By default the drafter's `model`, if it has abstract_params, against params (or their
    trainable `own` part, for heads that borrow the target's); override to check more.
    `signature`: params_signature(params), when the caller has it."""
    model = getattr(self, "model", None)
    own = getattr(params, "own", params)
    check_params_fit(model, own, what=f"draft params for {type(self).__name__}",
                     signature=signature if own is params else None)

  def extra_slots(self, gamma: int) -> int:
    """Cache slots past prompt width + max_new_tokens that a round needs. A chain needs none:
    its token at position p lives in slot p, so a block's slots past the cache belong to
    positions past every row's budget, whose writes are dropped and whose outputs nobody
    keeps (a tree, whose node slots run ahead of their positions, overrides this)."""
    return 0

  def init(self, params, prompt: PromptInfo) -> Any:
    raise NotImplementedError

  def propose(self, params, state, ctx: DraftContext, gamma: int, sampling: SamplingConfig,
              key: jax.Array):
    raise NotImplementedError

  def commit(self, params, state, outcome: RoundOutcome) -> Any:
    return state

  def catch_up(self, params, state, ctx: DraftContext, gamma: int, sampling: SamplingConfig,
               key: jax.Array) -> Any:
    """A state `propose` can go on from, for a round in which no row uses this drafter's
    drafts (a combination verifies another drafter's on every row). By default: propose and
    drop the drafts; a drafter with a cheaper way to keep its state right overrides this (the
    resynced draft model of a combination defers it: its next pass feeds what it missed)."""
    return self.propose(params, state, ctx, gamma, sampling, key)[2]

  @property
  def skips_rounds(self) -> bool:
    """Whether `catch_up_after` can stand in for `catch_up` over a stretch of rounds (below).
    False by default: the adaptive rounds then call `catch_up` in every undrafted round."""
    return False

  def catch_up_after(self, params, state, ctx: DraftContext, rounds: int, gamma: int) -> Any:
    """A state `propose` can go on from at `ctx`, after at most `rounds` (static) plain target
    steps in which this drafter was not called at all (no propose, catch_up or commit; only
    record_plain_step), following a round of `gamma` drafts (or the prompt, or another
    stretch). Adaptive speculation's plain steps call it once after such a stretch instead
    of catching up every step: a draft model then feeds the stretch's tokens in one pass
    instead of one small pass per token. Only for drafters whose `skips_rounds` is True."""
    raise NotImplementedError(f"{type(self).__name__} does not skip rounds")

  @property
  def has_hindsight(self) -> bool:
    """Whether catch_up_with_hindsight reports how greedy drafts would have fared."""
    return False

  def catch_up_with_hindsight(self, params, state, ctx: DraftContext, rounds: int,
                              gamma: int) -> tuple[Any, jax.Array | None]:
    """catch_up_after, and what it saw: agree_BA [B, A] bool, A = min(rounds + 1,
    HINDSIGHT_WIDTH), entry w whether the draft this drafter makes greedily after the known
    tokens up to position L - A + w (teacher-forced on them) is the token that followed (the
    stretch's last A positions: the catch-up writes every position's keys and values, but
    its outputs, the costly part of a pass, only at those). In a greedy
    run that is whether a round started there would have accepted that draft, and, for a
    drafter whose later drafts read only the tokens before them (a draft model), draft j of
    a round whose earlier drafts were accepted: the adaptive rounds learn their estimates
    from it over a plain stretch instead of probing (spec_jax.adaptive). None: not known
    (has_hindsight False). With ctx.sampled_hindsight (a sampled run, only for drafters
    with has_sampled_hindsight), agree_BA is float32 in [0, 1]: each position's estimated
    acceptance, min(1, q(y) / p(y)) (SampledHindsight)."""
    return self.catch_up_after(params, state, ctx, rounds, gamma), None

  @property
  def has_sampled_hindsight(self) -> bool:
    """Whether catch_up_with_hindsight also scores sampled runs (ctx.sampled_hindsight):
    its catch-up has the draft's logits at the positions it reports."""
    return False

  def init_with_first_logits(self, params, prompt: PromptInfo, positions_BA: jax.Array
                             ) -> tuple[Any, jax.Array | None, jax.Array | None]:
    """init, logits_BAV [B, A, V]: the logits the first draft of a round whose pending token
    sat at prompt position positions_BA[b, a] would be drawn from (teacher-forced on the
    prompt up to it; positions < lengths_B), and has_BA [B, A] bool, given with the logits:
    where it has such a draft (not at position 0 for EAGLE, DFlash and DSpark, which start
    no round with nothing before it; Medusa only where the prompt's pending token is the
    target's greedy one). The adaptive rounds compare them with the target's logits there,
    a look in hindsight before the first round (AdaptiveProgram.prompt_look; only what
    exists before any draft: lossless). A drafter with hindsight (catch_up_with_hindsight)
    whose prefill yields them cheaply overrides this and sets guesses_at_init; (init,
    None, None): not known. A deterministic drafter may give its drafts instead, int
    [B, A], -1 where it has none (prompt lookup: drafters.common.first_draft_scores)."""
    del positions_BA
    return self.init(params, prompt), None, None

  def init_with_guesses(self, params, prompt: PromptInfo,
                        positions_BA: jax.Array) -> tuple[Any, jax.Array | None]:
    """init, and guesses_BA [B, A] int32: the first draft this drafter would make greedily
    in those rounds (init_with_first_logits), -1 where it has none; None: not known."""
    state, logits_BAV, has_BA = self.init_with_first_logits(params, prompt, positions_BA)
    if logits_BAV is None:
      return state, None
    if jnp.issubdtype(logits_BAV.dtype, jnp.integer):  # a deterministic drafter's drafts
      return state, jnp.where(has_BA, logits_BAV.astype(jnp.int32), -1)
    return state, jnp.where(has_BA, greedy(logits_BAV).astype(jnp.int32), -1)

  @property
  def guesses_at_init(self) -> bool:
    """Whether init_with_first_logits gives logits (static: the adaptive program decides
    whether to look at the prompt without tracing the drafter's prefill a second time)."""
    return False

  @property
  def hindsight_speaks_for_later_drafts(self) -> bool:
    """Whether catch_up_with_hindsight's agreements also measure a round's later drafts:
    True where draft j, after accepted drafts, is the teacher-forced guess (a draft model
    reads only tokens); False where only the first draft is (EAGLE's later drafts read its
    own predicted features, not the target's): the later estimates then learn from verified
    rounds alone."""
    return True

  def record_plain_step(self, params, state, hidden_BD: jax.Array, position_B: jax.Array,
                        fed_B: jax.Array) -> Any:
    """After each plain target step of a stretch (see catch_up_after): the target's hidden
    state [B, D] at the token it fed at position_B, on rows with fed_B ([B] bool). A drafter
    that reads target hidden states by position keeps it here (what commit does for a
    verified round); by default the state is unchanged."""
    return state

  def acceptance_estimates(self, state) -> jax.Array | None:
    """[B, gamma] float in [0, 1], from the state `propose` returned: the drafter's estimate
    that draft i is accepted once drafts before it were (e.g. DSpark's confidence head); the
    adaptive rounds (gamma="auto", spec_jax.adaptive) truncate blocks with it. Entry i may
    depend only on what exists before draft i is drawn (context, earlier drafts, draft i's
    distribution), never on draft i itself or later drafts. None: no such head (the rounds
    then use the top draft probability and the acceptance history)."""
    return None

  @property
  def has_sources(self) -> bool:
    """Whether this drafter draws each row's drafts from one of two sources, chosen per row
    and round from the context alone (a combination: prompt lookup where it matches, else a
    model). gamma="auto" then keeps an acceptance record per source, prices a round whose
    rows all take the primary one at that one's drafting cost, and ends a plain stretch
    when the primary could pay (spec_jax.adaptive)."""
    return False

  def primary_rows(self, params, state, ctx: DraftContext) -> jax.Array:
    """[B] bool, for a drafter with sources: the rows whose drafts `propose` at ctx would
    take from the primary source. It may read only the context (known before anything is
    drawn), so a round may plan by it and stay lossless."""
    raise NotImplementedError(f"{type(self).__name__} has one source of drafts")

  def primary_hindsight(self, ctx: DraftContext, width: int) -> tuple[jax.Array, jax.Array]:
    """For a drafter with sources whose primary needs no state (lookup): (agree_BA, found_BA)
    [B, width] over the last `width` positions before ctx's pending one: whether the
    primary would have drafted there (found) and its first draft was the token that
    followed (agree). A plain stretch learns the primary's record from it, as it learns
    the secondary's from catch_up_with_hindsight, and so does a drafted round on the rows
    that drafted from the secondary (greedy or sampled: a copy is one-hot, so agreement with
    a token drawn from the target's p estimates its acceptance, p(copy))."""
    raise NotImplementedError(f"{type(self).__name__} has one source of drafts")

  def propose_for_timing(self, params, state, ctx: DraftContext, gamma: int,
                         sampling: SamplingConfig, key: jax.Array):
    """The propose a cost table times (spec_jax.adaptive.measure_costs): `propose`, or for
    a drafter with sources its secondary one on every row (which source a row takes at the
    timed state depends on the prompt; the primary's rounds are priced apart)."""
    return self.propose(params, state, ctx, gamma, sampling, key)

  def empty_rows(self, state) -> jax.Array | None:
    """[B] bool, from the state `propose` returned: rows whose drafts are placeholders (the
    drafter found nothing to propose). None: every row always drafts.

    When every row is empty, the round runs one target step instead of a (gamma + 1)-token
    pass: not verifying placeholders is as exact as rejecting them.
    """
    return None


@dataclasses.dataclass(frozen=True)
class TreeDrafter(Drafter):
  """A drafter that proposes a token tree (spec_jax.tree.TokenTree) instead of a chain:

      tree, state = drafter.propose_tree(params, state, ctx, sampling, key)

  Node 0 of the tree is the pending token ctx.pending_B. `num_nodes` and `max_depth` are
  static; commit receives a RoundOutcome whose draft tokens and target hidden states are
  those along the accepted path (see RoundOutcome.tree_path_BR1).
  """
  is_tree = True

  @property
  def num_nodes(self) -> int:
    raise NotImplementedError

  @property
  def max_depth(self) -> int:
    raise NotImplementedError

  def extra_slots(self, gamma: int) -> int:
    return self.num_nodes  # the target writes the whole tree past the committed prefix

  def propose_tree(self, params, state, ctx: DraftContext, sampling: SamplingConfig,
                   key: jax.Array):
    raise NotImplementedError

  def catch_up(self, params, state, ctx: DraftContext, gamma: int, sampling: SamplingConfig,
               key: jax.Array) -> Any:
    """As Drafter.catch_up (gamma: the tree's max depth): by default propose the tree and
    drop it."""
    return self.propose_tree(params, state, ctx, sampling, key)[1]


def check_feature_layers(layers: tuple[int, ...], target, who: str) -> None:
  """Host-side: the target can return the outputs of `layers` (ids inside its stack)."""
  if not layers:
    return
  if not hasattr(target, "with_feature_layers"):
    raise ValueError(f"{who} reads the outputs of target layers {layers}, but the target "
                     f"({type(target).__name__}) cannot return them (no with_feature_layers)")
  num_layers = target.config.n_layers if getattr(target, "num_layers", None) is None \
      else target.num_layers
  beyond = [i for i in layers if not 0 <= i < num_layers]
  if beyond:
    raise ValueError(f"{who} reads target layers {layers}, but the target has {num_layers} "
                     f"layers (ids 0..{num_layers - 1}): it was made for a deeper target")


def target_with_features(target, drafter: Drafter):
  """The target as the generation must run it for `drafter`: asked for the outputs of the
  drafter's feature_layers (hidden = [last ; those layers] along the feature axis), or the
  target itself when the drafter names none, so that program is unchanged."""
  layers = tuple(drafter.feature_layers)
  if not layers:
    return target
  return target.with_feature_layers(layers)
