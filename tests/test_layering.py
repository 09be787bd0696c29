"""The architecture's promises, checked: imports point one way, inference stays clear of the
training stack, a user's own `models` package cannot shadow ours, the registry is the one
source of drafter kinds, and a new drafter family is one file plus its registration."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, STORIES_DIR, require_shared

LIB = REPO / "spec_jax"
MODELS = REPO / "models"
TRAINING_STACK = ("optax", "orbax")


def imported_modules(path: Path) -> set[str]:
  """Every module a file imports, at any depth (function-level imports included)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
  return names


def files(folder: Path) -> list[Path]:
  return sorted(folder.rglob("*.py"))


def test_core_imports_nothing_above_it():
  for path in files(LIB / "core"):
    above = {m for m in imported_modules(path)
             if m.startswith("spec_jax") and not m.startswith("spec_jax.core")}
    assert not above, f"{path.relative_to(REPO)} imports {sorted(above)}"


def test_model_code_imports_only_the_core():
  for path in files(MODELS):
    bad = {m for m in imported_modules(path) if m.startswith("spec_jax")
           and not m.startswith(("spec_jax.core", "spec_jax.models"))}
    bad |= {m for m in imported_modules(path) if m == "models" or m.startswith("models.")}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_decoding_loops_depend_on_the_interface_not_on_model_code():
  loops = ["generate", "speculative", "tree_speculative", "verify", "tree_verify", "streaming",
           "engine", "metrics", "tree"]
  for name in loops:
    path = LIB / f"{name}.py"
    models = {m for m in imported_modules(path) if m.startswith("spec_jax.models")}
    assert not models, f"{path.relative_to(REPO)} imports model code {sorted(models)}"


def test_inference_code_never_imports_the_training_stack():
  inference = [p for p in files(LIB) if not p.is_relative_to(LIB / "training")
               and not p.is_relative_to(LIB / "bench")]
  for path in inference:
    bad = {m for m in imported_modules(path) if m.split(".")[0] in TRAINING_STACK}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def run_python(code: str, cwd: Path, extra_path: Path | None = None) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if extra_path is not None:
    env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


GENERATE_STORIES = """
    import sys
    import numpy as np
    import spec_jax as sj
    target, params = sj.load_model({model!r})
    tok = sj.load_tokenizer({tok!r})
    tokens, lengths = sj.pad_prompts([tok.encode("Once upon a time")])
    drafter, draft_params = sj.make_drafter({kind!r}, target, params{extra})
    out = sj.speculate(target, params, drafter, draft_params, tokens, lengths, gamma=3,
                       max_new_tokens=24)
    ref = sj.generate(target, params, tokens, lengths, max_new_tokens=24)
    assert np.array_equal(out.tokens, ref.tokens)
    print(tok.decode(np.asarray(out.tokens[0]).tolist()))
    print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("optax", "orbax")))
"""


def stories_code(kind: str = "prompt_lookup", extra: str = "") -> str:
  require_shared(STORIES_DIR)
  return GENERATE_STORIES.format(model=str(STORIES_DIR / "stories260K.bin"),
                                 tok=str(STORIES_DIR / "tok512.bin"), kind=kind, extra=extra)


def test_a_users_own_models_package_does_not_shadow_the_library(tmp_path):
  """A researcher's repository with its own `models/` first on sys.path (and as the working
  directory) loads stories260K through the public API and generates."""
  users = tmp_path / "research"
  (users / "models").mkdir(parents=True)
  (users / "models" / "__init__.py").write_text(
      "raise ImportError('the user\\'s own models package was imported by spec_jax')\n")
  (users / "models" / "llama.py").write_text("LlamaModel = None  # the user's, not ours\n")
  out = run_python(stories_code(), cwd=users, extra_path=users)
  assert out.splitlines()[-1].startswith("loaded:") and len(out.splitlines()[0]) > 20, out


def test_generating_with_a_trained_drafter_loads_no_orbax(tmp_path):
  """Inference with a trained drafter read from its files: orbax stays unloaded. (optax may
  be: flax.nnx itself imports it; our inference code never does, see above.)"""
  from spec_jax.models.llama2c import load_llama2c
  from spec_jax.training import distill
  require_shared(STORIES_DIR)
  target, _ = load_llama2c(str(STORIES_DIR / "stories260K.bin"))
  import jax
  spec = distill.make_spec("medusa", target, num_heads=3)
  distill.export_drafter(tmp_path / "medusa", spec, spec.init_params(jax.random.key(0)))
  out = run_python(stories_code("medusa", f", checkpoint={str(tmp_path / 'medusa')!r}"),
                   cwd=tmp_path)
  loaded = out.splitlines()[-1]
  assert "orbax" not in loaded, loaded


def cli_choices(script: str, flag: str) -> list[str]:
  """The choices argparse prints for `flag` in `script --help` (a subprocess, as users run it)."""
  proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"],
                        capture_output=True, text=True, timeout=300, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  match = re.search(re.escape(flag) + r"\s+\{([^}]*)\}", proc.stdout)
  assert match, proc.stdout
  return [c.strip() for c in match.group(1).split(",")]


