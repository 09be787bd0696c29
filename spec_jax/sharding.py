"""Sharding: one table from logical axes to mesh axes, and generation under a device mesh.

The mesh has two axes, `data` (batch) and `model` (tensor parallelism). `ShardingRules` is
the table: each logical axis (embed, q_heads, kv_heads, head_dim, mlp, vocab, batch) maps
to a mesh axis or to None (replicated). Parameters get their logical axes from their names
(`PARAM_AXES`), so the target is tensor-parallel in the Megatron layout: q/k/v, gate and
up projections split their output (heads, mlp) over `model`; wo and w_down split their
input; the vocabulary splits the embedding and the head. The draft is replicated.

Axes are `AxisType.Auto` (see docs/design.md, "Sharding"): parameters and inputs are placed
explicitly, and the compiler propagates shardings through the model. The KV caches, the
loop's biggest carry, are pinned with `with_sharding_constraint` at every model call by
`ShardedModel`, a thin wrapper around the model, so their sharding is the same when the
loop starts and after each round. Multi-host: the same code in every process (see
spec_jax.distributed and docs/sharding.md).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from spec_jax import adaptive
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.generate import generate_jit, budgets_array, check_generation_args, key_and_eos
from spec_jax.core.kv_cache import KVCache
from spec_jax.core.pytree_names import check_names_and_shapes, flatten_with_names, path_to_name
from spec_jax.core.sampling import SamplingConfig
from spec_jax.speculative import SpeculativeProgram, speculative_jit, prepare
from spec_jax.verify import verify

DATA, MODEL = "data", "model"
LOGICAL_AXES = ("embed", "q_heads", "kv_heads", "head_dim", "mlp", "vocab", "batch")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """The table: logical axis -> mesh axis name, or None for replicated.

  A dimension whose size a mesh axis does not divide is an error naming the parameter,
  unless its logical axis is in `replicate_if_indivisible` (then it stays replicated):
  by default KV heads (fewer KV heads than model shards is common with GQA) and the batch.
  `head_dim` is for the KV cache only; projections shard whole heads.
  """
  embed: str | None = None
  q_heads: str | None = MODEL
  kv_heads: str | None = MODEL
  head_dim: str | None = None
  mlp: str | None = MODEL
  vocab: str | None = MODEL
  batch: str | None = DATA
  replicate_if_indivisible: frozenset[str] = frozenset({"kv_heads", "batch"})

  def replace(self, **changes) -> "ShardingRules":
    return dataclasses.replace(self, **changes)


DEFAULT_RULES = ShardingRules()  # target: tensor-parallel over `model`, batch over `data`
DRAFT_RULES = ShardingRules(q_heads=None, kv_heads=None, mlp=None, vocab=None)  # replicated

# Parameter name (see spec_jax.core.pytree_names.path_to_name) -> logical axes of its dimensions.
# Kernels are [in, out]. Fused head dims [heads * head_dim] are named by their heads.
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"embed", ("vocab", "embed")),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r".*attn\.wq\.kernel", ("embed", "q_heads")),
    (r".*attn\.w[kv]\.kernel", ("embed", "kv_heads")),
    (r".*attn\.wo\.kernel", ("q_heads", "embed")),
    (r".*attn\.wq\.bias", ("q_heads",)),
    (r".*attn\.w[kv]\.bias", ("kv_heads",)),
    (r".*mlp\.w_(gate|up)\.kernel", ("embed", "mlp")),
    (r".*mlp\.w_down\.kernel", ("mlp", "embed")),
    # fused projections (LlamaConfig.fused_projections) mix q/k/v or gate/up columns, which
    # the Megatron split cannot cut by heads: they stay whole. Tensor parallelism wants the
    # separate layout; fusing pays on one device.
    (r".*attn\.wqkv\.kernel", ("embed", None)),
    (r".*attn\.wqkv\.bias", (None,)),
    (r".*mlp\.w_gate_up\.kernel", ("embed", None)),
    (r".*norm\.scale", ("embed",)),
)
_HEAD_AXES = ("q_heads", "kv_heads")
# int8 QuantizedArray(OI) leaves (spec_jax.core.quantize): values in the kernel's orientation, and
# one scale per output channel
_QUANT_VALUES, _QUANT_SCALE = ("values_IO", "values_OI"), "scale_O"


# --- mesh ---------------------------------------------------------------------------------

def make_mesh(data: int | None = None, model: int | None = None, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh over all (global) devices, both axes AxisType.Auto.

  Default: `model` spans the devices of one process (fast links within a host), `data`
  the processes. Give one size and the other is the rest.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if model is None and data is None:
    model = n // jax.process_count()
  if model is None:
    model = n // data if data and n % data == 0 else 0
  if data is None:
    data = n // model if model and n % model == 0 else 0
  if data < 1 or model < 1 or data * model != n:
    raise ValueError(f"mesh data={data} x model={model} does not match the {n} devices")
  return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2,
                       devices=devices)


def _mesh_sizes(mesh) -> dict[str, int]:
  return dict(mesh.shape)  # Mesh and AbstractMesh alike


# --- the table applied to arrays ------------------------------------------------------------

def _resolve(rules: ShardingRules, logical: str | None, size: int, mesh, what: str) -> str | None:
  """Mesh axis for one dimension: the rule's axis, or None (replicated); checks divisibility."""
  if logical is None:
    return None
  if logical not in LOGICAL_AXES:
    raise ValueError(f"{what}: unknown logical axis {logical!r}")
  axis = getattr(rules, logical)
  if axis is None:
    return None
  sizes = _mesh_sizes(mesh)
  if axis not in sizes:
    raise ValueError(f"{what}: rule maps {logical} to mesh axis {axis!r}, but the mesh has "
                     f"axes {tuple(sizes)}")
  if size % sizes[axis]:
    if logical in rules.replicate_if_indivisible:
      return None
    raise ValueError(f"{what}: {logical} of size {size} is not divisible by mesh axis "
                     f"{axis!r} of size {sizes[axis]}")
  return axis


