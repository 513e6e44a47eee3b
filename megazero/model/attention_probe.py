"""Which attention kernel a run actually gets, for the start-up banner.

``--attention-backend auto`` picks flash-attn where it is installed and the tensors are fp16/bf16
on a GPU, else ``F.scaled_dot_product_attention``. SDPA then dispatches by itself to one of
PyTorch's kernels (FlashAttention-2, memory-efficient, cuDNN, or the math fallback) depending on
the GPU, dtype, head size, dropout and grouped-query attention. The only reliable way to know
which is to run one and look: :func:`sdpa_kernel_name` profiles a tiny forward and backward of
the model's own head size, dtype and dropout and names the kernel it saw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Substrings of CUDA kernel names, in the order they are checked.
_KERNELS = (("cudnn", "cuDNN"), ("flash", "FlashAttention-2 (PyTorch)"),
            ("fmha", "memory-efficient"), ("efficient", "memory-efficient"))


def classify(kernel_names: list[str]) -> str:
    """Name the SDPA kernel from the CUDA kernels one call launched."""
    for name in kernel_names:
        low = name.lower()
        for key, label in _KERNELS:
            if key in low:
                return label
    return "math (unfused)"


def sdpa_kernel_name(device: torch.device, dtype: torch.dtype, heads: int, groups: int,
                     head_dim: int, dropout: float) -> str:
    """Run one small causal SDPA forward+backward shaped like the model's and name the kernel
    it used (``"unknown (...)"`` where the profiler cannot say)."""
    if device.type != "cuda":
        return f"PyTorch's {device.type} kernel"
    try:
        import warnings

        from torch.profiler import ProfilerActivity, profile

        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, heads, 128, head_dim, device=device, dtype=dtype, generator=g,
                        requires_grad=True)
        k, v = (torch.randn(1, groups, 128, head_dim, device=device, dtype=dtype, generator=g,
                            requires_grad=True) for _ in range(2))
        with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            warnings.simplefilter("ignore")  # the profiler's notes are not the run's
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                 enable_gqa=groups != heads)
            out.sum().backward()
            torch.cuda.synchronize(device)
        names = [e.key for e in prof.key_averages()]
        return classify(names)
    except Exception as e:  # the banner must not stop a run
        return f"unknown ({type(e).__name__}: {e})"


def describe_attention(backend: str, use_flash_attn: bool, device: torch.device,
                       dtype: torch.dtype, heads: int, groups: int, head_dim: int,
                       dropout: float) -> str:
    """The banner's ``> attention:`` text: the backend megazero resolves and, for SDPA on a
    GPU, the kernel PyTorch dispatches to."""
    from megazero.model.attention import flash_attn_func

    half = dtype in (torch.float16, torch.bfloat16)
    if backend == "auto" and not use_flash_attn:
        backend = "sdpa"
    if backend in ("auto", "flash") and flash_attn_func is not None and device.type == "cuda" \
            and half:
        import flash_attn

        return f"flash-attn {getattr(flash_attn, '__version__', '?')}"
    if backend == "unfused":
        return "unfused (baddbmm + softmax)"
    why = ""
    if backend == "auto" and device.type == "cuda":
        why = (" (flash-attn not installed)" if flash_attn_func is None
               else f" (flash-attn needs fp16/bf16, the model runs in {dtype})")
    kernel = sdpa_kernel_name(device, dtype, heads, groups, head_dim, dropout)
    return f"sdpa -> {kernel}{why}"
