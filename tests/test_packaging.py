"""What a user installs: a wheel built from pyproject.toml holds every package and module of
the library and its data, and imports without the repository on the path (an editable
install, which CI uses, maps folders and would hide a package missing from the list)."""

from __future__ import annotations

import os
import shutil
import site as site_module
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

LIB, MODELS = REPO / "spec_jax", REPO / "models"


def pyproject_packages() -> tuple[list[str], dict[str, str]]:
  tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
  return tool["packages"], tool.get("package-dir", {})


def package_folders() -> dict[str, Path]:
  """Every folder holding an __init__.py, by the package name it installs as."""
  found = {}
  for root, name in ((LIB, "spec_jax"), (MODELS, "spec_jax.models")):
    for init in sorted(root.rglob("__init__.py")):
      parts = init.parent.relative_to(root).parts
      found[".".join((name,) + parts)] = init.parent
  return found


def test_pyproject_lists_every_package_folder():
  listed, _ = pyproject_packages()
  missing = sorted(set(package_folders()) - set(listed))
  assert not missing, f"pyproject.toml [tool.setuptools] packages leaves out {missing}"
  absent = sorted(set(listed) - set(package_folders()))
  assert not absent, f"pyproject.toml lists packages with no folder: {absent}"


@pytest.mark.slow
def test_wheel_holds_and_imports_every_module(tmp_path):
  """Build the wheel (no network: the installed setuptools) from a clean copy of the sources
  (setuptools reuses a stale build/ folder, which would hide a package left out), unpack
  it, import every module of the library from it, and load the built-in pair from its
  data."""
  source = tmp_path / "source"
  shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
      ".git", "build", "*.egg-info", "__pycache__", "runs", ".device", ".hypothesis",
      ".pytest_cache"))
  built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", str(source), "-w", str(tmp_path / "dist")],
                         capture_output=True, text=True, timeout=600)
  assert built.returncode == 0, built.stderr[-2000:]
  wheel, = (tmp_path / "dist").glob("spec_jax-*.whl")
  site = tmp_path / "site"
  with zipfile.ZipFile(wheel) as zf:
    zf.extractall(site)
    packed = set(zf.namelist())
  # every file of the library's folders is in the wheel (data the code reads: the built-in
  # pair, its DSpark drafter, the zoo's drafters), under the package it installs as
  for pkg, folder in package_folders().items():
    for path in folder.iterdir():
      if path.is_file() and path.suffix != ".pyc":
        name = "/".join(pkg.split(".") + [path.name])
        assert name in packed, f"the wheel leaves out {name}"
  for data in (MODELS / "builtin", MODELS / "zoo_drafters"):
    for path in data.rglob("*"):
      if path.is_file() and "__pycache__" not in path.parts:
        name = "spec_jax/models/" + path.relative_to(MODELS).as_posix()
        assert name in packed, f"the wheel leaves out {name}"
  modules = sorted(
      ".".join((pkg,) + path.relative_to(folder).with_suffix("").parts)
      for pkg, folder in package_folders().items() for path in folder.glob("*.py")
      if path.name != "__init__.py")
  script = (
      "import importlib, sys\n"
      "import spec_jax\n"
      f"assert spec_jax.__file__.startswith({str(site)!r}), spec_jax.__file__\n"
      f"for name in {modules!r}:\n"
      f"  assert importlib.import_module(name).__file__.startswith({str(site)!r}), name\n"
      "assert len(spec_jax.load_builtin()) == 5\n"
      "from spec_jax.models.builtin import builtin_drafter\n"
      "assert builtin_drafter('dspark') is not None\n"
      "print('ok', len(sys.modules))\n")
  # away from the repository and without site's .pth files (-S), so the editable install's
  # finder cannot serve a module the wheel lacks; the dependencies from site-packages
  path = os.pathsep.join([str(site)] + site_module.getsitepackages()
                         + [site_module.getusersitepackages()])
  env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
  ran = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
  assert ran.returncode == 0 and "ok" in ran.stdout, ran.stderr[-3000:]