def _spec(rules: ShardingRules, logical_axes: Sequence[str | None], sizes: Sequence[int], mesh,
          what: str, units: Sequence[str] = ()) -> P:
  """PartitionSpec for dims of the given logical axes and sizes (in `units`, e.g. heads)."""
  axes = []
  for dim, (logical, size) in enumerate(zip(logical_axes, sizes)):
    unit = units[dim] if dim < len(units) and units[dim] else f"size {size}"
    where = f"{what}, dimension {dim} ({unit})"
    axes.append(_resolve(rules, logical, size, mesh, where))
  used = [a for a in axes if a is not None]
  if len(used) != len(set(used)):
    raise ValueError(f"{what}: mesh axis used twice in {tuple(axes)}; fix the rules")
  return P(*axes)


def param_logical_axes(name: str) -> tuple[str, ...]:
  """Logical axes of the parameter leaf `name` (int8 values/scale leaves included)."""
  base, _, last = name.rpartition(".")
  if last not in (*_QUANT_VALUES, _QUANT_SCALE):
    base = name
  out_in = base.endswith(".kernel_OI")  # LlamaConfig.kernels_out_in: the table's, reversed
  if out_in:
    base = base[:-len("_OI")]
  for pattern, axes in PARAM_AXES:
    if re.fullmatch(pattern, base):
      if last == _QUANT_SCALE:  # the table's [in, out] kernel axes: the output one
        return axes[-1:]
      return axes[::-1] if out_in else axes
  raise ValueError(f"parameter {name}: no sharding rule matches it; add a pattern to "
                   "spec_jax.sharding.PARAM_AXES")


