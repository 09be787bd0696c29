"""Trained drafters as files and behind the factory: export -> load round trips, bad files and
mismatched targets fail clearly, tree variants from the factory stay lossless, tree drafters
stream, and the generate CLI runs a loaded drafter as a chain and as a tree."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, STORIES_DIR, perturbed, tiny_llama
from spec_jax.models.params_io import CheckpointError
from spec_jax.training import distill
from spec_jax.drafters import (DraftModelTreeDrafter, EagleDrafter, EagleTreeDrafter,
                               MedusaDrafter, MedusaTreeDrafter, MTPDrafter, MTPTreeDrafter)
from spec_jax.drafters.factory import TreeOptions, make_drafter
from spec_jax.drafters.medusa import static_choices
from spec_jax.generate import generate, pad_prompts
from spec_jax.core.sampling import SamplingConfig
from spec_jax.streaming import speculative_chunks
from spec_jax.tree_speculative import tree_speculative_generate

CHAIN = {"medusa": MedusaDrafter, "eagle": EagleDrafter, "mtp": MTPDrafter}


def _trained_looking(own, seed: int):
  """Untrained heads start at the identity (zero kernels); perturb every leaf so a round trip
  that dropped or reordered a tensor could not pass by accident."""
  leaves, treedef = jax.tree.flatten(own)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [x + 0.01 * jax.random.normal(k, x.shape, x.dtype)
                                      for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def exported(stories, tmp_path_factory):
  """kind -> (folder, own params) for every trainable kind, shaped for stories260K."""
  model, _ = stories
  out = {}
  for i, kind in enumerate(("medusa", "eagle", "mtp", "draft_model")):
    spec = distill.make_spec(kind, model, num_heads=3)
    own = _trained_looking(spec.init_params(jax.random.key(i)), seed=i)
    folder = tmp_path_factory.mktemp(kind)
    distill.export_drafter(folder, spec, own)
    out[kind] = (folder, own)
  return out


@pytest.mark.parametrize("kind", ["medusa", "eagle", "mtp", "draft_model"])
def test_export_then_load_gives_identical_params(stories, exported, kind):
  model, params = stories
  folder, own = exported[kind]
  loaded_kind, handle, draft_params = distill.load_drafter(folder, model, params)
  assert loaded_kind == kind
  loaded_own = draft_params if kind == "draft_model" else draft_params.own
  for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(loaded_own), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert json.loads((folder / distill.DRAFTER_JSON).read_text())["format"] == distill.FORMAT


def test_bad_drafter_files_fail_clearly(stories, exported, tmp_path):
  model, params = stories
  folder, _ = exported["eagle"]
  with pytest.raises(CheckpointError, match="not an exported drafter"):
    distill.load_drafter(tmp_path, model, params)
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / distill.DRAFTER_JSON).write_text((folder / distill.DRAFTER_JSON).read_text())
  data = (folder / distill.DRAFTER_WEIGHTS).read_bytes()
  (broken / distill.DRAFTER_WEIGHTS).write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match="truncated or malformed"):
    distill.load_drafter(broken, model, params)
  (broken / distill.DRAFTER_WEIGHTS).write_bytes(data)
  (broken / distill.DRAFTER_JSON).write_text("{not json")
  with pytest.raises(CheckpointError, match="malformed drafter description"):
    distill.load_drafter(broken, model, params)
  # the weights of an EAGLE layer under a Medusa description
  medusa_json = (exported["medusa"][0] / distill.DRAFTER_JSON).read_text()
  (broken / distill.DRAFTER_JSON).write_text(medusa_json)
  with pytest.raises(CheckpointError, match="do not match the medusa config"):
    distill.load_drafter(broken, model, params)


def test_drafter_for_another_target_is_refused(stories, exported):
  model, params = stories
  other, other_params = tiny_llama(vocab_size=model.vocab_size, dim=32)
  with pytest.raises(ValueError, match="reads hidden states of width 64, the target's are 32"):
    distill.load_drafter(exported["eagle"][0], other, other_params)
  small_vocab, small_params = tiny_llama(vocab_size=100, dim=64)
  with pytest.raises(ValueError, match="vocabulary 512 != target vocabulary 100"):
    distill.load_drafter(exported["mtp"][0], small_vocab, small_params)


def test_factory_builds_trained_and_tree_drafters(stories, exported):
  model, params = stories
  for kind, cls in CHAIN.items():
    drafter, _ = make_drafter(kind, model, params, checkpoint=exported[kind][0])
    assert type(drafter) is cls
  tree = TreeOptions(3, 2, 6)
  drafter, _ = make_drafter("eagle", model, params, checkpoint=exported["eagle"][0], tree=tree)
  assert isinstance(drafter, EagleTreeDrafter) and drafter.num_nodes == 6
  drafter, _ = make_drafter("mtp", model, params, checkpoint=exported["mtp"][0], tree=tree)
  assert isinstance(drafter, MTPTreeDrafter) and drafter.max_depth == 3
  drafter, _ = make_drafter("medusa", model, params, checkpoint=exported["medusa"][0], tree=tree)
  assert isinstance(drafter, MedusaTreeDrafter) and drafter.choices == static_choices(tree)
  drafter, _ = make_drafter("draft_model", model, params, draft_model=model, draft_params=params,
                            tree=tree)
  assert isinstance(drafter, DraftModelTreeDrafter)
  with pytest.raises(ValueError, match="holds a eagle drafter, not medusa"):
    make_drafter("medusa", model, params, checkpoint=exported["eagle"][0])
  with pytest.raises(ValueError, match="is trained: pass checkpoint"):
    make_drafter("eagle", model, params)
  with pytest.raises(ValueError, match="has no tree variant"):
    make_drafter("prompt_lookup", model, params, tree=tree)
  with pytest.raises(ValueError, match="depth,top_k,nodes"):
    TreeOptions.parse("4,3")


def test_static_choices_are_prefix_closed_and_sized():
  for tree in (TreeOptions(3, 3, 10), TreeOptions(4, 2, 16), TreeOptions(1, 4, 5)):
    choices = static_choices(tree)
    assert len(choices) == tree.nodes - 1 and len(set(choices)) == len(choices)
    seen = set()
    for path in choices:
      assert len(path) <= tree.depth and max(path) < tree.top_k
      assert len(path) == 1 or path[:-1] in seen  # the parent comes first
      seen.add(path)


def test_factory_tree_drafters_are_lossless(stories, story_prompts, exported):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  reference = generate(model, params, *prompts, max_new_tokens=24, eos_id=1)
  tree = TreeOptions(3, 2, 6)
  for kind in ("medusa", "eagle", "mtp"):
    drafter, dparams = make_drafter(kind, model, params, checkpoint=exported[kind][0], tree=tree)
    out = tree_speculative_generate(model, params, drafter, dparams, *prompts,
                                    max_new_tokens=24, eos_id=1)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens), kind)


def test_tree_drafters_stream_the_same_result(stories, story_prompts):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  drafter = DraftModelTreeDrafter(model, depth=3, top_k=2, nodes=6)
  draft_params = perturbed(params, 0.15)
  kw = dict(max_new_tokens=30, sampling=SamplingConfig(0.9, top_k=20), key=jax.random.key(5))
  whole = tree_speculative_generate(model, params, drafter, draft_params, *prompts, **kw)
  chunks = list(speculative_chunks(model, params, drafter, draft_params, *prompts, gamma=None,
                                   rounds_per_chunk=3, **kw))
  assert len(chunks) > 2
  np.testing.assert_array_equal(np.asarray(chunks[-1].tokens), np.asarray(whole.tokens))
  np.testing.assert_array_equal(np.asarray(chunks[-1].num_tokens), np.asarray(whole.num_tokens))
  with pytest.raises(ValueError, match="pass gamma=None"):
    next(speculative_chunks(model, params, drafter, draft_params, *prompts, gamma=3, **kw))


def test_generate_cli_runs_a_loaded_drafter_as_chain_and_tree(exported):
  model_path = STORIES_DIR / "stories260K.bin"
  base = [sys.executable, str(REPO / "scripts" / "generate.py"), "Once upon a time",
          "--model", str(model_path), "--draft", "eagle", "--draft-checkpoint",
          str(exported["eagle"][0]), "--max-new-tokens", "20", "--compare", "--json"]
  for extra in ([], ["--tree", "3,2,6"]):
    proc = subprocess.run(base + extra, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["identical_to_autoregressive"] is True
    assert report["tree"] == (extra[1] if extra else None)
  proc = subprocess.run(base[:5] + ["--draft", "medusa", "--draft-checkpoint",
                                    str(exported["eagle"][0])],
                        capture_output=True, text=True, cwd=REPO, timeout=600)
  assert proc.returncode != 0 and "holds a eagle drafter, not medusa" in proc.stderr
  # without --gamma, 3 MTP modules draft 3 tokens a round (the default 4 would be refused)
  proc = subprocess.run(base[:5] + ["--draft", "mtp", "--draft-checkpoint",
                                    str(exported["mtp"][0])] + base[9:],
                        capture_output=True, text=True, cwd=REPO, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(proc.stdout)
  assert report["gamma"] == 3 and report["identical_to_autoregressive"] is True


@pytest.mark.parametrize("dtype,tolerance", [("float16", 1e-3), ("int8", 1.5e-2)])
def test_export_in_smaller_dtypes_round_trips_within_rounding(stories, exported, tmp_path,
                                                             dtype, tolerance):
  """float16 / int8 files (int8: matrices with per-column scales) read back as float32 params
  within their rounding, and are smaller than the float32 file."""
  model, params = stories
  _, own = exported["eagle"]
  spec = distill.make_spec("eagle", model)
  folder = distill.export_drafter(tmp_path / dtype, spec, own, dtype=dtype)
  _, _, draft_params = distill.load_drafter(folder, model, params)
  for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(draft_params.own), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert b.dtype == np.float32
    np.testing.assert_allclose(b, a, atol=tolerance * max(float(np.abs(a).max()), 1e-6))
  full = (exported["eagle"][0] / distill.DRAFTER_WEIGHTS).stat().st_size
  assert (folder / distill.DRAFTER_WEIGHTS).stat().st_size < full
  with pytest.raises(ValueError, match="drafter dtype"):
    distill.export_drafter(tmp_path / "bad", spec, own, dtype="int4")


def test_int8_file_without_scales_fails_clearly(stories, exported, tmp_path):
  import safetensors.numpy
  model, params = stories
  folder = distill.export_drafter(tmp_path / "q", distill.make_spec("eagle", model),
                                  exported["eagle"][1], dtype="int8")
  path = folder / distill.DRAFTER_WEIGHTS
  flat = safetensors.numpy.load_file(str(path))
  safetensors.numpy.save_file({k: v for k, v in flat.items() if not k.endswith("int8_scale")},
                              str(path))
  with pytest.raises(CheckpointError, match="lacks scales"):
    distill.load_drafter(folder, model, params)


def test_stdlib_corpus_splits_files_by_path_and_separates_them_with_bos(tmp_path):
  """The built-in pair's text: training windows come from the training files only, held-out
  windows from the held-out files (data.is_heldout by relative path), each file after BOS."""
  from spec_jax.models.builtin import load_builtin
  from spec_jax.training import data
  tokenizer = load_builtin()[4]
  names = [f"mod{i}.py" for i in range(200)]
  held = [n for n in names if data.is_heldout(n)]
  train = [n for n in names if not data.is_heldout(n)][:3]
  assert held, "no held-out name among 200 (crc32 split)"
  texts = {n: f"def f{i}(x):\n    return x + {i}\n" * 40 for i, n in enumerate(train + held[:1])}
  for name, text in texts.items():
    (tmp_path / name).write_text(text)
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "skipped.py").write_text("x = 1\n" * 400)  # an excluded folder
  corpus = distill.stdlib_corpus(tokenizer, seq_len=16, max_heldout=4, root=tmp_path)
  bos = tokenizer.bos_id
  expected_train = np.concatenate(
      [[bos] + tokenizer.encode(texts[n], add_bos=False) for n in train])
  np.testing.assert_array_equal(corpus.stream, expected_train)
  held_ids = [bos] + tokenizer.encode(texts[held[0]], add_bos=False)
  np.testing.assert_array_equal(corpus.heldout.reshape(-1), held_ids[:corpus.heldout.size])
  assert corpus.heldout.shape == (4, 16)
  with pytest.raises(ValueError, match="too little source"):
    distill.stdlib_corpus(tokenizer, seq_len=100_000, root=tmp_path)
