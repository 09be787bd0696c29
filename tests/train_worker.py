"""A tiny drafter distillation run with a checkpoint every step, for test_training's crash test.

`python tests/train_worker.py CKPT_DIR OUT.npz [--kill-at STEP --kill-after-ms MS]
[--reference REF_DIR REF.npz]`: distils a one-layer draft model from a tiny random target
(spec_jax.training.distill.Trainer, the code behind scripts/train_drafter.py) for STEPS steps,
resuming from CKPT_DIR if it holds a checkpoint, and writes the final params to OUT.npz.
With --kill-at, a timer started when step STEP's batch is drawn SIGKILLs the process MS
milliseconds later: mid-step or mid-save, wherever that falls. With --reference, the same
process also runs an uninterrupted copy from scratch into REF_DIR (one compile for both).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

STEPS = 10


def make_trainer():
  import numpy as np
  from spec_jax.testing import tiny_llama
  from spec_jax.training.distill import Corpus, Trainer, make_spec
  target, target_params = tiny_llama(vocab_size=32, dim=16, n_layers=1, n_heads=2,
                                     n_kv_heads=1, hidden_dim=32, max_seq_len=32)
  rows = np.random.default_rng(0).integers(0, 32, size=(40, 12)).astype(np.int32)
  corpus = Corpus(rows[:32], None, rows[32:], seq_len=12, seed=0)
  spec = make_spec("draft_model", target, draft_dim=16, draft_layers=1, draft_hidden=32)
  return Trainer(spec, target, target_params, corpus, STEPS, batch_size=4, learning_rate=1e-2,
                 warmup_steps=2)


def run(trainer, ckpt_dir: str, out: str, kill_at: int | None = None, kill_after_ms: int = 0):
  import jax
  import numpy as np
  from spec_jax.core.pytree_names import flatten_with_names

  def batch_fn(step):
    if step == kill_at:
      threading.Timer(kill_after_ms / 1000,
                      lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    return trainer.batch(step)

  params, info = trainer.run(checkpoint_dir=ckpt_dir, save_every=1, progress=False,
                             batch_fn=batch_fn)
  flat = {name: np.asarray(jax.device_get(leaf)) for name, leaf in flatten_with_names(params).items()}
  np.savez(out, start_step=info["start_step"], **flat)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("ckpt_dir")
  p.add_argument("out")
  p.add_argument("--kill-at", type=int, default=None)
  p.add_argument("--kill-after-ms", type=int, default=0)
  p.add_argument("--reference", nargs=2, default=None)
  args = p.parse_args()
  trainer = make_trainer()
  if args.reference:
    run(trainer, *args.reference)
  run(trainer, args.ckpt_dir, args.out, args.kill_at, args.kill_after_ms)


if __name__ == "__main__":
  main()
