"""Weights created on the rank's device one parameter at a time (ZeRO stages 0-2), bit for bit
the single-process model's, and never a host copy of the rank's shard.

* Today's weights: the single-process model's checksum (sha256 of names and fp32 bytes) at a
  fixed seed, built on the host and built through the device path, equals the value the host
  build gave before the device path existed.
* Values: 4 gloo ranks build their chunks with ``megazero.training.builders.build_model_chunks_on``
  (meta build, then each parameter created on the device and initialised in place) at tp x pp = 1x1
  (dp 4), 2x1, 1x2 and 2x2, for a GELU/LayerNorm/tied model and a SwiGLU/RoPE/RMSNorm/untied one;
  every parameter must equal bitwise its slice of the single-process model built on the host the way
  tests and tools build it (``GPTModel`` with ``initialize_parameters``).
* Host memory: on CPU the device is the host, so the build is measured twice with
  ``LiveStorageBytes`` (every storage an operator returns, until it is freed). With the meta
  device standing in for a device whose memory is not the host's (copies to it cost nothing),
  the host's peak is the generator's scratch only: at most one tensor's worth (here the
  embedding), where building on the host and moving would hold the whole shard. On the CPU
  device, the peak is the final weights plus at most one tensor's worth.
"""

import torch

from megazero.testing import run_distributed

ARGV = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 100 --micro-batch-size 1 --train-iters 1 "
        "--mock-data --seed 11").split()
MODELS = {"gelu-tied": [], "swiglu-rope-untied": [
    "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
    "--untie-embeddings-and-output-weights"]}


#: sha256 (first 16 hex digits) of the single-process model's parameters (names and fp32 bytes,
#: in order) at seed 11, as the host build computed them before parameters were created on the
#: device: the weights are today's, not only equal between the two paths
CHECKSUMS = {"gelu-tied": "5c633c65790c4875", "swiglu-rope-untied": "feec8631808a4e11"}


def _checksum(named_params) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, p in named_params:
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def test_device_build_keeps_the_weights_checksums():
    from megazero.config import load_config
    from megazero.distributed.topology import ParallelTopology
    from megazero.training.builders import build_model_chunks_on

    for name, extra in MODELS.items():
        cfg = load_config(ARGV + extra, 1)
        assert _checksum(_reference(cfg)[1].named_parameters()) == CHECKSUMS[name], name
        chunks, _ = build_model_chunks_on(cfg, ParallelTopology.single(), torch.device("cpu"))
        assert _checksum(chunks[0].named_parameters()) == CHECKSUMS[name], name


def _reference(cfg):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    ref = GPTModel(cfg.model, ParallelTopology.single(), seed=cfg.train.seed)
    return {p.init_spec.key: p.detach() for p in ref.parameters()}, ref


def _world(rank, world):
    from megazero.config import load_config
    from megazero.distributed.topology import ParallelTopology
    from megazero.tensor_parallel.utils import shard_full_param
    from megazero.training.builders import build_model_chunks_on

    out = []
    for name, extra in MODELS.items():
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            cfg = load_config(ARGV + extra + [f"--tensor-model-parallel-size={tp}",
                                              f"--pipeline-model-parallel-size={pp}",
                                              f"--zero-stage={rank % 3}"], world)
            topo = ParallelTopology.build(tp=tp, pp=pp)
            chunks, param_init = build_model_chunks_on(cfg, topo, torch.device("cpu"))
            assert param_init is None
            full, ref = _reference(cfg)
            same = n = 0
            for chunk in chunks:
                for p in chunk.parameters():
                    assert type(p) is torch.nn.Parameter and p.device.type == "cpu"
                    want = shard_full_param(full[p.init_spec.key], p, topo)
                    same += bool(torch.equal(p.detach(), want))
                    n += 1
                if chunk.rotary is not None:
                    assert torch.equal(chunk.rotary.cos, ref.rotary.cos)
            out.append((name, tp, pp, n, same))
    return out


def test_device_build_is_bitwise_the_single_process_model():
    for rows in run_distributed(_world, 4, timeout=300):
        assert len(rows) == 8
        for name, tp, pp, n, same in rows:
            assert n > 10 and same == n, (name, tp, pp, n, same)


def _host_peak(device: torch.device) -> tuple[float, int, int]:
    """(peak host bytes during the build, bytes of the built weights, largest tensor)."""
    from megazero.config import load_config
    from megazero.distributed.topology import ParallelTopology
    from megazero.testing.planner_validate import LiveStorageBytes
    from megazero.training.builders import build_model_chunks_on

    # the largest tensor (embedding, 8 MiB) is over the generator's scratch (~4 MiB)
    cfg = load_config(("--num-layers 8 --hidden-size 128 --num-attention-heads 4 "
                       "--seq-length 16 --max-position-embeddings 16 --vocab-size 16384 "
                       "--micro-batch-size 1 --train-iters 1 --mock-data "
                       "--untie-embeddings-and-output-weights").split(), 1)
    with LiveStorageBytes() as meter:
        with meter.window():
            chunks, _ = build_model_chunks_on(cfg, ParallelTopology.single(), device)
    params = [p for c in chunks for p in c.parameters()]
    weights = sum(p.numel() * 4 for p in params) if device.type == "cpu" else 0
    return meter.peak, weights, max(p.numel() * 4 for p in params)


def test_host_holds_at_most_one_tensor_beyond_the_weights():
    peak, weights, largest = _host_peak(torch.device("meta"))
    assert weights == 0 and peak <= largest, (peak, largest)
    peak, weights, largest = _host_peak(torch.device("cpu"))
    assert weights > 2 * largest  # the check has teeth: the shard is several tensors
    assert peak <= weights + largest, (peak, weights, largest)
