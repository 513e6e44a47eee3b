"""The guards in :mod:`megazero.compat` resolve to an implementation on every supported torch."""


from megazero import compat


def test_single_tensor_collectives_resolve():
    import torch.distributed as dist

    assert compat.all_gather_into_tensor in (getattr(dist, "all_gather_single", None),
                                             dist.all_gather_into_tensor)
    assert compat.TORCH_VERSION >= (2, 11)  # setup.py's oldest supported torch
