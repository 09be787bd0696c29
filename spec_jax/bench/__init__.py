"""A benchmark harness for jax decoding: compile apart, warm up, time interleaved, report.

Build Cases (`ar_case`, `spec_case`, `hf.hf_case`, or your own run/lower pair), time a group of
them with `run_group` (AOT compile times apart, warm-up, recompilation check, interleaved
repeats, medians), turn records into rows with `finish_rows` (speed-up, identical output,
acceptance), and write them with `report.write_reports`. `roofline` has step-cost and
bandwidth thunks; `recompiles.CompileCounter` counts XLA compilations through
jax.monitoring; `runner` runs a list of Scenarios into one results.json, saved after each.
spec_jax's own scenarios (scripts/benchmark.py) are in `scenarios`.
"""

from spec_jax.bench.cases import (Case, ar_case, compile_all, compile_case, pad_width,
                                  prompt_sets, run_group, spec_case, warm_up)
from spec_jax.bench.machine import cpu_model, describe_machine, package_versions
from spec_jax.bench.random_models import param_bytes, param_count, random_model
from spec_jax.bench.recompiles import BACKEND_COMPILE_EVENT, CompileCounter, process_counter
from spec_jax.bench.report import (clean_json, markdown, md_table, require_plotting,
                                   write_json, write_reports)
from spec_jax.bench.roofline import (chain_thunk, matmul_chain_loop, matmul_count_sweep,
                                     matvec_over, step_bound, step_loop, weight_matmuls)
from spec_jax.bench.rows import finish_rows, same_tokens, spec_summary
from spec_jax.bench.runner import Scenario, add_totals, run_scenarios, skipped
from spec_jax.bench.timing import interleaved_medians, log, timed, timed_compile

__all__ = [
    "BACKEND_COMPILE_EVENT", "Case", "CompileCounter", "Scenario", "add_totals", "ar_case",
    "chain_thunk", "clean_json", "compile_all", "compile_case", "cpu_model", "describe_machine",
    "finish_rows", "interleaved_medians", "log", "markdown", "matmul_chain_loop",
    "matmul_count_sweep", "matvec_over", "md_table", "package_versions", "pad_width",
    "param_bytes", "param_count", "process_counter", "prompt_sets", "random_model",
    "require_plotting", "run_group", "run_scenarios", "same_tokens", "skipped", "spec_case",
    "spec_summary", "step_bound", "step_loop", "timed", "timed_compile", "warm_up",
    "weight_matmuls", "write_json", "write_reports",
]
