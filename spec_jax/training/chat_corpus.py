"""Chat prompts every Python machine can build: the standard library's functions and
docstrings turned into instructions (write this function, explain this code, summarise this
passage). A chat model's own greedy answers to them are the distillation corpus of its
drafters (scripts/distill_zoo.py), so the drafters learn what the model actually says.

Deterministic: files in sorted order (spec_jax.training.data), the train / held-out split
by path hash, a seeded shuffle; the same Python version gives the same prompts.
"""

from __future__ import annotations

import ast
import random
import textwrap
from pathlib import Path

from spec_jax.training.data import split_files, stdlib_files, stdlib_root

KINDS = ("code", "explain", "summarise")
MAX_CODE_LINES = 18  # keeps "explain" prompts short (the corpus rows are a fixed length)
MAX_PASSAGE_CHARS = 700


def _first_sentence(doc: str) -> str:
  line = " ".join(doc.strip().split("\n\n")[0].split())
  return line.split(". ")[0].rstrip(".")


def _signature(fn: ast.FunctionDef) -> str:
  return f"{fn.name}({ast.unparse(fn.args)})"


def items_of_file(path: Path) -> list[tuple[str, str]]:
  """[(kind, instruction)] from one stdlib file: public documented functions, short ones'
  code, and docstrings long enough to summarise."""
  try:
    source = path.read_bytes().decode("utf-8", errors="replace")
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  lines = source.splitlines()
  items = []
  module_doc = ast.get_docstring(tree)
  if module_doc and len(module_doc) > 200:
    passage = module_doc[:MAX_PASSAGE_CHARS].rsplit("\n\n", 1)[0] if len(module_doc) > \
        MAX_PASSAGE_CHARS else module_doc
    items.append(("summarise", f"Summarise this passage in two sentences:\n\n{passage.strip()}"))
  for node in ast.walk(tree):
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
      continue
    doc = ast.get_docstring(node)
    if doc and 20 < len(_first_sentence(doc)) < 200:
      items.append(("code", f"Write a Python function `{_signature(node)}` that does this: "
                            f"{_first_sentence(doc)}."))
    n_lines = node.end_lineno - node.lineno + 1
    if 4 <= n_lines <= MAX_CODE_LINES:
      code = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
      items.append(("explain", f"Explain what this Python code does:\n\n```python\n{code}\n```"))
    if doc and len(doc) > 300:
      items.append(("summarise", "Summarise this passage in two sentences:\n\n"
                                 + doc[:MAX_PASSAGE_CHARS].strip()))
  return items


def stdlib_instructions(count: int, *, heldout: bool = False, seed: int = 0,
                        root: Path | None = None) -> list[tuple[str, str]]:
  """`count` (kind, instruction) pairs, the kinds in equal shares, from the train (or
  held-out) stdlib files."""
  root = stdlib_root() if root is None else Path(root)
  train, held = split_files(stdlib_files(root), root)
  by_kind: dict[str, list[str]] = {k: [] for k in KINDS}
  for path in (held if heldout else train):
    for kind, text in items_of_file(path):
      by_kind[kind].append(text)
  rng = random.Random(seed)
  picked = []
  for i, kind in enumerate(KINDS):
    pool = sorted(set(by_kind[kind]))
    rng.shuffle(pool)
    share = count // len(KINDS) + (i < count % len(KINDS))
    picked += [(kind, text) for text in pool[:share]]
  rng.shuffle(picked)
  return picked
