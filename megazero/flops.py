"""Model FLOPs per iteration (Megatron's formula) and model FLOPs utilisation.

The formula counts the dense matmuls of a GPT with a 4h MLP: per layer and token, 24h² for the
QKV/projection/MLP weights and 4sh for attention scores and values, times 3 for forward plus
backward, plus the logit layer. It ignores recomputation (that is the *model* FLOPs; the
*hardware* FLOPs of full recomputation add one more forward: 96 instead of 72).
"""

from __future__ import annotations

# Dense peak FLOP/s per device for 16-bit and 32-bit math, for the MFU column. Unknown
# devices (CPUs, unlisted GPUs) report no MFU rather than a made-up one.
_PEAK_FLOPS = {
    "H200": {"16": 989e12, "32": 67e12},
    "H100": {"16": 989e12, "32": 67e12},
    "A100": {"16": 312e12, "32": 19.5e12},
    "L40S": {"16": 362e12, "32": 91.6e12},
    "A10G": {"16": 125e12, "32": 31.2e12},
    "V100": {"16": 125e12, "32": 15.7e12},
}


def model_flops_per_iteration(global_batch_size: int, seq_length: int, num_layers: int,
                              hidden_size: int, vocab_size: int) -> float:
    """``72 B s l h² (1 + s/(6h) + V/(12 l h))``: forward + backward, no recomputation."""
    b, s, n_layers, h, v = global_batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 72.0 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (12 * n_layers * h))


def hardware_flops_per_iteration(global_batch_size: int, seq_length: int, num_layers: int,
                                 hidden_size: int, vocab_size: int) -> float:
    """``96 B s l h² (1 + s/(6h) + V/(16 l h))``: with full activation recomputation."""
    b, s, n_layers, h, v = global_batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 96.0 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))


def tflops_per_device(flops_per_iteration: float, seconds_per_iteration: float,
                      world_size: int) -> float:
    """Achieved TFLOP/s per device (Megatron's ``TFLOP/s per GPU`` column)."""
    if seconds_per_iteration <= 0:
        return 0.0
    return flops_per_iteration / (seconds_per_iteration * world_size * 1e12)


def peak_flops(device_name: str, sixteen_bit: bool) -> float | None:
    """Dense peak FLOP/s of a known accelerator from its name, else ``None``."""
    name = device_name.upper()
    for key, peaks in _PEAK_FLOPS.items():
        if key in name:
            return peaks["16" if sixteen_bit else "32"]
    return None


def mfu(flops_per_iteration: float, seconds_per_iteration: float, world_size: int,
        peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or ``None`` when the device's peak is unknown."""
    if not peak or seconds_per_iteration <= 0:
        return None
    return flops_per_iteration / (seconds_per_iteration * world_size * peak)
