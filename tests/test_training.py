"""spec_jax.training (losses, optimiser, loop, checkpoints), spec_jax.data, scripts/train.py
and the shipped built-in pair (spec_jax.models.builtin)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.models.builtin import BUILTIN_DIR, load_builtin
from spec_jax.models.params_io import CheckpointError
from spec_jax.training import data
from spec_jax.training import (TrainState, distillation_kl, make_optimizer, make_train_step,
                               next_token_cross_entropy, restore_best, train_loop)

REPO = Path(__file__).resolve().parents[1]


# ---- losses -----------------------------------------------------------------------------------

def test_cross_entropy_predicts_the_next_token():
  # logits[:, t] predict tokens[:, t + 1]; the last position has no target
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]]))
  tokens = jnp.array([[2, 0, 2]])
  expected = -(np.log(0.5) + np.log(0.8)) / 2
  np.testing.assert_allclose(next_token_cross_entropy(logits, tokens), expected, rtol=1e-6)
  mask = jnp.array([[0, 1, 1]])  # drop the first prediction; the last never counts
  np.testing.assert_allclose(next_token_cross_entropy(logits, tokens, mask), -np.log(0.8),
                             rtol=1e-6)


def test_cross_entropy_of_uniform_logits_is_log_vocab():
  logits = jnp.zeros((2, 5, 7))
  tokens = jnp.arange(10).reshape(2, 5) % 7
  np.testing.assert_allclose(next_token_cross_entropy(logits, tokens), np.log(7), rtol=1e-6)


def test_distillation_kl_is_forward_kl_of_the_teacher():
  p, q = np.array([0.7, 0.2, 0.1]), np.array([0.4, 0.4, 0.2])
  teacher, student = jnp.log(p)[None, None], jnp.log(q)[None, None]
  np.testing.assert_allclose(distillation_kl(student, teacher), np.sum(p * np.log(p / q)),
                             rtol=1e-5)
  assert float(distillation_kl(teacher, teacher)) == pytest.approx(0.0, abs=1e-7)
  # temperature T compares softmax(l / T) and scales by T**2
  t = 2.0
  pt, qt = p ** (1 / t) / np.sum(p ** (1 / t)), q ** (1 / t) / np.sum(q ** (1 / t))
  np.testing.assert_allclose(distillation_kl(student, teacher, temperature=t),
                             t * t * np.sum(pt * np.log(pt / qt)), rtol=1e-5)


def test_distillation_kl_mask_and_no_teacher_gradient():
  rng = np.random.default_rng(0)
  student = jnp.asarray(rng.normal(size=(1, 2, 5)), jnp.float32)
  teacher = jnp.asarray(rng.normal(size=(1, 2, 5)), jnp.float32)
  only_first = distillation_kl(student[:, :1], teacher[:, :1])
  np.testing.assert_allclose(distillation_kl(student, teacher, jnp.array([[1, 0]])), only_first,
                             rtol=1e-6)
  grad_teacher = jax.grad(lambda t: distillation_kl(student, t))(teacher)
  assert not np.any(np.asarray(grad_teacher))


def test_optimizer_warms_up_then_clips():
  opt = make_optimizer(1e-2, warmup_steps=10, total_steps=100, weight_decay=0.0, clip=1.0)
  params = {"w": jnp.ones((2, 2))}
  state = opt.init(params)
  updates, state = opt.update({"w": jnp.full((2, 2), 100.0)}, state, params)
  assert not np.any(np.asarray(updates["w"]))  # the schedule starts at 0
  for _ in range(20):
    updates, state = opt.update({"w": jnp.full((2, 2), 100.0)}, state, params)
  assert 0 < float(jnp.max(jnp.abs(updates["w"]))) <= 1.1e-2


# ---- a tiny model for the loop: a bigram table over a cyclic token stream ---------------------

V, T, B = 16, 12, 4
STREAM = np.tile(np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], np.uint16), 40)


def bigram_loss(params, tokens_BT, rng):
  logits_BTV = params["table"][tokens_BT] + params["bias"]
  return next_token_cross_entropy(logits_BTV, tokens_BT), {}


def batch_fn(step):
  return data.random_windows(STREAM, B, T, seed=0, step=step)


OPT = make_optimizer(0.1, warmup_steps=2, total_steps=12)
STEP = make_train_step(bigram_loss, OPT)  # one jitted step for all tests: one compile


def fresh_state(seed=0):
  key = jax.random.key(seed)
  params = {"table": 0.1 * jax.random.normal(key, (V, V)), "bias": jnp.zeros((V,))}
  return TrainState.create(params, OPT, jax.random.key(seed + 1)), STEP


def test_tiny_training_run_lowers_the_loss():
  state, step = fresh_state()
  before = float(bigram_loss(state.params, jnp.asarray(batch_fn(99)), None)[0])
  state, info = train_loop(state, batch_fn, step, num_steps=12, progress=False)
  after = float(bigram_loss(state.params, jnp.asarray(batch_fn(99)), None)[0])
  assert int(state.step) == 12 and info["start_step"] == 0
  assert after < 0.5 * before


def test_resume_gives_the_params_of_an_uninterrupted_run(tmp_path):
  state, step = fresh_state()
  uninterrupted, _ = train_loop(state, batch_fn, step, num_steps=12, progress=False)

  ckpt = str(tmp_path / "ckpt")
  state, step = fresh_state()
  half, _ = train_loop(state, batch_fn, step, num_steps=6, checkpoint_dir=ckpt, save_every=3,
                       progress=False)
  assert int(half.step) == 6
  # a new process would build its initial state afresh: the checkpoint must win over it
  state, step = fresh_state(seed=7)
  resumed, info = train_loop(state, batch_fn, step, num_steps=12, checkpoint_dir=ckpt,
                             save_every=3, progress=False)
  assert info["start_step"] == 6 and int(resumed.step) == 12
  for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keep_best_restores_the_params_with_the_lowest_metric(tmp_path):
  state, step = fresh_state()
  scores = iter([3.0, 1.0, 2.0])  # evaluated at steps 4, 8, 12: the best is step 8
  seen = {}

  def eval_fn(params):
    score = next(scores)
    seen[score] = jax.tree.map(np.asarray, params)
    return {"score": score}

  ckpt = str(tmp_path / "ckpt")
  _, info = train_loop(state, batch_fn, step, num_steps=12, checkpoint_dir=ckpt, save_every=4,
                       eval_fn=eval_fn, eval_every=4, best_metric="score", progress=False)
  assert [e["step"] for e in info["evals"]] == [4, 8, 12]
  params, best_step = restore_best(ckpt, seen[1.0])
  assert best_step == 8
  np.testing.assert_array_equal(np.asarray(params["table"]), seen[1.0]["table"])


# ---- data ------------------------------------------------------------------------------------

def test_stdlib_split_is_fixed_and_disjoint():
  root = data.stdlib_root()
  files = data.stdlib_files(root)
  rel = [p.relative_to(root).as_posix() for p in files]
  assert rel == sorted(rel) and len(files) > 100
  assert not any(set(r.split("/")[:-1]) & data.EXCLUDED_DIRS for r in rel)
  train, heldout = data.split_files(files, root)
  assert heldout and not set(train) & set(heldout) and len(train) + len(heldout) == len(files)
  assert all(data.is_heldout(p.relative_to(root).as_posix()) for p in heldout)


def test_token_stream_and_windows():
  stream = data.token_stream(lambda texts: [[5, 6], [7]], ["ab", "c"], sep_id=0, vocab_size=8)
  assert stream.dtype == np.uint16 and stream.tolist() == [0, 5, 6, 0, 7]
  a = data.random_windows(STREAM, 3, 5, seed=1, step=4)
  assert a.shape == (3, 5) and a.dtype == np.int32
  np.testing.assert_array_equal(a, data.random_windows(STREAM, 3, 5, seed=1, step=4))
  assert not np.array_equal(a, data.random_windows(STREAM, 3, 5, seed=1, step=5))


# ---- scripts/train.py --quick and the loader ----------------------------------------------------

@pytest.fixture(scope="module")
def quick_pair(tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("pair")
  subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "--out", str(out),
                  "--quick", "--no-measure", "--no-progress"], check=True, cwd=REPO,
                 timeout=600)
  return out


def test_quick_training_writes_a_loadable_pair(quick_pair):
  target, target_params, draft, draft_params, tokenizer = load_builtin(quick_pair)
  assert target.vocab_size == draft.vocab_size == tokenizer.vocab_size
  assert draft.config.n_layers < target.config.n_layers
  assert jax.tree.leaves(target_params)[0].dtype == jnp.float32
  for name in ("tokenizer.json", "training.json", "README.md"):
    assert (quick_pair / name).is_file()
  ids = tokenizer.encode("def f(x):\n    return x\n")
  assert ids[0] == tokenizer.bos_id == tokenizer.eos_id
  assert tokenizer.decode(ids) == "def f(x):\n    return x\n"


def test_load_builtin_reports_missing_and_corrupt_files(quick_pair, tmp_path):
  broken = tmp_path / "broken"
  shutil.copytree(quick_pair, broken, ignore=shutil.ignore_patterns(".work"))
  weights = broken / "draft.safetensors"
  weights.write_bytes(weights.read_bytes()[:100])
  with pytest.raises(CheckpointError, match="draft.safetensors"):
    load_builtin(broken)
  weights.unlink()
  with pytest.raises(CheckpointError, match="missing draft.safetensors"):
    load_builtin(broken)
  with pytest.raises(CheckpointError, match="no built-in model folder"):
    load_builtin(tmp_path / "nowhere")


# ---- the shipped pair ---------------------------------------------------------------------------

def test_shipped_pair_is_lossless_on_code():
  if not (BUILTIN_DIR / "draft.safetensors").is_file():
    pytest.skip(f"{BUILTIN_DIR} has no trained pair yet (python scripts/train.py)")
  from spec_jax.drafters.draft_model import DraftModelDrafter
  from spec_jax.generate import generate, pad_prompts
  from spec_jax.speculative import speculative_generate

  target, target_params, draft, draft_params, tokenizer = load_builtin()
  tokens, lengths = pad_prompts([tokenizer.encode("def fibonacci(n):\n")])
  ar = generate(target, target_params, tokens, lengths, max_new_tokens=32)
  spec = speculative_generate(target, target_params, DraftModelDrafter(draft), draft_params,
                              tokens, lengths, gamma=4, max_new_tokens=32)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  assert int(spec.metrics.rounds) < 32  # the draft is accepted some of the time


def test_shipped_dspark_is_int8_and_lossless_on_the_builtin_target():
  """models/builtin/dspark (scripts/train_drafter.py --model builtin --kind dspark): found by
  builtin_drafter, stored int8, and greedy-identical, drafting whole blocks of 8."""
  from spec_jax.drafters.files import read_drafter
  from spec_jax.drafters.factory import make_drafter
  from spec_jax.generate import generate, pad_prompts
  from spec_jax.models.builtin import builtin_drafter
  from spec_jax.speculative import speculative_generate

  folder = builtin_drafter("dspark")
  assert folder is not None, f"{BUILTIN_DIR}/dspark is not shipped"
  assert builtin_drafter("no_such_kind") is None
  target, target_params, _, _, tokenizer = load_builtin()
  kind, _, _ = read_drafter(folder)
  assert kind == "dspark"
  import safetensors
  with safetensors.safe_open(str(Path(folder) / "drafter.safetensors"), framework="numpy") as f:
    stored = {name: f.get_tensor(name) for name in f.keys()}
  matrices = [a for a in stored.values() if a.ndim >= 2]
  assert matrices and all(a.dtype == np.int8 for a in matrices)
  drafter, dp = make_drafter("dspark", target, target_params, checkpoint=folder)
  assert drafter.model.num_drafts == 8
  tokens, lengths = pad_prompts([tokenizer.encode("class Stack:\n"),
                                 tokenizer.encode("import os\n\ndef ")])
  ar = generate(target, target_params, tokens, lengths, max_new_tokens=24)
  spec = speculative_generate(target, target_params, drafter, dp, tokens, lengths, gamma=8,
                              max_new_tokens=24)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  assert int(spec.metrics.rounds) < 24  # its drafts are accepted some of the time


def test_builtin_storage_quantizes_matrices_per_output_channel(quick_pair, tmp_path):
  from spec_jax.models.builtin import SCALE_SUFFIX, dequantize_tensors, quantize_tensor
  rng = np.random.default_rng(0)
  w = rng.standard_normal((48, 40)).astype(np.float32) * np.linspace(0.1, 3, 40)
  stored = quantize_tensor("layers.0.mlp.w_up.kernel", w)
  q, scale = stored["layers.0.mlp.w_up.kernel"], stored["layers.0.mlp.w_up.kernel" + SCALE_SUFFIX]
  assert q.dtype == np.int8 and scale.shape == (1, 40)  # one scale per output column
  back = dequantize_tensors(stored, "test")["layers.0.mlp.w_up.kernel"]
  assert np.all(np.abs(back - w) <= scale / 2 + 1e-7)
  embed = quantize_tensor("embed", w)
  assert embed["embed" + SCALE_SUFFIX].shape == (48, 1)  # per token row: the tied head's outputs
  assert quantize_tensor("final_norm.scale", w[0])["final_norm.scale"].dtype != np.int8
  with pytest.raises(CheckpointError, match="has no"):
    dequantize_tensors({"embed": q}, "test")
  # the quick pair's files hold int8 matrices and load to float32 exactly as dequantized
  import safetensors.numpy
  raw = safetensors.numpy.load_file(str(quick_pair / "target.safetensors"))
  assert raw["embed"].dtype == np.int8 and ("embed" + SCALE_SUFFIX) in raw
  _, params, *_ = load_builtin(quick_pair)
  from spec_jax.models.params_io import params_to_flat
  np.testing.assert_array_equal(np.asarray(params_to_flat(params)["embed"]),
                                raw["embed"].astype(np.float32) * raw["embed" + SCALE_SUFFIX])


# ---- crash safety -------------------------------------------------------------------------------

def test_half_written_and_damaged_checkpoints_are_skipped_on_resume(tmp_path):
  state, step = fresh_state()
  uninterrupted, _ = train_loop(state, batch_fn, step, num_steps=12, progress=False)
  ckpt = tmp_path / "ckpt"
  state, step = fresh_state()
  train_loop(state, batch_fn, step, num_steps=6, checkpoint_dir=str(ckpt), save_every=1,
             progress=False)
  latest = ckpt / "latest"
  assert sorted(p.name for p in latest.iterdir() if p.name.isdigit()) == ["5", "6"]
  # what a kill can leave: a step never recorded as complete, orbax's temporary directory, and
  # (a disk's doing) a recorded step whose data no longer match their checksums
  shutil.copytree(latest / "6", latest / "7")
  (latest / "8.orbax-checkpoint-tmp-1234").mkdir()
  record = json.loads((latest / "complete.json").read_text())
  record["6"] = {name: "00000000" for name in record["6"]}
  (latest / "complete.json").write_text(json.dumps(record))
  state, step = fresh_state(seed=7)
  with pytest.warns(RuntimeWarning) as caught:
    resumed, info = train_loop(state, batch_fn, step, num_steps=12, checkpoint_dir=str(ckpt),
                               save_every=1, progress=False)
  messages = " ".join(str(w.message) for w in caught)
  assert "step 7 (never recorded as complete" in messages and "step 6 (its data" in messages
  assert info["start_step"] == 5
  for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not (latest / "8.orbax-checkpoint-tmp-1234").exists()
  assert any(p.name.startswith("incomplete-7-") for p in latest.iterdir())


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path):
  """A drafter distillation killed (SIGKILL) at a random step, mid-step or mid-save, and
  resumed in a new process ends with the params of an uninterrupted run, bit for bit."""
  import random
  import signal
  seed = random.randrange(1 << 30)
  rng = random.Random(seed)
  kill_at, delay_ms = rng.randrange(1, 7), rng.randrange(0, 25)
  worker = [sys.executable, str(REPO / "tests" / "train_worker.py"), str(tmp_path / "ckpt")]
  killed = subprocess.run(worker + [str(tmp_path / "killed.npz"), "--kill-at", str(kill_at),
                                    "--kill-after-ms", str(delay_ms)],
                          capture_output=True, text=True, timeout=300)
  context = f"seed {seed}: kill at step {kill_at} + {delay_ms} ms"
  assert killed.returncode == -signal.SIGKILL, f"{context}\n{killed.stderr[-3000:]}"
  resumed = subprocess.run(worker + [str(tmp_path / "resumed.npz"), "--reference",
                                     str(tmp_path / "reference"), str(tmp_path / "ref.npz")],
                           capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, f"{context}\n{resumed.stderr[-3000:]}"
  got, want = np.load(tmp_path / "resumed.npz"), np.load(tmp_path / "ref.npz")
  assert 1 <= int(got["start_step"]) <= kill_at + 1, context
  assert int(want["start_step"]) == 0 and set(got.files) == set(want.files)
  for name in set(want.files) - {"start_step"}:
    np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}; {context}")
