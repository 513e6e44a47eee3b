"""Read a megazero checkpoint as (run config dict, global model state) for export and
generation.

The layout-independent reader is :func:`megazero.checkpointing.read_model_state`. Where it is not
available, checkpoints saved at tp=1, pp=1 (one ``mp_rank_00_000/model.pt``) are still read
directly: their state dict already has the global names, only the vocabulary padding is cut.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megazero.convert.hf import model_config_from_dict

_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def read_checkpoint(root: str, iteration: int | None = None
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config dict as saved in config.json, {global name: fp32 tensor, vocab unpadded})``."""
    try:
        from megazero.checkpointing import read_model_state
    except ImportError:
        return _read_single_layout(root, iteration)
    return read_model_state(root, iteration)


def _read_single_layout(root: str, iteration: int | None) -> tuple[dict, dict]:
    from megazero.checkpointing import CheckpointError, iteration_dir, read_tracker

    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"{root} holds no checkpoint ({root}/latest_checkpointed_"
                                  "iteration.txt is missing); pass the --save directory of a run")
    directory = iteration_dir(root, iteration)
    meta_path = os.path.join(directory, "metadata.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{directory} has no metadata.json: the checkpoint is incomplete")
    layout = json.loads(open(meta_path, encoding="utf-8").read())["layout"]
    if (layout["tp"], layout["pp"], layout["vpp"]) != (1, 1, 1) or layout["zero_stage"] == 3:
        raise CheckpointError(f"{directory} was saved at tp={layout['tp']} pp={layout['pp']} "
                              f"vpp={layout['vpp']} zero_stage={layout['zero_stage']}; reading it "
                              "needs megazero.checkpointing.read_model_state (layout-independent "
                              "checkpoints)")
    config = json.loads(open(os.path.join(directory, "config.json"), encoding="utf-8").read())
    path = os.path.join(directory, "mp_rank_00_000", "model.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)["model"]["model0"]
    vocab = model_config_from_dict(config).vocab_size
    state = {k: (v[:vocab] if k in _VOCAB_PARAMS else v).float().contiguous()
             for k, v in saved.items()}
    return config, state
