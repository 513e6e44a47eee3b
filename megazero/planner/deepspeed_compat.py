"""DeepSpeed's model-state estimates, for comparison with numbers users already know.

The formulas of ``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/
stage_1_and_2.py) and ``estimate_zero3_model_states_mem_needs`` (stage3.py) as of DeepSpeed
0.19 (checked against its functions in tests/test_planner_deepspeed_compat.py). Older releases
gave ZeRO-2 without offload ``4P + 16P/N`` per GPU; current ones ``2P + 18P/N`` (16-bit
params; 16-bit and fp32 grads, fp32 params, two fp32 moments partitioned). ``*_all_live``
take the total parameter count (shared tensors once) and the largest number of parameters one
module owns directly. These count model states only, with DeepSpeed's ``additional_buffer_factor``
(1.5) on host memory; :mod:`megazero.planner.estimate` is what this framework allocates.
"""

from __future__ import annotations

from torch import nn


def zero2_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                    cpu_offload: bool = True, additional_buffer_factor: float = 1.5
                    ) -> tuple[int, int]:
    """(host bytes, bytes per GPU)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                    num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                    zero_init: bool = True, additional_buffer_factor: float = 1.5
                    ) -> tuple[int, int, int]:
    """(host bytes, bytes per GPU, largest layer bytes)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            per = 18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor)
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            per = 16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor)
        cpu_mem = total_params * per * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = (largest_layer_params if zero_init else total_params) * 4 \
            * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def model_param_counts(model: nn.Module) -> tuple[int, int]:
    """DeepSpeed's ``model_to_params``: (total, largest one module owns directly)."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                  default=0)
    return total, largest


def deepspeed_table(total: int, largest: int, num_gpus_per_node: int, num_nodes: int
                    ) -> list[dict]:
    """The rows DeepSpeed's ``*_all_live`` functions print (offload options x stage)."""
    rows = []
    for off in (True, False):
        cpu, gpu = zero2_mem_needs(total, num_gpus_per_node, num_nodes, off)
        rows.append(dict(stage=2, offload_optimizer=off, offload_param=False, host=cpu, gpu=gpu))
    for off, offp in ((True, True), (True, False), (False, False)):
        cpu, gpu, _ = zero3_mem_needs(total, largest, num_gpus_per_node, num_nodes, off, offp)
        rows.append(dict(stage=3, offload_optimizer=off, offload_param=offp, host=cpu, gpu=gpu))
    return rows
