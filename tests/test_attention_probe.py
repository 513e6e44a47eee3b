"""The banner's attention line: the backend megazero resolves, and on a GPU the SDPA kernel
PyTorch really dispatches to (named from the kernels a profiled call launched)."""

import pytest
import torch

from megazero.model.attention_probe import classify, describe_attention, sdpa_kernel_name


def test_kernel_names_are_classified():
    assert classify(["void pytorch_flash::flash_fwd_kernel<...>"]) == "FlashAttention-2 (PyTorch)"
    assert classify(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "memory-efficient"
    assert classify(["cudnn_generated_fort_native_sdpa_sm90"]) == "cuDNN"
    assert classify(["ampere_bf16_s16816gemm", "softmax_warp_forward"]) == "math (unfused)"


def test_cpu_runs_name_the_backend_without_profiling():
    args = (torch.device("cpu"), torch.float32, 4, 4, 8, 0.0)
    assert describe_attention("auto", True, *args) == "sdpa -> PyTorch's cpu kernel"
    assert describe_attention("unfused", True, *args).startswith("unfused")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_sdpa_on_gpu_is_a_fused_kernel():
    name = sdpa_kernel_name(torch.device("cuda"), torch.bfloat16, 16, 16, 128, 0.0)
    assert name in ("FlashAttention-2 (PyTorch)", "cuDNN", "memory-efficient"), name
    # grouped-query attention, as the Llama preset runs it
    print("bf16 GQA 32/8 heads of 64:", sdpa_kernel_name(torch.device("cuda"), torch.bfloat16,
                                                         32, 8, 64, 0.0))
