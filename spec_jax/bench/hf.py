"""HF transformers (PyTorch) as cases beside ours: the same weights, greedy `generate()`.

torch and transformers are imported inside the functions: only a run that compares with HF
needs them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from spec_jax.bench.cases import Case


@dataclasses.dataclass
class HFOutput:
  tokens: np.ndarray  # [B, N]
  num_tokens: np.ndarray  # [B]
  metrics: Any = None


def hf_case(hf_model, label: str, gen_kwargs: dict, max_new: int, **info) -> Case:
  """Greedy HF `generate()` of exactly `max_new` tokens (no EOS) for batch-1 prompt sets;
  gen_kwargs select its speculative modes (assistant_model, prompt_lookup_num_tokens)."""
  import torch

  def run(tokens, lengths):
    ids = torch.as_tensor(np.asarray(tokens)[:, :int(lengths[0])], dtype=torch.long)
    with torch.inference_mode():
      out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                              min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                              eos_token_id=None, **gen_kwargs)
    new = out[:, ids.shape[1]:].numpy().astype(np.int32)
    return HFOutput(new, np.array([new.shape[1]], np.int32))

  return Case(label, run, None, {"engine": "hf", **info})


def to_hf(model, params, folder: str):
  """Our Llama as an HF float32 model (saved to `folder`, loaded back), EOS off."""
  import torch
  import transformers
  from spec_jax.models.hf import save_hf
  save_hf(folder, model, params)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="sdpa")
  hf.eval()
  hf.generation_config.eos_token_id = None
  hf.generation_config.pad_token_id = 0
  return hf
