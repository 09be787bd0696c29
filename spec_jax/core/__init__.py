"""The bottom layer: primitives that the model code and the decoding machinery both use.

  kv_cache   the explicit, fixed-shape KV cache pytree and its masks
  quantize   weight-only int8 params and the `dense` product every model multiplies through
  sampling   SamplingConfig, the logit warpers, greedy and categorical draws
  interface  the CausalLM protocol (the functional model interface)
  pytree_names  dotted parameter names and the one names-and-shapes check

Imports point one way (tests/test_layering.py): spec_jax.core imports nothing else from
spec_jax; spec_jax.models imports only spec_jax.core; the decoding loops and drafters sit
above both; training (optax, orbax) stands beside inference and inference never imports it.

Shape letters: array names end in their axes, in order (logits_BTV is [batch, tokens, vocab]);
one legend for the whole codebase (docs/design.md, "Shape letters"):
  B  batch rows                      T  tokens in one model pass; the tokens a step emits
  S  cache slots (slot = position); the token buffer's length
  P  padded prompt width             V  vocabulary
  D  model width (hidden, features)  L  layers
  H  query heads                     K  key/value heads
  Q  query heads per KV head (H = K * Q)
  E  head_dim                        I, O  a kernel's input and output features
  G  draft length gamma; G1 = gamma + 1 (the pending token and the drafts)
  N  tree nodes; outside trees, any flat count (flattened rows, a token stream)
  R  tree depth (max_depth); R1 = depth + 1 (a root-first path)
  M  slots of a tree block (the keys a tree mask covers)
  C  children per expanded tree node (top-k ranks)
  W  a window of recent positions a drafter re-runs
  X  any other axes: whatever a generic helper is given (logits_XV, local_BX)
A digit is a literal size (B1 is [B, 1]) except in G1 and R1. Any other letter is local: the
module or function that uses it says what it means.
"""
