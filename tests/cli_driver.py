"""Runs several command lines in one process, each as `python scripts/<script>.py ...` would
(spec_jax.cli.run around the script's main), for test_hardening: one import of jax for all.

`python tests/cli_driver.py CASES.json OUT.json`: CASES is a list of [script name, [argv]];
OUT gets, per case, the exit status, stdout and stderr, or the uncaught exception's traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO)]


def run_case(script: str, argv: list[str]) -> dict:
  from spec_jax import cli
  main = importlib.import_module(script).main
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      status = cli.run(main, argv)
    except SystemExit as e:  # argparse's --help
      status = e.code if isinstance(e.code, int) else 1
    except BaseException:  # what the interpreter would print: a traceback
      err.write(traceback.format_exc())
      status = "traceback"
  return {"script": script, "argv": argv, "status": status, "stdout": out.getvalue(),
          "stderr": err.getvalue()}


def main(cases_path: str, out_path: str) -> None:
  cases = json.loads(Path(cases_path).read_text())
  results = [run_case(script, argv) for script, argv in cases]
  Path(out_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
  main(*sys.argv[1:])
