"""Hugging Face model directories on disk: weights, config and tokenizer files.

Weights are read from ``model.safetensors``, sharded ``model-*.safetensors`` (through
``model.safetensors.index.json``) or, failing those, ``pytorch_model.bin`` loaded with
``weights_only=True`` (files are data, never code). They are written as one
``model.safetensors``; a tied head is not written twice (HF re-ties it on load).

Tokenizers: a SentencePiece model becomes a Llama tokenizer (``tokenizer.model`` plus the files
transformers' ``save_pretrained`` adds), GPT-2 byte-level BPE files are HF's own ``vocab.json``
and ``merges.txt``. In the other direction a directory holding those files yields megazero's
tokenizer settings (the ``data`` block of a run config).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

SP_MODEL, GPT2_VOCAB, GPT2_MERGES = "tokenizer.model", "vocab.json", "merges.txt"


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
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    try:  # the full config with transformers' defaults, when transformers is installed
        from transformers import AutoConfig

        cfg = dict(config)
        AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(path)
    except ImportError:
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return ["config.json", "model.safetensors"]


def find_tokenizer(path: str) -> dict[str, str] | None:
    """megazero tokenizer settings for the tokenizer files in ``path``, or None if it has none
    megazero can use (``tokenizer.json`` alone is not read)."""
    sp = os.path.join(path, SP_MODEL)
    if os.path.isfile(sp):
        return {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": os.path.abspath(sp)}
    vocab, merges = os.path.join(path, GPT2_VOCAB), os.path.join(path, GPT2_MERGES)
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.abspath(vocab),
                "merge_file": os.path.abspath(merges)}
    return None


def export_tokenizer(info: dict[str, Any] | None, path: str) -> list[str]:
    """Write an HF tokenizer for megazero tokenizer settings ``info`` into ``path``; returns the
    files written (empty when ``info`` names no tokenizer files)."""
    info = info or {}
    kind = info.get("tokenizer_type")
    os.makedirs(path, exist_ok=True)
    before = set(os.listdir(path))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        src = info.get("tokenizer_model")
        _need_file(src, "tokenizer_model (--tokenizer-model)")
        shutil.copyfile(src, os.path.join(path, SP_MODEL))
        from transformers import LlamaTokenizer

        LlamaTokenizer.from_pretrained(path).save_pretrained(path)
    elif kind == "GPT2BPETokenizer":
        for key, name in (("vocab_file", GPT2_VOCAB), ("merge_file", GPT2_MERGES)):
            _need_file(info.get(key), f"{key} (--{key.replace('_', '-')})")
            shutil.copyfile(info[key], os.path.join(path, name))
        from transformers import GPT2Tokenizer

        GPT2Tokenizer.from_pretrained(path).save_pretrained(path)
    else:
        return []
    return sorted(f for f in os.listdir(path)
                  if f not in before or f in (SP_MODEL, GPT2_VOCAB, GPT2_MERGES))


def _need_file(path: str | None, what: str) -> None:
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path!r} ({what}) not found; point it at the "
                                "file or convert the weights alone")
