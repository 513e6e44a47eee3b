"""ZeRO data parallelism: flat bucketed buffers, a sharded optimizer around a stock torch
optimizer (stages 0-3), CPU offload, fp16 loss scaling and global gradient clipping."""

from megazero.zero.build import IMPLEMENTED_KEYS, NO_EFFECT_KEYS, build_zero_optimizer
from megazero.zero.init_context import GatheredParameters, Init
from megazero.zero.loss_scaler import LossScaleError, LossScaler
from megazero.zero.optimizer import StepResult, ZeroOptimizer

__all__ = ["IMPLEMENTED_KEYS", "NO_EFFECT_KEYS", "GatheredParameters", "Init", "LossScaleError",
           "LossScaler", "StepResult", "ZeroOptimizer", "build_zero_optimizer"]