def param_spec(name: str, shape: Sequence[int], mesh, rules: ShardingRules = DEFAULT_RULES, *,
               head_dim: int | None = None) -> P:
  """PartitionSpec of one parameter leaf; fused [heads * head_dim] dims shard whole heads."""
  axes = param_logical_axes(name)
  what = f"parameter {name}"
  if len(axes) != len(shape):
    raise ValueError(f"{what}: shape {tuple(shape)} has {len(shape)} dimensions, the table "
                     f"names {len(axes)} {axes}")
  sizes, units = list(shape), [""] * len(shape)
  for dim, logical in enumerate(axes):
    if logical not in _HEAD_AXES or getattr(rules, logical) is None:
      continue
    if head_dim is None or shape[dim] % head_dim:
      raise ValueError(f"{what}, dimension {dim} (size {shape[dim]}): sharding {logical} needs "
                       f"a head_dim that divides it (got head_dim={head_dim})")
    sizes[dim] = shape[dim] // head_dim
    units[dim] = f"size {shape[dim]} = {sizes[dim]} heads of {head_dim}"
  return _spec(rules, axes, sizes, mesh, what, units)


def param_specs(params, mesh, rules: ShardingRules = DEFAULT_RULES, *,
                head_dim: int | None = None):
  """A pytree like `params` with the PartitionSpec of every leaf (validated)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: param_spec(path_to_name(path), leaf.shape, mesh, rules,
                                    head_dim=head_dim), params)


def put(x, sharding: NamedSharding) -> jax.Array:
  """Places an array (host or device, the same value in every process) into `sharding`.

  Works across processes: each process fills only the shards on its own devices.
  """
  if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)  # one process, or a global array: a resharding
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, *,
                 head_dim: int | None = None):
  """Places every leaf of `params` as the table says (raises if a dimension does not divide).

  `head_dim` (e.g. `model.config.resolved_head_dim`) lets heads be counted in the fused
  [heads * head_dim] projection dims, so each shard holds whole heads.
  """
  specs = param_specs(params, mesh, rules, head_dim=head_dim)
  return jax.tree.map(lambda leaf, spec: put(leaf, NamedSharding(mesh, spec)), params, specs)


def replicate(tree, mesh: Mesh):
  """Every leaf replicated on every device of the mesh (the default for draft params)."""
  return jax.tree.map(lambda leaf: put(leaf, NamedSharding(mesh, P())), tree)


def _head_dim(model) -> int | None:
  config = getattr(model, "config", None)
  return getattr(config, "resolved_head_dim", None)


def sharding_for_checkpoint(model, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> dict:
  """{name: ...: NamedSharding} nested like a native checkpoint, for load_native(sharding=).

  Orbax then reads each array straight into its shards, never whole onto one device.
  `model` must be the checkpoint's own (e.g. `LlamaModel(read_config(folder))`).
  """
  tree: dict[str, Any] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(model.abstract_params()):
    name = path_to_name(path)
    *parents, last = name.split(".")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = NamedSharding(mesh, param_spec(name, leaf.shape, mesh, rules,
                                                head_dim=_head_dim(model)))
  return tree


def load_sharded(folder: str, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, *,
                 dtype: str | None = None, expect=None):
  """Restores a native checkpoint straight into the mesh -> (model, sharded params).

  `expect`: a model the checkpoint must match (same parameter names and shapes).
  """
  from spec_jax.models.llama import LlamaModel  # spec_jax proper stays model-agnostic
  from spec_jax.models.native import load_native, read_config
  model = LlamaModel(read_config(folder))  # shapes only: the dtype does not change them
  if expect is not None:
    _check_same_shapes(model, expect, folder)
  return load_native(folder, dtype=dtype, sharding=sharding_for_checkpoint(model, mesh, rules))


def _check_same_shapes(found, expected, source: str) -> None:
  check_names_and_shapes(flatten_with_names(expected.abstract_params()),
                         flatten_with_names(found.abstract_params()),
                         source=f"checkpoint {source}")


# --- caches and batch ---------------------------------------------------------------------

def batch_spec(shape: Sequence[int], mesh, rules: ShardingRules = DEFAULT_RULES) -> P:
  """Batch-major arrays ([B, ...]): dim 0 over `data` when it divides, the rest replicated."""
  return _spec(rules, ("batch",) + (None,) * (len(shape) - 1), shape, mesh, "batch array")


def cache_shardings(cache: KVCache, mesh, rules: ShardingRules = DEFAULT_RULES) -> KVCache:
  """KVCache of NamedShardings: batch over data, KV heads over model, slots unsharded.

  k and v are [L, B, K, E, S] (kv_cache.py's layout).
  """
  k = _spec(rules, (None, "batch", "kv_heads", "head_dim", None), cache.k_LBKES.shape, mesh,
            "KV cache (K)")
  v = _spec(rules, (None, "batch", "kv_heads", "head_dim", None), cache.v_LBKES.shape, mesh,
            "KV cache (V)")
  length = batch_spec(cache.length_B.shape, mesh, rules)
  return KVCache(NamedSharding(mesh, k), NamedSharding(mesh, v), NamedSharding(mesh, length))


def constrain_cache(cache: KVCache, mesh, rules: ShardingRules = DEFAULT_RULES) -> KVCache:
  return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh, rules))


@dataclasses.dataclass(frozen=True)
class ShardedModel:
  """A CausalLM whose KV caches are pinned to the mesh at every call (a stable loop carry).

  Hashable like the model it wraps, so it is a static argument of the generation jit.
  Other attributes (config, vocab_size, ...) are the wrapped model's.
  """
  model: Any
  mesh: Mesh
  rules: ShardingRules = DEFAULT_RULES

  def __getattr__(self, name):
    if name in ("model", "mesh", "rules"):  # not yet set (copy, unpickling)
      raise AttributeError(name)
    return getattr(self.model, name)

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def max_seq_len(self) -> int:
    return self.model.max_seq_len

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    return constrain_cache(self.model.init_cache(batch_size, max_len), self.mesh, self.rules)

  def apply(self, params, tokens_BT, positions_BT, cache, **kw):
    logits_BTV, hidden_BTD, cache = self.model.apply(params, tokens_BT, positions_BT, cache, **kw)
    return logits_BTV, hidden_BTD, constrain_cache(cache, self.mesh, self.rules)

  def with_feature_layers(self, layers) -> "ShardedModel":
    """The wrapped model asked for those layers' outputs (its hidden states grow along the
    feature axis, placed as the hidden state is), still pinned to the mesh."""
    return dataclasses.replace(self, model=self.model.with_feature_layers(layers))


def _on_mesh(drafter, mesh: Mesh, rules: ShardingRules):
  """A draft-model drafter with its model wrapped, so the draft cache is pinned too.

  Other drafters (heads, n-grams, layer-skip over the target's own model) are left as
  they are: their state is placed by the compiler, which is correct, if less predictable.
  """
  if not isinstance(drafter, DraftModelDrafter) or isinstance(drafter.model, ShardedModel):
    return drafter
  model_field = next(f for f in dataclasses.fields(drafter) if f.name == "model")
  if not model_field.init:  # derived from other fields (layer-skip)
    return drafter
  return dataclasses.replace(drafter, model=ShardedModel(drafter.model, mesh, rules))


# --- generation under a mesh --------------------------------------------------------------

def _check_on_mesh(tree, mesh: Mesh, what: str) -> None:
  devices = set(mesh.devices.flat)
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(leaf, jax.Array) or set(leaf.sharding.device_set) != devices:
      raise ValueError(f"{what} {path_to_name(path)} is not placed on the mesh; use shard_params "
                       "or replicate first")


def _host_inputs(model, tokens, lengths, *, max_new_tokens, budgets_B, key, sampling, eos_id,
                 pad_id, cache_len):
  """generate()'s host-side checks -> (tokens, lengths, budgets, eos, pad, key, cache_len)."""
  tokens, lengths, cache_len = check_generation_args(
      model, tokens, lengths, max_new_tokens=max_new_tokens, cache_len=cache_len)
  budgets = budgets_array(max_new_tokens, budgets_B, tokens.shape[0])
  key, eos = key_and_eos(sampling, key, eos_id)
  return tokens, lengths, budgets, np.int32(eos), np.int32(pad_id), key, cache_len


def _place_inputs(mesh, rules, tokens, lengths, budgets, eos, pad, key):
  """Batch arrays over `data` (when the batch divides), scalars and the key replicated."""
  def over_batch(x):
    return put(x, NamedSharding(mesh, batch_spec(x.shape, mesh, rules)))
  rep = NamedSharding(mesh, P())
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(np.asarray(key))  # a raw uint32 key: the same stream
  # key data rather than the key: typed keys cannot be built from host data per shard
  key_data = np.asarray(jax.random.key_data(key))
  return (over_batch(tokens), over_batch(lengths), over_batch(budgets), put(eos, rep),
          put(pad, rep), put(key_data, rep)), jax.random.key_impl(key)


def _out_shardings(model: ShardedModel, batch: int, cache_len: int):
  """Outputs replicated (readable in every process); the final cache stays sharded."""
  cache = jax.eval_shape(lambda: model.model.init_cache(batch, cache_len))
  return NamedSharding(model.mesh, P()), cache_shardings(cache, model.mesh, model.rules)


@functools.lru_cache(maxsize=64)
def _ar_program(model: ShardedModel, batch: int, key_impl, max_new_tokens: int, cache_len: int,
                sampling: SamplingConfig):
  def run(params, tokens_BP, lengths_B, budget_B, eos, pad, key_data):
    key = jax.random.wrap_key_data(key_data, impl=key_impl)
    return generate_jit(model, params, tokens_BP, lengths_B, budget_B, eos, pad, key,
                         max_new_tokens=max_new_tokens, cache_len=cache_len, sampling=sampling)
  return jax.jit(run, out_shardings=_out_shardings(model, batch, cache_len))


@functools.lru_cache(maxsize=64)
def _spec_program(program: SpeculativeProgram, batch: int, key_impl):
  def run(params, draft_params, tokens_BP, lengths_B, budget_B, eos, pad, key_data):
    key = jax.random.wrap_key_data(key_data, impl=key_impl)
    return speculative_jit(program, params, draft_params, tokens_BP, lengths_B, budget_B, eos,
                            pad, key)
  out, cache = _out_shardings(program.target, batch, program.cache_len)
  return jax.jit(run, out_shardings=(out, cache, None))  # draft state: as the compiler placed it


def prepare_generate(model, params, prompt_tokens_BP, prompt_lengths_B, *, mesh: Mesh,
                     rules: ShardingRules = DEFAULT_RULES, max_new_tokens: int,
                     sampling: SamplingConfig = SamplingConfig(), eos_id: int | None = None,
                     key: jax.Array | None = None, budgets_B=None, pad_id: int = 0,
                     cache_len: int | None = None):
  """Host-side checks and input placement -> (jitted program, its placed arguments).

  `program(*args)` returns (GenerationOutput, cache); `program.lower(*args)` shows the HLO.
  """
  on_mesh = ShardedModel(model, mesh, rules)
  _check_on_mesh(params, mesh, "parameter")
  tokens, lengths, budgets, eos, pad, key, cache_len = _host_inputs(
      on_mesh, prompt_tokens_BP, prompt_lengths_B, max_new_tokens=max_new_tokens,
      budgets_B=budgets_B, key=key, sampling=sampling, eos_id=eos_id, pad_id=pad_id,
      cache_len=cache_len)
  inputs, key_impl = _place_inputs(mesh, rules, tokens, lengths, budgets, eos, pad, key)
  program = _ar_program(on_mesh, tokens.shape[0], key_impl, int(max_new_tokens), cache_len,
                        sampling)
  return program, (params, *inputs)


def sharded_generate(model, params, prompt_tokens_BP, prompt_lengths_B, *, mesh: Mesh,
                     return_cache: bool = False, **kw):
  """`generate` under `mesh`: same arguments and results, outputs replicated.

  `params` must already be on the mesh (shard_params). Prompts are host arrays, the same
  in every process; the batch is split over `data` when it divides. `rules` (keyword)
  pins the cache as the params are sharded (default DEFAULT_RULES).
  """
  program, args = prepare_generate(model, params, prompt_tokens_BP, prompt_lengths_B,
                                   mesh=mesh, **kw)
  out, cache = program(*args)
  return (out, cache) if return_cache else out


def prepare_speculative(target, params, drafter, draft_params, prompt_tokens_BP,
                        prompt_lengths_B, *, mesh: Mesh, gamma, max_new_tokens: int,
                        rules: ShardingRules = DEFAULT_RULES,
                        draft_rules: ShardingRules = DRAFT_RULES,
                        sampling: SamplingConfig = SamplingConfig(), eos_id: int | None = None,
                        key: jax.Array | None = None, budgets_B=None, pad_id: int = 0,
                        cache_len: int | None = None, verifier=verify,
                        final_draft_state: bool = False):
  """As prepare_generate, for speculative generation -> (program, args).

  gamma: an int, or "auto" / an AdaptiveConfig (spec_jax.adaptive): adaptive rounds, their
  cost table measured once on the mesh, with these params, when the config has none.
  `program(*args)` returns (GenerationOutput, target cache, drafter state); adaptive rounds
  leave that drafter state behind after plain steps that end the generation, unless
  final_draft_state (AdaptiveConfig.final_draft_state).
  """
  on_mesh = ShardedModel(target, mesh, rules)
  _check_on_mesh(params, mesh, "parameter")
  _check_on_mesh(draft_params, mesh, "draft parameter")
  drafter = _on_mesh(drafter, mesh, draft_rules)
  config = adaptive.as_config(gamma, drafter)
  if config is not None:
    if drafter.is_tree:
      raise ValueError("sharded generation runs chain drafters only")
    config = config.resolved()
    gamma = config.gamma_max
  unsharded, host_args = prepare(
      on_mesh, drafter, prompt_tokens_BP, prompt_lengths_B, gamma=gamma,
      max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, key=key,
      budgets_B=budgets_B, pad_id=pad_id, cache_len=cache_len, verifier=verifier)
  if config is not None:
    # (the start-up table alone: the sharded executable is not the one in_program times)
    unsharded = adaptive.with_measured_costs(adaptive.configure(unsharded, config), params,
                                             draft_params, host_args, time_in_program=False)
    if final_draft_state:
      unsharded = adaptive.keeping_draft_state(unsharded)
  inputs, key_impl = _place_inputs(mesh, rules, *host_args)
  return _spec_program(unsharded, host_args[0].shape[0], key_impl), (params, draft_params, *inputs)


def sharded_speculative_generate(target, params, drafter, draft_params, prompt_tokens_BP,
                                 prompt_lengths_B, *, mesh: Mesh, return_state: bool = False,
                                 **kw):
  """`speculative_generate` under `mesh`: same arguments and results, outputs replicated.

  `params` and `draft_params` must already be on the mesh (shard_params / replicate).
  `draft_rules` (keyword) pins the draft model's cache: batch over data, heads replicated
  by default; pass the target's rules when the draft shares the target's sharded params.
  """
  program, args = prepare_speculative(target, params, drafter, draft_params, prompt_tokens_BP,
                                      prompt_lengths_B, mesh=mesh,
                                      final_draft_state=return_state, **kw)
  out, cache, draft_state = program(*args)
  return (out, cache, draft_state) if return_state else out


__all__ = ["DATA", "MODEL", "ShardingRules", "DEFAULT_RULES", "DRAFT_RULES", "PARAM_AXES",
           "make_mesh", "param_logical_axes", "param_spec", "param_specs", "put", "shard_params",
           "replicate", "sharding_for_checkpoint", "load_sharded", "batch_spec",
           "cache_shardings", "constrain_cache", "ShardedModel", "prepare_generate",
           "sharded_generate", "prepare_speculative", "sharded_speculative_generate"]
