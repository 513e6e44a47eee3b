"""The guards in :mod:`megazero.distributed.compat` resolve to an implementation on every supported
torch."""


from megazero.distributed import compat


def test_single_tensor_collectives_resolve(monkeypatch):
    """The recent name where torch has it, else the 2.0 one; looked up at each call, so a
    wrapper installed in torch.distributed afterwards (the communication logger) sees it."""
    import torch.distributed as dist

    calls = []
    for name, old in (("all_gather_single", "all_gather_into_tensor"),
                      ("reduce_scatter_single", "reduce_scatter_tensor")):
        target = name if hasattr(dist, name) else old
        monkeypatch.setattr(dist, target, lambda *a, _n=target, **k: calls.append((_n, a, k)))
    compat.all_gather_into_tensor("out", "in", group=None, async_op=True)
    compat.reduce_scatter_tensor("out", "in", group=None)
    assert [c[0] for c in calls] == [
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor",
        "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"]
    assert calls[0][1:] == (("out", "in"), {"group": None, "async_op": True})
    assert compat.TORCH_VERSION >= (2, 11)  # setup.py's oldest supported torch
