"""Training beside inference: the optax/orbax loop, drafter distillation, data.

Nothing under spec_jax outside this package imports optax or orbax (tests/test_layering.py).
"""

from spec_jax.losses import distillation_kl, next_token_cross_entropy
from spec_jax.training.loop import (Batch, LossFn, TrainState, make_optimizer, make_train_step,
                                    restore_best, restore_latest, train_loop)

__all__ = ["Batch", "LossFn", "TrainState", "distillation_kl", "make_optimizer",
           "make_train_step", "next_token_cross_entropy", "restore_best", "restore_latest",
           "train_loop"]
