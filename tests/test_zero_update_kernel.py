"""The optimizer update on host masters (CPU offload, NVMe offload, a CPU-only run) is torch's
fused CPU Adam/AdamW: the engine reproduces a one-process fused AdamW bitwise, differs from the
foreach one by rounding only (stated tolerance), and stages gradients in one host buffer
allocated once."""

import pytest
import torch

from megazero.config import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.config.layout import ParallelLayout
from megazero.distributed.topology import ParallelTopology
from megazero.testing.reference import TinyLM, engine_train_step, make_batches
from megazero.zero import build_zero_optimizer
from megazero.zero.optimizers import update_kernel

OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)  # no clip: grads scale by 1
STEPS, BATCH, SEQ, VOCAB = 6, 4, 8, 64
SUB = 160  # several sub-groups: each step calls the torch optimizer once per sub-group
# fused vs foreach AdamW: the same update evaluated in another order; after 6 steps from
# weights of size ~1 they differ by a few fp32 ulps (measured: max 4.0e-7, 29% of elements)
FOREACH_TOL = 1e-6


def _tiny() -> TinyLM:
    m = TinyLM(vocab=VOCAB)
    m.embedding.weight.zero_external = True
    return m


def _topo1() -> ParallelTopology:
    return ParallelTopology(ParallelLayout(world_size=1), rank=0)


def _engine_run(zero: ZeroConfig):
    model = _tiny()
    engine = build_zero_optimizer([model], OPT, zero, PrecisionConfig(), _topo1())
    losses = [engine_train_step(model, engine, t, y)[0] for t, y in
              make_batches(STEPS, BATCH, SEQ, VOCAB)]
    full = engine.full_parameters()
    return losses, {n: full[id(p)] for n, p in model.named_parameters()}, engine


def _torch_run(kernel: str):
    """One process, torch AdamW with ``kernel`` (no decay on ``ndim < 2``, as the engine)."""
    model = _tiny()
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2]},
                             {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                            lr=OPT.lr, betas=(OPT.adam_beta1, OPT.adam_beta2), eps=OPT.adam_eps,
                            weight_decay=OPT.weight_decay, **{kernel: True})
    losses = []
    for tokens, labels in make_batches(STEPS, BATCH, SEQ, VOCAB):
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = {
    "cpu run, no offload": dict(stage=1),
    "cpu offload": dict(stage=2, offload_optimizer=OffloadConfig(device="cpu")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_host_masters_step_like_torch_fused_adamw(name):
    losses, weights, engine = _engine_run(ZeroConfig(sub_group_size=SUB, **CASES[name]))
    assert engine.masters.optimizer.defaults.get("fused") is True
    fused_losses, fused_w = _torch_run("fused")
    assert losses == fused_losses
    for k in fused_w:
        assert torch.equal(weights[k], fused_w[k]), k
    # the foreach kernel: the same update up to rounding
    foreach_losses, foreach_w = _torch_run("foreach")
    assert losses[-1] < losses[0]
    assert max(abs(a - b) for a, b in zip(losses, foreach_losses)) < FOREACH_TOL
    diff = max((weights[k] - foreach_w[k]).abs().max().item() for k in foreach_w)
    assert 0 <= diff < FOREACH_TOL


def test_nvme_offload_uses_the_cpu_offload_kernel(tmp_path):
    zero = ZeroConfig(stage=1, sub_group_size=SUB, offload_optimizer=OffloadConfig(
        device="nvme", nvme_path=str(tmp_path), buffer_count=6))
    losses, weights, engine = _engine_run(zero)
    assert engine.masters.optimizer.defaults.get("fused") is True
    fused_losses, fused_w = _torch_run("fused")
    assert losses == fused_losses
    assert all(torch.equal(weights[k], fused_w[k]) for k in fused_w)


def test_kernel_follows_the_masters_device_and_the_optimizer():
    cpu = [{"params": [torch.zeros(3, requires_grad=True)]}]
    meta = [{"params": [torch.zeros(3, device="meta", requires_grad=True)]}]
    assert update_kernel(torch.optim.AdamW, cpu) == "fused"
    assert update_kernel(torch.optim.Adam, cpu) == "fused"
    assert update_kernel(torch.optim.AdamW, meta) == "foreach"  # masters on another device
    assert update_kernel(torch.optim.SGD, cpu) == "foreach"
    sgd = OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.9)
    engine = build_zero_optimizer([_tiny()], sgd, ZeroConfig(stage=1), PrecisionConfig(),
                                  _topo1())
    assert engine.masters.optimizer.defaults.get("foreach") is True
    assert not engine.masters.optimizer.defaults.get("fused")


def test_host_gradient_staging_is_one_buffer_allocated_once(monkeypatch):
    """fp32 gradient copies on the host go through one buffer of the largest sub-group's size,
    allocated at the first step and reused by every sub-group of every step."""
    import megazero.zero.master as master_mod

    sizes = []
    real = master_mod.host_empty

    def counting(numel, dtype, pin):
        sizes.append(numel)
        return real(numel, dtype, pin)

    monkeypatch.setattr(master_mod, "host_empty", counting)
    zero = ZeroConfig(stage=1, sub_group_size=SUB,
                      offload_optimizer=OffloadConfig(device="cpu"))
    model = _tiny()
    engine = build_zero_optimizer([model], OPT, zero, PrecisionConfig(), _topo1())
    masters = engine.masters
    built = list(sizes)
    assert built == [sum(p.model.numel() for p in masters.pieces)]  # the flat masters
    ptrs = []
    for t, y in make_batches(3, BATCH, SEQ, VOCAB):
        engine_train_step(model, engine, t, y)
        ptrs.append(masters._grad_stage.data_ptr())
    width = max(sum(p.model.numel() for p in g) for g in masters.sub_groups)
    assert len(masters.sub_groups) > 3
    assert sizes[len(built):] == [width]  # one staging buffer over 3 steps
    assert len(set(ptrs)) == 1


def test_a_checkpoint_from_the_other_kernel_does_not_switch_it():
    """A state dict saved where the masters ran foreach (an accelerator, an older run) loads
    into host masters that keep the fused kernel, and resumes bitwise like fused torch."""
    zero = ZeroConfig(stage=1, sub_group_size=SUB, offload_optimizer=OffloadConfig(device="cpu"))
    batches = make_batches(STEPS, BATCH, SEQ, VOCAB)
    model = _tiny()
    engine = build_zero_optimizer([model], OPT, zero, PrecisionConfig(), _topo1())
    for t, y in batches[:3]:
        engine_train_step(model, engine, t, y)
    sd = engine.state_dict()
    for g in sd["master"]["optimizer"]["param_groups"]:
        g["fused"], g["foreach"] = None, True
    engine.load_state_dict(sd)
    groups = engine.masters.optimizer.param_groups
    assert [(g["fused"], g["foreach"]) for g in groups] == [(True, None)] * len(groups)
    for t, y in batches[3:]:
        engine_train_step(model, engine, t, y)
    full = engine.full_parameters()
    _, fused_w = _torch_run("fused")
    assert all(torch.equal(full[id(p)], fused_w[n]) for n, p in model.named_parameters())
