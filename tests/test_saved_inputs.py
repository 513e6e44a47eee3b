"""Full recomputation's kept inputs distributed over tensor-parallel ranks
(``--distribute-saved-activations`` / DeepSpeed's ``partition_activations``) or kept on the host
(``cpu_checkpointing``): the same loss and gradients, bit for bit, and 1/tp of the bytes."""

import json
import warnings

import pytest
import torch

from megazero.config import RecomputeConfig, load_config
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.saved_inputs import SavedInputLayout
from megazero.testing import run_distributed
from megazero.testing.activation_memory import measure_saved_bytes
from megazero.testing.launch import TINY
from megazero.testing.tiny_gpt import BATCH, SEQ, batch, loss_and_grads, tiny_config


def _layouts(rank: int, world: int) -> dict:
    topo = ParallelTopology.build(tp=world)
    tokens, labels = batch()
    cfg = tiny_config("gpt2", num_layers=4, hidden_dropout=0.1, attention_dropout=0.1)
    out: dict = {}
    reference = None
    for name, kw in (("whole", {}), ("distributed", {"distribute_saved_activations": True}),
                     ("host", {"cpu_checkpointing": True}),
                     ("both", {"distribute_saved_activations": True,
                               "cpu_checkpointing": True})):
        model = GPTModel(cfg, topo, recompute=RecomputeConfig("full", "uniform", 1, **kw),
                         parallel=ParallelContext.from_topology(topo))
        loss, grads = loss_and_grads(model, topo, tokens, labels)
        model.zero_grad(set_to_none=True)
        saved = measure_saved_bytes(model, tokens, labels)
        layout = model.decoder.saved_inputs
        reference = reference or (loss, grads)
        # bit for bit the whole-input run's loss and gradients (compared here: tensors do not
        # travel back from a finished rank)
        same = torch.equal(loss, reference[0]) and all(
            torch.equal(g, reference[1][key]) for key, g in grads.items())
        out[name] = {"same": same, "grads": len(grads), "saved": saved,
                     "layout": None if layout is None else (layout.size, layout.to_host)}
    # a piece of an input whose size the group does not divide: padded, then cut back
    odd = torch.arange(3 * 5 * 7, dtype=torch.float32).view(3, 5, 7) + rank * 0  # same on all
    layout = SavedInputLayout(topo.tp_group, topo.tp_rank, topo.tp_size)
    kept = layout.pack(odd)
    out["odd"] = (kept.numel(), torch.equal(layout.unpack(kept, odd.shape, odd.device), odd))
    return out


def test_distributed_and_host_inputs_train_the_same_model_with_less_kept():
    for r in run_distributed(_layouts, 2, timeout=180):
        whole = r["whole"]
        assert whole["layout"] is None and whole["grads"] > 10
        for name in ("distributed", "host", "both"):
            assert r[name]["same"] and r[name]["grads"] == whole["grads"], name
        # four groups of one layer, each keeping an [s, b, h] fp32 input: half of it at tp 2
        group_input = SEQ * BATCH * 32 * 4
        assert whole["saved"] - r["distributed"]["saved"] == 4 * group_input // 2
        assert r["distributed"]["layout"] == (2, False) and r["both"]["layout"] == (2, True)
        assert r["host"]["layout"] == (1, True)
        assert r["odd"] == (53, True)  # 105 elements: 53 per rank, the pad dropped


def _config(tmp_path, flags: list[str], ds: dict | None = None, world: int = 2):
    argv = [*TINY, "--train-iters", "2", *flags]
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        argv += ["--deepspeed_config", str(path)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(argv, world)
    return cfg.parallel, [str(w.message) for w in caught]


FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]


def test_the_flags_and_deepspeeds_keys(tmp_path):
    p, said = _config(tmp_path, [*FULL, "--tensor-model-parallel-size", "2",
                                 "--distribute-saved-activations"])
    assert p.distribute_saved_activations and p.recompute.distribute_saved_activations
    assert said == []
    p, said = _config(tmp_path, [*FULL, "--tensor-model-parallel-size", "2"],
                      {"activation_checkpointing": {"partition_activations": True,
                                                    "cpu_checkpointing": True,
                                                    "contiguous_memory_optimization": False}})
    assert p.distribute_saved_activations and p.cpu_checkpointing and said == []


@pytest.mark.parametrize("flags, why", [
    (["--distribute-saved-activations", "--tensor-model-parallel-size", "2"],
     "needs --recompute-granularity full"),
    ([*FULL, "--distribute-saved-activations"], "nothing to distribute at "
                                                "--tensor-model-parallel-size 1"),
    ([*FULL, "--distribute-saved-activations", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], "nothing to distribute with --sequence-parallel"),
])
def test_settings_with_nothing_to_act_on_warn_once_and_turn_off(tmp_path, flags, why):
    p, said = _config(tmp_path, flags)
    assert not p.distribute_saved_activations
    assert len(said) == 1 and why in said[0] and "turning it off" in said[0], said
    p, said = _config(tmp_path, [], {"activation_checkpointing": {"cpu_checkpointing": True}})
    assert not p.cpu_checkpointing and len(said) == 1 and "cpu_checkpointing" in said[0]
