"""The bottom layer: primitives that the model code and the decoding machinery both use.

  kv_cache   the explicit, fixed-shape KV cache pytree and its masks
  quantize   weight-only int8 params and the `dense` product every model multiplies through
  sampling   SamplingConfig, the logit warpers, greedy and categorical draws
  interface  the CausalLM protocol (the functional model interface)

Imports point one way (tests/test_layering.py): spec_jax.core imports nothing else from
spec_jax; spec_jax.models imports only spec_jax.core; the decoding loops and drafters sit
above both; training (optax, orbax) stands beside inference and inference never imports it.

Shape letters used in names across the codebase (docs/design.md has the full legend):
  B batch rows   T tokens in a pass   S cache slots / buffer length   P padded prompt width
  V vocabulary   D model width        H attention heads   K key/value heads   E head_dim
  L layers       G draft length (gamma)   N tree nodes (or flattened rows)   W window
"""
