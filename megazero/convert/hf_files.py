"""Hugging Face model directories on disk: weights, config and tokenizer files.

Weights are read from ``model.safetensors``, sharded ``model-*.safetensors`` (through
``model.safetensors.index.json``) or, failing those, ``pytorch_model.bin`` loaded with
``weights_only=True`` (files are data, never code). They are written as one
``model.safetensors``; a tied head is not written twice (HF re-ties it on load).

Files are written with the permissions of any new file (0644 under the usual umask), not the
0600 of a temporary file. Tokenizers: :mod:`megazero.convert.hf_tokenizer`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megazero.convert.hf_tokenizer import find_tokenizer

__all__ = ["read_hf_dir", "write_hf_dir", "write_generation_config", "find_tokenizer"]


def read_hf_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json as a dict, state dict)`` of a saved HF causal LM."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found: --load-dir must be a Hugging Face model "
                                "directory (save_pretrained output)")
    config = json.load(open(cfg_path, encoding="utf-8"))
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single) or os.path.isfile(index):
        from safetensors.torch import load_file

        files = ([single] if os.path.isfile(single) else sorted(
            {os.path.join(path, f) for f in json.load(open(index))["weight_map"].values()}))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        return config, state
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        return config, torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} has no model.safetensors, model.safetensors.index.json or "
                            "pytorch_model.bin")


def write_hf_dir(path: str, config: dict[str, Any], state: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> list[str]:
    """Write ``config.json`` and ``model.safetensors``; returns the file names written."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    if config.get("tie_word_embeddings", True):
        tensors.pop("lm_head.weight", None)
    weights = os.path.join(path, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    _normal_mode(weights)
    try:  # the full config with transformers' defaults, when transformers is installed
        from transformers import AutoConfig

        cfg = dict(config)
        AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(path)
    except ImportError:
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return ["config.json", "model.safetensors"]


def write_generation_config(path: str, bos: int | None, eos: int | None, pad: int | None) -> str:
    """``generation_config.json`` with the tokenizer's special ids. A vocabulary without a pad
    token pads finished sequences with eos, as megazero's generation does."""
    cfg = {"bos_token_id": bos, "eos_token_id": eos,
           "pad_token_id": pad if pad is not None else eos}
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=2)
    return "generation_config.json"


def _normal_mode(file: str) -> None:
    """Give ``file`` the mode a newly created file gets (0666 minus the umask): writers that go
    through a temporary file leave 0600, which other users and containers cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(file, 0o666 & ~mask)
