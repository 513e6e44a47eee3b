"""ZeRO 1-2 ``overlap_param_gather`` (Megatron's ``--overlap-param-gather``): after the step
every bucket's parameter all-gather is issued at once and left in flight
(:meth:`megazero.zero.buffers.GradBuffer.start_param_gather`); the next forward waits for a
bucket only where it first needs it, in a forward pre-hook of the module that holds the
bucket's parameters. The gathers thus run behind the forward of the modules before it.

Which module "holds" a parameter: the module that registered it, if that module runs a forward
of its own; otherwise (a bare ``nn.Module`` holder such as GPTModel's ``output_layer``, or a
``ModuleList``) the nearest enclosing module that does, which is the one whose forward reads
it. Whatever reads parameters outside a forward (the step, checkpoint saving, gathering for
evaluation) waits for every bucket first (:meth:`megazero.zero.ZeroOptimizer.wait_for_params`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from megazero.zero.buffers import GradBuffer


def _runs_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def register_param_gather_hooks(chunk: nn.Module, store: GradBuffer) -> list[Any]:
    """One forward pre-hook per module that holds parameters of ``store``'s buckets: it waits
    for those buckets' all-gathers (a no-op when none is in flight). Returns the hook handles."""
    bucket_of = {id(s.param): b.index for b in store.buckets for s in b.slots}
    holder: dict[int, nn.Module] = {}  # id(module) -> the module whose pre-hook waits for it

    def visit(module: nn.Module, runner: nn.Module) -> None:
        runner = module if _runs_forward(module) else runner
        holder[id(module)] = runner
        for child in module.children():
            visit(child, runner)

    visit(chunk, chunk)
    waits: dict[int, set[int]] = {}
    modules: dict[int, nn.Module] = {}
    for module in chunk.modules():
        runner = holder[id(module)]
        for p in module.parameters(recurse=False):
            if id(p) in bucket_of:
                waits.setdefault(id(runner), set()).add(bucket_of[id(p)])
                modules[id(runner)] = runner
    handles = []
    for key, buckets in waits.items():
        order = tuple(sorted(buckets))

        def hook(_module: nn.Module, _args: Any, order: tuple[int, ...] = order) -> None:
            store.wait_param_gather(order)

        handles.append(modules[key].register_forward_pre_hook(hook))
    return handles
