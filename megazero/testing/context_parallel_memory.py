"""Activation bytes and step time of a small GPT at context-parallel sizes 1, 2, 4, at one
fixed sequence length, measured in one world (``bench/context_parallel.py`` and the tests).

Every CP size runs the same model on its share of the same batch: CP 1 on each rank alone
(SDPA core attention: its fused CPU kernel keeps no ``s^2`` term, only the output and a
log-sum-exp, as ring attention does), CP 2 and 4 over groups of the world. Saved bytes are
counted as the pipeline's activation meter counts them (every storage autograd keeps, once,
parameters excluded), for one micro-batch through the whole model.
"""

from __future__ import annotations

import time

import torch


def _model(cfg, topo, comm_type: str):
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel.context import ParallelContext

    parallel = ParallelContext.from_topology(topo, attention_backend="sdpa",
                                             cp_comm_type=comm_type)
    return GPTModel(cfg.model, topo, parallel=parallel, seed=cfg.train.seed)


def measure_cp_sizes(rank: int, world: int, flags: list[str], cps: tuple[int, ...] = (1, 2, 4),
                     comm_type: str = "p2p", repeats: int = 0) -> list[dict]:
    """Rank 0's row per CP size: measured saved bytes of one forward, the planner's
    prediction for it, and (``repeats`` > 0) the median forward+backward seconds."""
    from megazero.config import load_config
    from megazero.context_parallel.batch import split_batch
    from megazero.distributed.topology import ParallelTopology
    from megazero.pipeline.activation_meter import ActivationMeter
    from megazero.planner.activations import chunk_saved_bytes

    rows = []
    for cp in cps:
        cfg = load_config([*flags, "--context-parallel-size", str(cp),
                           "--cp-comm-type", comm_type], world)
        topo = ParallelTopology.build(cp=cp) if cp > 1 else ParallelTopology.single()
        model = _model(cfg, topo, comm_type)
        m = cfg.model
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, m.vocab_size, (cfg.train.micro_batch_size, m.seq_length + 1),
                               generator=g)
        batch = split_batch({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]},
                            topo.cp_rank, topo.cp_size)
        meter = ActivationMeter()
        meter.start(list(model.parameters()))
        with meter.forward((0, 0)):
            loss = model(batch["tokens"], batch["labels"]).float().mean()
        saved = meter.live[(0, 0)]
        loss.backward()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(batch["tokens"], batch["labels"]).float().mean().backward()
            times.append(time.perf_counter() - t0)
        predicted = chunk_saved_bytes(cfg, 0, flash=True)[0]
        rows.append({"cp": cp, "comm_type": comm_type, "seq": m.seq_length,
                     "local_seq": m.seq_length // cp, "measured_bytes": saved,
                     "predicted_bytes": predicted, "seconds": times})
        del model
    return rows
