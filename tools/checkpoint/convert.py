"""Convert checkpoints between formats through one in-memory model state.

::

    python tools/checkpoint/convert.py --loader megazero --saver torch \\
        --load-dir CKPT --save-dir OUT [--dtype bf16] [--iteration N]

``--loader megazero`` reads a megazero checkpoint of any layout (tp, pp, vpp, dp, ZeRO 0-3)
into the global fp32 state dict (tp=1 names, unpadded vocabulary; fp32 masters where saved:
DeepSpeed's ``zero_to_fp32`` job). ``--saver torch`` writes it as one ``model.pt``
(``torch.save`` of ``{name: tensor}``) plus ``config.json``; ``--saver megazero`` writes a
weights-only megazero checkpoint that ``pretrain_gpt.py --load OUT --finetune`` loads at any
layout. ``--loader hf`` reads a local Hugging Face directory (GPT-2, Llama, GPT-NeoX,
Mixtral, Qwen2, Qwen2-MoE, Qwen3 or Qwen3-MoE, config.json plus safetensors or
``pytorch_model.bin``, sharded or not; tokenizer files when present) and
``--saver hf`` writes one that ``transformers.AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load (:mod:`megazero.convert`)::

    python tools/checkpoint/convert.py --loader hf --saver megazero --load-dir HF --save-dir CK
    python tools/checkpoint/convert.py --loader megazero --saver hf --load-dir CK --save-dir HF

Loaders and savers are plain functions in :data:`LOADERS` / :data:`SAVERS`, so other formats
plug in by adding an entry: a loader returns ``(config dict, state dict)``, a saver writes
them. Every error is one line; nothing is left in ``--save-dir`` when conversion fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megazero.checkpoint import read_model_state, write_model_state
from megazero.errors import CheckpointError

Loader = Callable[[argparse.Namespace], tuple[dict[str, Any], dict[str, torch.Tensor]]]
Saver = Callable[[argparse.Namespace, dict[str, Any], dict[str, torch.Tensor], str], None]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_megazero(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return read_model_state(args.load_dir, args.iteration)


def save_torch(args: argparse.Namespace, config: dict[str, Any],
               state: dict[str, torch.Tensor], out: str) -> None:
    torch.save(state, os.path.join(out, "model.pt"))
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


def save_megazero(args: argparse.Namespace, config: dict[str, Any],
                  state: dict[str, torch.Tensor], out: str) -> None:
    write_model_state(out, config, state)


def _plugin(name: str) -> Any:
    """A loader/saver module beside this script (importable however the script was started)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_hf(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A local Hugging Face directory (config.json + safetensors/bin, sharded or not); the
    tokenizer files it holds, if any, become the run config's ``data`` block."""
    model_config, state, tokenizer = _plugin("loader_hf").load(args)
    return {"model": model_config, "data": tokenizer or {}}, state


def save_hf(args: argparse.Namespace, config: dict[str, Any],
            state: dict[str, torch.Tensor], out: str) -> None:
    """A directory transformers' ``from_pretrained`` loads, tokenizer included when the
    checkpoint's run config names one."""
    args = argparse.Namespace(**{**vars(args), "save_dir": out})
    _plugin("saver_hf").save(args, config, state, None)


LOADERS: dict[str, Loader] = {"megazero": load_megazero, "hf": load_hf}
SAVERS: dict[str, Saver] = {"torch": save_torch, "megazero": save_megazero, "hf": save_hf}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loader", required=True, choices=sorted(LOADERS),
                   help="what --load-dir holds: megazero (a checkpoint of any layout) or hf (a "
                        "Hugging Face GPT-2, Llama or GPT-NeoX directory)")
    p.add_argument("--saver", required=True, choices=sorted(SAVERS),
                   help="what to write: torch (one model.pt + config.json), megazero (a "
                        "checkpoint that loads at any layout, e.g. for --finetune) or hf (a "
                        "directory transformers' from_pretrained loads, tokenizer included)")
    p.add_argument("--load-dir", required=True, help="the directory to read")
    p.add_argument("--save-dir", required=True,
                   help="the directory to write (left as it was if the conversion fails)")
    p.add_argument("--iteration", type=int, default=None,
                   help="checkpoint iteration to read (default: the latest)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="dtype of the written tensors (default fp32)")
    return p.parse_args(argv)


def convert(args: argparse.Namespace) -> str:
    """Load, cast, save into a temporary directory beside ``--save-dir``, then move the
    files in: a failure leaves ``--save-dir`` as it was."""
    config, state = LOADERS[args.loader](args)
    dtype = DTYPES[args.dtype]
    state = {k: v.to(dtype) for k, v in state.items()}
    parent = os.path.dirname(os.path.abspath(args.save_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        SAVERS[args.saver](args, config, state, tmp)
        os.makedirs(args.save_dir, exist_ok=True)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(args.save_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return args.save_dir


HF_EXTRA = ("safetensors", "transformers", "tokenizers", "google", "sentencepiece")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        out = convert(args)
    except ImportError as e:
        name = (e.name or "").split(".")[0]
        hint = (" (pip install -e '.[hf]' installs what --loader/--saver hf need)"
                if name in HF_EXTRA else "")
        print(f"convert.py: error: {e}{hint}", file=sys.stderr)
        return 2
    except (CheckpointError, ValueError, OSError, KeyError) as e:  # ConversionError is a ValueError
        print(f"convert.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.saver} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
