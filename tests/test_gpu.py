"""What only a GPU shows: the CUDA paths of the model, the ZeRO engine and the training script.

Every test here is marked ``gpu`` and skipped where torch sees no CUDA device, so the CPU suite
(CI) collects and skips them; on a GPU machine ``python -m pytest tests`` runs them with the rest
(``-m gpu`` alone). Tolerances: fp32 on the GPU against fp32 on the CPU differ by the order of
the reductions inside cuBLAS/SDPA (a few ulps of each tensor's scale, as between TP layouts);
bf16 has 8 mantissa bits, so a loss of ~4.6 agrees to ~1e-2 after two layers.
"""

import json
import re
import subprocess
import sys

import pytest
import torch

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import ParallelContext
from megazero.testing.launch import REPO, SCRIPT, TINY, env, read_metrics
from megazero.testing.tiny_gpt import assert_close, batch, tiny_config
from megazero.zero import build_zero_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# The e2e runs here use the GPU: drop the CPU suite's explicit gloo backend.
GPU_TINY = [a for a in TINY if a not in ("--distributed-backend", "gloo")]


def _loss_and_grads(model, tokens, labels):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels).float().mean()
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().float().cpu()
                                 for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_forward_backward_on_gpu_equals_cpu(preset):
    cfg = tiny_config(preset)
    topo = ParallelTopology.single()
    tokens, labels = batch()
    cpu = GPTModel(cfg, topo, parallel=ParallelContext(attention_backend="sdpa"))
    ref_loss, ref_grads = _loss_and_grads(cpu, tokens, labels)
    gpu = GPTModel(cfg, topo, parallel=ParallelContext(attention_backend="sdpa")).cuda()
    loss, grads = _loss_and_grads(gpu, tokens.cuda(), labels.cuda())
    assert_close(loss, ref_loss, "fp32 loss", rel=1e-5)
    for name, g in grads.items():
        assert_close(g, ref_grads[name], f"fp32 grad {name}", rel=1e-4, atol=1e-6)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16_loss = gpu(tokens.cuda(), labels.cuda()).float().mean().item()
    assert abs(bf16_loss - ref_loss.item()) < 2e-2 * abs(ref_loss.item())


def test_every_attention_backend_agrees_on_gpu():
    from megazero.model.attention import flash_attn_func

    cfg = tiny_config("llama")
    topo = ParallelTopology.single()
    tokens, labels = (t.cuda() for t in batch())
    backends = ["unfused", "sdpa"] + (["flash"] if flash_attn_func is not None else [])
    results = {}
    for backend in backends:
        model = GPTModel(cfg, topo, parallel=ParallelContext(attention_backend=backend))
        model = model.cuda().to(torch.bfloat16)
        results[backend] = _loss_and_grads(model, tokens, labels)
    ref_loss, ref_grads = results["unfused"]
    for backend, (loss, grads) in results.items():
        assert abs(loss.item() - ref_loss.item()) < 1e-2 * abs(ref_loss.item()), backend
        for name, g in grads.items():
            assert_close(g, ref_grads[name], f"{backend} grad {name}", rel=5e-2, atol=1e-3)


def _engine(model, precision, zero):
    return build_zero_optimizer([model], OptimizerConfig(lr=1e-3), zero, precision,
                                ParallelTopology.single())


def test_fp16_overflow_skips_the_step_and_halves_the_scale_on_gpu():
    model = GPTModel(tiny_config("gpt2"), ParallelTopology.single()).cuda()
    engine = _engine(model, PrecisionConfig(fp16=True, initial_scale_power=8,
                                                     hysteresis=1), ZeroConfig(stage=1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens, labels = (t.cuda() for t in batch())
    loss = model(tokens, labels).float().mean()
    engine.backward(engine.scale_loss(loss * float("inf")))
    result = engine.step()
    assert result.skipped and engine.loss_scale == 2.0 ** 7
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    engine.backward(engine.scale_loss(model(tokens, labels).float().mean()))
    assert not engine.step().skipped


def test_cpu_offload_uses_pinned_host_memory():
    from megazero.config import OffloadConfig

    model = GPTModel(tiny_config("gpt2"), ParallelTopology.single()).cuda()
    zero = ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu", pin_memory=True))
    engine = _engine(model, PrecisionConfig(bf16=True), zero)
    assert engine.masters.flat.device.type == "cpu" and engine.masters.flat.is_pinned()
    tokens, labels = (t.cuda() for t in batch())
    engine.backward(model(tokens, labels).float().mean())
    assert not engine.step().skipped
    assert next(model.parameters()).device.type == "cuda"


def _run(args, timeout=300):
    proc = subprocess.run([sys.executable, SCRIPT, *args], env=env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _losses(path):
    return [r["lm loss"] for _, r in sorted(read_metrics(path).items())]


def test_training_on_gpu_logs_cuda_memory_and_resumes_on_cpu(tmp_path):
    ck = tmp_path / "ck"
    out = _run([*GPU_TINY, "--bf16", "--train-iters", "4", "--save", str(ck),
                "--save-interval", "2", "--log-json", str(tmp_path / "gpu.jsonl")])
    assert "(nccl)" in out and "peak memory (MB)" in out
    mem = float(re.search(r"peak memory \(MB\): ([\d.]+)", out).group(1))
    assert 0 < mem < torch.cuda.get_device_properties(0).total_memory / 2**20
    # A checkpoint written on the GPU loads on the CPU (gloo) and back on the GPU.
    # Longer runs than the checkpoint's: the decay steps (they default to --train-iters) change.
    longer = ["--override-opt_param-scheduler"]
    out = _run([*TINY, "--bf16", "--train-iters", "6", "--load", str(ck), "--save", str(ck),
                "--save-interval", "6", *longer])
    assert "loaded checkpoint" in out and "(gloo)" in out
    out = _run([*GPU_TINY, "--bf16", "--train-iters", "8", "--load", str(ck), *longer])
    assert "loaded checkpoint" in out and "iteration        8/" in out


def test_deterministic_mode_is_bitwise_on_gpu(tmp_path):
    args = [*GPU_TINY, "--bf16", "--deterministic-mode", "--attention-dropout", "0.1",
            "--hidden-dropout", "0.1"]
    a, b, c = (tmp_path / f"{x}.jsonl" for x in "abc")
    ck = tmp_path / "ck"
    _run([*args, "--train-iters", "8", "--log-json", str(a)])
    _run([*args, "--train-iters", "8", "--log-json", str(b), "--save", str(ck),
          "--save-interval", "4"])
    assert _losses(a) == _losses(b) and len(_losses(a)) == 8
    # Resume from iteration 4: the last four losses are bitwise those of the straight run.
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    _run([*args, "--train-iters", "8", "--log-json", str(c), "--load", str(ck)])
    assert _losses(c) == _losses(a)[4:]


def test_demo_runs_on_one_gpu(tmp_path):
    out = _run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "64", "--position-embedding-type", "rope", "--micro-batch-size",
                "4", "--global-batch-size", "8", "--train-iters", "20", "--lr", "2e-3",
                "--log-interval", "10", "--eval-interval", "20", "--eval-iters", "1",
                "--data-cache-path", str(tmp_path / "cache"), "--bf16"])
    losses = [float(x) for x in re.findall(r"lm loss: (\S+) \|", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    print(json.dumps({"demo_losses": losses}))

