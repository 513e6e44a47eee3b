"""The executor on gloo with a small stand-in chunk model (same forward contract as GPTModel).

One world of 4 ranks runs every case: pp = 4, and pp = 2 with two data-parallel replicas.
Gradients are synchronised as in training, by a ZeRO stage-0 engine (``grad_sync=engine``, then
``engine.finish_grad_sync()``). Each rank also builds the whole model in-process, runs it on
every replica's micro-batches, and checks the loss of each of its micro-batches and every
gradient of its chunks against it.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ConfigError, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.data.random_batches import random_lm_batches
from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.activation_meter import ActivationMeter
from megazero.pipeline.executor import backward_step, deallocate_output_tensor, forward_backward
from megazero.pipeline.grads import sync_tied_embeddings
from megazero.pipeline.partition import chunk_layer_ranges, chunk_roles
from megazero.testing import run_distributed
from megazero.zero import build_zero_optimizer

VOCAB, HIDDEN, SEQ, MBS, LAYERS = 50, 16, 8, 2, 8


def _init(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.3


class ToyChunk(nn.Module):
    """Embedding -> residual tanh-linear layers -> output head + per-token loss.

    Weights depend only on the global layer index, so any chunking of the layers reproduces
    the full model. With tied embeddings the last chunk holds a copy of the embedding.
    """

    def __init__(self, layer_range, pre_process, post_process, tied):
        super().__init__()
        self.pre_process, self.post_process, self.tied = pre_process, post_process, tied
        start, end = layer_range
        self.layers = nn.ParameterDict(
            {str(i): nn.Parameter(_init((HIDDEN, HIDDEN), 100 + i)) for i in range(start, end)})
        if pre_process:
            self.embedding = nn.Parameter(_init((VOCAB, HIDDEN), 1))
            self.embedding.shared_embedding = tied
        if post_process and not (tied and pre_process):
            seed = 1 if tied else 2
            self.output_weight = nn.Parameter(_init((VOCAB, HIDDEN), seed))
            if tied:
                self.output_weight.shared_embedding = True
                self.output_weight.shared = True

    def forward(self, tokens, labels=None, hidden_states=None):
        if self.pre_process:
            x = self.embedding[tokens].transpose(0, 1)  # [s, b, h], a non-contiguous view
        else:
            x = hidden_states
        for w in self.layers.values():
            x = x + torch.tanh(x @ w)
        if not self.post_process:
            return x
        w = self.embedding if (self.tied and self.pre_process) else self.output_weight
        logits = x.transpose(0, 1) @ w.t()  # [b, s, V]
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                               reduction="none").view(labels.shape)


def make_batches(m, seed=0):
    return random_lm_batches(m, VOCAB, MBS, SEQ, seed)


def reference(batches, tied):
    model = ToyChunk((0, LAYERS), True, True, tied)
    losses = []
    for b in batches:
        loss = model(b["tokens"], b["labels"]).mean()
        (loss / len(batches)).backward()
        losses.append(loss.item())
    grads = {f"layers.{k}": p.grad for k, p in model.layers.items()}
    grads["embedding"] = model.embedding.grad
    grads["output_weight"] = model.embedding.grad if tied else model.output_weight.grad
    return losses, grads


def build_chunks(topo, vpp, tied):
    lpvs = None if vpp == 1 else LAYERS // (topo.pp_size * vpp)
    ranges = chunk_layer_ranges(LAYERS, topo.pp_size, lpvs)[topo.pp_rank]
    roles = chunk_roles(topo.pp_rank, topo.pp_size, vpp)
    return [ToyChunk(r, pre, post, tied) for r, (pre, post) in zip(ranges, roles)]


def stage0_engine(chunks, topo):
    """The data-parallel gradient sync a run without ZeRO uses."""
    return build_zero_optimizer(chunks, OptimizerConfig(), ZeroConfig(stage=0),
                                PrecisionConfig(), topo)


class RecordingSync:
    """Stands in for a data-parallel engine: records which backwards ran outside no_sync."""

    def __init__(self):
        self.suspended = False
        self.events = []

    @contextlib.contextmanager
    def no_sync(self):
        self.suspended = True
        yield
        self.suspended = False

    def start_grad_sync(self):
        self.events.append("start")

    def finish_grad_sync(self):
        self.events.append("finish")


# interleaved micro-batch counts that are no multiple of pp, with group sizes that admit them:
# one group (N = M), two full groups, and a last group shorter than N but >= pp
GROUP_CASES = {2: [(3, 3), (5, 3)], 4: [(6, 6), (10, 5), (9, 5)]}


def _equivalence_world(rank, world_size):
    results = []
    for pp in (2, 4):
        for vpp in (1, 2):
            topo = ParallelTopology.build(pp=pp, vpp=vpp if vpp > 1 else None)
            # (m, group size): pp and 2pp in groups of pp, and counts only a group size admits
            counts = [(pp, None), (2 * pp, None)] + (GROUP_CASES[pp] if vpp > 1 else [])
            for m, group in counts:
                for tied in (True, False):
                    replicas = [make_batches(m, seed=m + d) for d in range(topo.dp_size)]
                    batches = replicas[topo.dp_rank]
                    ref_losses, ref_grads = reference([b for r in replicas for b in r], tied)
                    ref_losses = ref_losses[topo.dp_rank * m:(topo.dp_rank + 1) * m]
                    chunks = build_chunks(topo, vpp, tied)
                    sync_tied_embeddings(chunks, topo)
                    engine = stage0_engine(chunks, topo)
                    meter = ActivationMeter()
                    losses = forward_backward(chunks, iter(batches), topo, m, SEQ, MBS, HIDDEN,
                                              activation_meter=meter, microbatch_group_size=group,
                                              grad_sync=engine)
                    engine.finish_grad_sync()
                    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
                    for chunk in chunks:
                        for name, p in chunk.named_parameters():
                            err = (p.grad - ref_grads[name]).abs().max().item()
                            worst = max(worst, err)
                    results.append(dict(pp=pp, vpp=vpp, m=m, group=group, tied=tied, err=worst,
                                        peak=meter.peak_inflight,
                                        bytes=meter.peak_saved_bytes,
                                        per_fwd=meter.saved_bytes_per_forward,
                                        held=meter.peak_output_elements,
                                        pp_rank=topo.pp_rank))
    # forward-only: same losses, no grads, nothing kept
    topo = ParallelTopology.build(pp=4, vpp=2)
    batches = make_batches(8)
    chunks = build_chunks(topo, 2, True)
    losses = forward_backward(chunks, iter(batches), topo, 8, SEQ, MBS, HIDDEN, forward_only=True)
    fo = dict(err=max(abs(a - b) for a, b in zip(losses, reference(batches, True)[0])),
              grads=any(p.grad is not None for c in chunks for p in c.parameters()))
    # one data iterator per chunk (Megatron's interleaved convention) gives the same losses
    per_chunk_iters = forward_backward(chunks, [iter(batches), iter(batches)], topo, 8, SEQ,
                                       MBS, HIDDEN, forward_only=True)
    fo["per_chunk_iter_err"] = max(abs(a - b) for a, b in zip(per_chunk_iters, losses))
    # grad-sync hooks: per-chunk objects and a shared one
    per_chunk = [RecordingSync(), RecordingSync()]
    suspended = []
    for i, c in enumerate(chunks):
        for p in c.parameters():
            p.register_hook(lambda g, i=i: suspended.append(per_chunk[i].suspended) or g)
    forward_backward(chunks, iter(batches), topo, 8, SEQ, MBS, HIDDEN, grad_sync=per_chunk)
    outside, inside = suspended.count(False), suspended.count(True)
    shared = RecordingSync()
    forward_backward(chunks, iter(batches), topo, 8, SEQ, MBS, HIDDEN, grad_sync=shared)
    hooks = dict(per_chunk=[s.events for s in per_chunk], shared=shared.events,
                 outside=outside, inside=inside)
    # bf16 activations and grads travel in bf16; losses stay close to the fp32 model
    bf16_chunks = [c.to(torch.bfloat16) for c in build_chunks(topo, 2, True)]
    bf16_losses = forward_backward(bf16_chunks, iter(batches), topo, 8, SEQ, MBS, HIDDEN,
                                   dtype=torch.bfloat16)
    fo["bf16_err"] = max(abs(a - b) for a, b in zip(bf16_losses, losses))
    # the last stage's embedding copy is re-synchronised from the first stage
    for p in bf16_chunks[-1].parameters():
        if getattr(p, "shared", False):
            p.data.add_(1.0)
    sync_tied_embeddings(bf16_chunks, topo)
    emb = [p for c in bf16_chunks for p in c.parameters() if getattr(p, "shared_embedding", 0)]
    fo["tied_sum"] = emb[0].detach().float().sum().item() if emb else None
    # micro-batch counts the interleaved schedule cannot run are refused on every rank
    try:
        forward_backward(chunks, iter(batches), topo, 6, SEQ, MBS, HIDDEN)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    return results, fo, hooks, refused


def test_pipeline_matches_single_process_model():
    out = run_distributed(_equivalence_world, 4, timeout=300)
    for rank, (results, fo, hooks, refused) in enumerate(out):
        assert len(results) == 16 + 2 * 5
        for r in results:
            assert r["err"] < 1e-5, (rank, r)
        assert fo["err"] < 1e-5 and not fo["grads"] and fo["per_chunk_iter_err"] == 0.0
        assert 0 < fo["bf16_err"] < 0.05, fo["bf16_err"]
        # each chunk: the last micro-batch's backward outside no_sync, then start_grad_sync
        assert hooks["per_chunk"] == [["start"]] * 2  # finish_grad_sync is the caller's
        assert hooks["shared"] == ["start"]
        n_params = {0: 3, 1: 2, 2: 2, 3: 3}[rank]  # layer weights + embedding / output copy
        assert hooks["outside"] == n_params and hooks["inside"] == 7 * n_params
        assert "6 (--global-batch-size" in refused and "leave a last group of 2" in refused
        assert "--microbatch-group-size-per-virtual-pipeline-stage to one of 6" in refused
    tied = [o[1]["tied_sum"] for o in out]  # first (rank 0) and last (rank 3) stage copies
    assert tied[1] is None and tied[2] is None and tied[0] == tied[3]
    # activation memory on the first stage (pp rank 0 is global rank 0 in every layout)
    first = {(r["pp"], r["vpp"], r["m"], r["tied"]): r for r in out[0][0] if r["group"] is None}
    grouped = {(r["pp"], r["m"], r["group"]): r for r in out[0][0] if r["group"] and r["tied"]}
    for pp in (2, 4):
        for m in (pp, 2 * pp):
            # 1F1B: pp micro-batches in flight, not m
            assert first[(pp, 1, m, True)]["peak"] == pp
            per_fwd = first[(pp, 1, m, True)]["per_fwd"][0]
            assert first[(pp, 1, m, True)]["bytes"] == pp * per_fwd
        # sent outputs are deallocated: after each exchange the kept outputs of the first
        # stage hold one element each (the data went to the next stage)
        for vpp in (1, 2):
            r = first[(pp, vpp, 2 * pp, True)]
            assert 0 < r["held"] <= r["peak"], r  # without deallocation: peak * s*b*h
        # interleaved with m = 2pp: 2(p-1) + (v-1)p + 1 chunk-forwards
        assert first[(pp, 2, 2 * pp, True)]["peak"] == 2 * (pp - 1) + pp + 1
        # in groups of N: megatron-core's 2(p-1) + (v-1)N warm-up, plus one (capped at v m)
        for m, n in GROUP_CASES[pp]:
            assert grouped[(pp, m, n)]["peak"] == min(2 * (pp - 1) + n + 1, 2 * m), (pp, m, n)


@pytest.mark.parametrize("layers,pp,lpvs,expected", [
    (8, 2, None, [[(0, 4)], [(4, 8)]]),
    (8, 2, 2, [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]),
    (8, 4, 1, [[(0, 1), (4, 5)], [(1, 2), (5, 6)], [(2, 3), (6, 7)], [(3, 4), (7, 8)]]),
    (12, 3, 2, [[(0, 2), (6, 8)], [(2, 4), (8, 10)], [(4, 6), (10, 12)]]),
    (6, 1, None, [[(0, 6)]]),
])
def test_chunk_layer_ranges(layers, pp, lpvs, expected):
    assert chunk_layer_ranges(layers, pp, lpvs) == expected


def test_chunk_roles_and_bad_splits():
    assert chunk_roles(0, 4, 2) == [(True, False), (False, False)]
    assert chunk_roles(3, 4, 2) == [(False, False), (False, True)]
    assert chunk_roles(0, 1, 1) == [(True, True)]
    with pytest.raises(ConfigError, match=r"--num-layers 10 is not divisible by .* 4; valid "
                                          r"pipeline sizes for 10 layers: \[1, 2, 5, 10\]"):
        chunk_layer_ranges(10, 4)
    expected = r"stage 4 does not divide the 6 layers per pipeline stage .*valid values: \[1, 2, 3"
    with pytest.raises(ConfigError, match=expected):
        chunk_layer_ranges(12, 2, 4)


def test_deallocated_output_still_backpropagates():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3)
    out = torch.tanh(x @ w)
    grad = torch.randn(4, 3)
    expected = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
    deallocate_output_tensor(out)
    assert out.numel() == 1 and out.grad_fn is not None
    backward_step(out, grad)
    assert torch.equal(x.grad, expected)