def test_the_registry_is_the_single_source_of_kinds():
  from spec_jax.drafters import registry
  assert cli_choices("generate.py", "--draft") == list(registry.kinds()) + ["none"]
  assert cli_choices("train_drafter.py", "--kind") == list(registry.trained_kinds())
  # no code outside the family files compares kind strings
  names = [f.name for f in registry.families().values()]
  pattern = re.compile(r"""(==|!=)\s*["'](%s)["']|["'](%s)["']\s*(==|!=)|\.endswith\(["'](%s)"""
                       % (("|".join(names),) * 3))
  for path in files(LIB) + sorted((REPO / "scripts").glob("*.py")):
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
      assert not pattern.search(line), f"{path.relative_to(REPO)}:{lineno}: {line.strip()}"


def test_every_registered_family_builds_exports_and_loads(tmp_path):
  """Each family through make_drafter (from memory, and from its exported files where it is
  trained), chain and tree where it has one; greedy output equals autoregressive."""
  import jax
  import numpy as np
  from spec_jax import generate, make_drafter, pad_prompts, speculate
  from spec_jax.drafters import registry
  from spec_jax.testing import tiny_llama
  from spec_jax.training import distill
  target, params = tiny_llama(vocab_size=48, max_seq_len=96)
  draft, draft_params = tiny_llama(vocab_size=48, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                   hidden_dim=24, max_seq_len=96, seed=3)
  tokens, lengths = pad_prompts([[1, 5, 9, 5, 9, 5], [1, 7, 3]])
  ref = generate(target, params, tokens, lengths, max_new_tokens=12)
  tree = registry.TreeOptions(depth=2, top_k=2, nodes=5)
  checked = []
  for kind in registry.kinds():
    fam, combined = registry.resolve(kind)
    built = []
    if (combined or fam).build is not None:
      built.append(make_drafter(kind, target, params, draft_model=draft,
                                draft_params=draft_params))
      if fam.tree and combined is None:
        built.append(make_drafter(kind, target, params, draft_model=draft,
                                  draft_params=draft_params, tree=tree))
    family = combined or fam  # "lookup+<trained family>": that family's file
    if family.trained is not None and (combined is None or family.build is None):
      name = family.name
      spec = distill.make_spec(name, target, num_heads=2)
      folder = tmp_path / name
      if not folder.exists():
        distill.export_drafter(folder, spec, spec.init_params(jax.random.key(1)))
      built.append(make_drafter(kind, target, params, checkpoint=folder))
      if fam.tree and combined is None:
        built.append(make_drafter(kind, target, params, checkpoint=folder, tree=tree))
    assert built, f"{kind}: registered but not buildable"
    for drafter, dparams in built:
      out = speculate(target, params, drafter, dparams, tokens, lengths,
                      gamma=None if drafter.is_tree else 2, max_new_tokens=12)
      np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), kind)
      checked.append((kind, drafter.is_tree))
  assert {k for k, _ in checked} == set(registry.kinds())


NEW_FAMILY = '''
"""A toy family, to show what a new one takes: this file and its registration."""
import dataclasses

import jax.numpy as jnp

from spec_jax.drafters.base import Drafter
from spec_jax.drafters.registry import DrafterFamily, register


@dataclasses.dataclass(frozen=True)
class RepeatLastDrafter(Drafter):
  """Drafts the pending token gamma times: deterministic, a function of the context."""

  def init(self, params, prompt):
    return ()

  def propose(self, params, state, ctx, gamma, sampling, key):
    return jnp.repeat(ctx.pending_B[:, None], gamma, axis=1), None, state


register(DrafterFamily(name="repeat_last", summary="the pending token, again",
                       build=lambda target, params, opts: (RepeatLastDrafter(), None)))
'''


@pytest.mark.slow
def test_a_new_family_is_one_file_and_its_registration(tmp_path):
  (tmp_path / "repeat_last.py").write_text(NEW_FAMILY)
  out = run_python("""
      import numpy as np
      import repeat_last  # the one registration line a user's code adds
      import spec_jax as sj
      from spec_jax.testing import tiny_llama
      assert "repeat_last" in sj.drafter_kinds()
      target, params = tiny_llama(vocab_size=32)
      tokens, lengths = sj.pad_prompts([[1, 2, 2, 2], [1, 4]])
      drafter, dparams = sj.make_drafter("repeat_last", target, params)
      out = sj.speculate(target, params, drafter, dparams, tokens, lengths, gamma=3,
                         max_new_tokens=10)
      ref = sj.generate(target, params, tokens, lengths, max_new_tokens=10)
      assert np.array_equal(out.tokens, ref.tokens)
      print("ok", sj.SpeculativeConfig("repeat_last").method)
  """, cwd=tmp_path, extra_path=tmp_path)
  assert out.split() == ["ok", "repeat_last"]
