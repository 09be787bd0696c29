"""The drafter registry: every drafter family declared once, in its own file, and registered.

A family file (e.g. spec_jax/drafters/medusa.py) ends with

    register(DrafterFamily(name="medusa", summary=..., trained=Trained(...)))

and spec_jax/drafters/__init__.py imports it (one line). Everything else reads the registry:
`make_drafter`, the drafter file format (spec_jax.drafters.files: export, read, load and
check), distillation (spec_jax.training.distill: new models, losses), the command lines'
choices and the drafter table. No other code compares kind strings.

What a family declares:
  build      in-memory construction from a target (and a draft model, options): the chain
             drafter, or its tree drafter when `opts.tree` is set (families with tree=True)
  trained    for families with learned weights: how to make a model for a target, rebuild it
             from drafter.json, the chain and tree drafters over it, its training loss, which
             target widths it reads (file checks), and its draft-length limit
  combinable its drafter may be the model side of a combination "<combinator>+<name>"
  combine    a combinator (e.g. "lookup"): builds the combination from the other drafter

The lossless contract every family keeps is stated in spec_jax.drafters.base.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

# --- options ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TreeOptions:
  """A token tree's budget: `depth` levels, `top_k` children per expanded node, `nodes`
  nodes in all (root included)."""
  depth: int = 4
  top_k: int = 3
  nodes: int = 16

  @classmethod
  def parse(cls, text: str) -> "TreeOptions":
    """'depth,top_k,nodes', e.g. '4,3,16'."""
    try:
      depth, top_k, nodes = (int(x) for x in text.split(","))
    except ValueError:
      raise ValueError(f"a tree is 'depth,top_k,nodes' (e.g. 4,3,16), got {text!r}") from None
    return cls(depth, top_k, nodes)


@dataclasses.dataclass(frozen=True)
class BuildOptions:
  """What make_drafter hands every family; a family ignores the options it does not use."""
  draft_model: Any = None  # a CausalLM handle (draft_model family)
  draft_params: Any = None
  num_layers: int | None = None  # layer skip: the target's first k layers
  max_ngram: int = 3  # prompt lookup
  min_ngram: int | None = None  # prompt lookup (None: the family's or combination's default)
  tree: TreeOptions | None = None  # ask for the family's tree drafter


@dataclasses.dataclass(frozen=True)
class DrafterSizes:
  """The size of a new trained drafter (training): heads or modules, width, layers, MLP."""
  num_heads: int = 4  # Medusa heads, MTP modules
  dim: int | None = None  # draft model width (default: half the target's)
  layers: int = 1  # draft model layers
  hidden: int | None = None  # MLP width (default: the family's)

  def layer_overrides(self) -> dict:
    """LlamaConfig fields a family's layers take from these sizes (the MLP width, if set)."""
    return {} if self.hidden is None else {"hidden_dim": self.hidden}


@dataclasses.dataclass(frozen=True)
class Trained:
  """How a family with learned weights builds, stores, checks and trains its model.

  new_model(target, sizes)          a fresh model shaped for `target` (training)
  model_from_config(config dict)    the model drafter.json describes (may raise KeyError,
                                    TypeError, ValueError: reported as a malformed file)
  config_of(model)                  the config dict drafter.json stores
  chain(model) / tree(model, opts)  its drafters (tree None: no tree variant)
  loss(model, draft_params, target_outputs, rng, **options) -> (loss, metrics)
  reads_target_head                 draft params = HeadParams(own, the target's embedding and
                                    head), not stored in its file
  hidden_width(model)               width of the target hidden states it reads (None: none)
  """
  new_model: Callable[[Any, DrafterSizes], Any]
  model_from_config: Callable[[dict], Any]
  chain: Callable[[Any], Any]
  loss: Callable[..., tuple]
  tree: Callable[[Any, TreeOptions], Any] | None = None
  config_of: Callable[[Any], dict] = lambda model: dataclasses.asdict(model.config)
  reads_target_head: bool = True
  hidden_width: Callable[[Any], int] | None = None


@dataclasses.dataclass(frozen=True)
class DrafterFamily:
  name: str
  summary: str  # one line, for --help and the docs
  build: Callable[[Any, Any, BuildOptions], tuple[Any, Any]] | None = None
  trained: Trained | None = None
  tree: bool = False  # has a token-tree drafter (build or trained.tree honours opts.tree)
  # its chain drafter may be a combination's other side: a draft model (resynced there), or
  # a drafter whose state follows the target's verified tokens and hidden states alone
  combinable: bool = False
  # a combinator: (the other family's chain drafter, its params, options) -> (drafter, params)
  combine: Callable[[Any, Any, BuildOptions], tuple[Any, Any]] | None = None
  # its drafter reads the target model (its layers, head or config); False: built without it
  reads_target: bool = True
  # the BuildOptions fields its builder reads besides the tree (command lines refuse the
  # flags of the others); "draft_model": it needs one, or a trained checkpoint
  options: tuple[str, ...] = ()


_FAMILIES: dict[str, DrafterFamily] = {}


def register(family: DrafterFamily) -> DrafterFamily:
  if family.name in _FAMILIES:
    raise ValueError(f"drafter family {family.name!r} is registered twice")
  if "+" in family.name:
    raise ValueError(f"a family name cannot contain '+': {family.name!r}")
  _FAMILIES[family.name] = family
  return family


def families() -> dict[str, DrafterFamily]:
  """name -> family, in registration order (combinators included)."""
  return dict(_FAMILIES)


def kinds() -> tuple[str, ...]:
  """Every kind make_drafter accepts: each family, and each combinator with each combinable
  family ("lookup+layer_skip")."""
  plain = [f.name for f in _FAMILIES.values() if f.combine is None]
  combos = [f"{c.name}+{f.name}" for c in _FAMILIES.values() if c.combine is not None
            for f in _FAMILIES.values() if f.combinable]
  return tuple(plain + combos)


def trained_kinds() -> tuple[str, ...]:
  return tuple(f.name for f in _FAMILIES.values() if f.trained is not None)


def tree_kinds() -> tuple[str, ...]:
  return tuple(f.name for f in _FAMILIES.values() if f.tree)


def family(name: str) -> DrafterFamily:
  if name not in _FAMILIES or _FAMILIES[name].combine is not None:
    raise ValueError(f"unknown drafter kind {name!r}; one of {', '.join(kinds())}")
  return _FAMILIES[name]


def trained_family(name: str) -> DrafterFamily:
  fam = _FAMILIES.get(name)
  if fam is None or fam.trained is None:
    raise ValueError(f"unknown trained drafter kind {name!r}; one of "
                     f"{', '.join(trained_kinds())}")
  return fam


def resolve(kind: str) -> tuple[DrafterFamily, DrafterFamily | None]:
  """kind -> (family, None), or (combinator, combined family) for "<combinator>+<family>"."""
  if kind not in kinds():
    raise ValueError(f"unknown drafter kind {kind!r}; one of {', '.join(kinds())}")
  head, plus, rest = kind.partition("+")
  if plus:
    return _FAMILIES[head], _FAMILIES[rest]
  return _FAMILIES[kind], None


def model_family(kind: str) -> DrafterFamily:
  """The family that makes a kind's model and reads its files: the kind's own, or a
  combination's other side ("lookup+eagle": eagle)."""
  fam, combined = resolve(kind)
  return combined or fam
