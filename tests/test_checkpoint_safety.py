"""Checkpoint files are data: no code runs on load, damage is one clear error on every rank."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_checkpoint import _build, _train_steps

from megazero.checkpoint.files import sha256
from megazero.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megazero.testing.distributed import DistributedTestError, run_distributed
from megazero.topology import ParallelTopology


class _Payload:
    """Unpickling this would create ``path`` (arbitrary code execution)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _save_single(root):
    topo = ParallelTopology.single()
    models, opt, sched, tracker = _build(topo)
    _train_steps(models, opt, sched, 2)
    save_checkpoint(root, 3, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=24, config={"model": {"hidden_size": 4}},
                    rng_tracker=tracker)
    return os.path.join(root, "iter_0000003")


def _load_single(root, **kw):
    topo = ParallelTopology.single()
    models, opt, sched, tracker = _build(topo, seed=3)
    return load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched,
                           rng_tracker=tracker, **kw)


def _rewrite_checksum(directory, rel):
    meta_path = os.path.join(directory, "metadata.json")
    meta = json.load(open(meta_path))
    path = os.path.join(directory, rel)
    meta["files"][rel] = {"sha256": sha256(path), "bytes": os.path.getsize(path)}
    json.dump(meta, open(meta_path, "w"))


def test_pickle_payload_does_not_execute(tmp_path):
    directory = _save_single(str(tmp_path / "ck"))
    marker = tmp_path / "pwned"
    rel = "mp_rank_00_000/model.pt"
    torch.save({"model0.weight": _Payload(str(marker))}, os.path.join(directory, rel))
    _rewrite_checksum(directory, rel)  # a consistent, malicious checkpoint
    with pytest.raises(CheckpointError, match=r"mp_rank_00_000/model\.pt cannot be read safely"):
        _load_single(str(tmp_path / "ck"))
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_damaged_shard_is_one_error_naming_the_file(tmp_path, damage):
    directory = _save_single(str(tmp_path / "ck"))
    path = os.path.join(directory, "mp_rank_00_000", "model.pt")
    data = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "flip":
        i = len(data) // 2
        open(path, "wb").write(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])
    else:
        os.remove(path)
    expect = {"truncate": "bytes", "flip": "SHA-256", "missing": "is missing"}[damage]
    with pytest.raises(CheckpointError, match=rf"mp_rank_00_000/model\.pt .*{expect}"):
        _load_single(str(tmp_path / "ck"))


def test_truncated_metadata_and_other_model(tmp_path):
    root = str(tmp_path / "ck")
    directory = _save_single(root)
    with pytest.raises(CheckpointError, match=r"--hidden-size is 8 but the checkpoint was "
                       r"saved with 4 \(config\.json\)"):
        _load_single(root, config={"model": {"hidden_size": 8}})
    meta = os.path.join(directory, "metadata.json")
    text = open(meta).read()
    open(meta, "w").write(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"iter_0000003/metadata\.json cannot be read"):
        _load_single(root)


def _save_tp2(rank, world, root):
    topo = ParallelTopology.build(tp=2)
    models, opt, sched, tracker = _build(topo)
    _train_steps(models, opt, sched, 1)
    save_checkpoint(root, 1, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=8, config={}, rng_tracker=tracker)


def _load_tp2(rank, world, root):
    topo = ParallelTopology.build(tp=2)
    models, opt, sched, tracker = _build(topo, seed=1)
    before = models[0].weight.detach().clone()
    try:
        load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched,
                        rng_tracker=tracker)
    except CheckpointError as e:
        # nothing was applied on any rank: the error came before any state changed
        return str(e), torch.equal(before, models[0].weight)
    return None, None


def test_all_ranks_agree_before_loading(tmp_path):
    root = str(tmp_path / "ck")
    run_distributed(_save_tp2, 2, root, timeout=60)
    path = os.path.join(root, "iter_0000001", "mp_rank_01_000", "model.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:100])  # only tp rank 1 reads this shard
    out = run_distributed(_load_tp2, 2, root, timeout=60)
    assert len({msg for msg, _ in out}) == 1  # every rank raises the same message
    for msg, untouched in out:
        assert "mp_rank_01_000/model.pt has 100 bytes" in msg and untouched
    with pytest.raises(DistributedTestError):  # (a run that does not catch it stops)
        run_distributed(_load_and_raise, 2, root, timeout=60)


def _load_and_raise(rank, world, root):
    msg, _ = _load_tp2(rank, world, root)
    raise CheckpointError(msg)


def test_old_format_is_one_line(tmp_path):
    root = str(tmp_path / "ck")
    directory = _save_single(root)
    meta = os.path.join(directory, "metadata.json")
    old = json.load(open(meta))
    json.dump({"iteration": 3, "layout": old["layout"]}, open(meta, "w"))  # format 1 marker
    with pytest.raises(CheckpointError, match="old per-layout format") as e:
        _load_single(root)
    assert "\n" not in str(e.value)
