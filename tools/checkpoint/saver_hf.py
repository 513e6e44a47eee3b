"""Saver plug-in of ``tools/checkpoint/convert.py --saver hf``: megazero's model config and
global state -> a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load offline.

``save(args, model_config_dict, global_state, tokenizer_info)`` writes into ``args.save_dir``:
``config.json`` and ``model.safetensors`` (fp32), plus the tokenizer when ``tokenizer_info``
names SentencePiece (a Llama tokenizer) or GPT-2 BPE files. ``model_config_dict`` may be the
ModelConfig fields or a whole run config (``{"model": ..., "data": ...}``, as in a checkpoint's
config.json); in the latter case its ``data`` block is the tokenizer when none is given.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def add_arguments(parser) -> None:
    """Nothing beyond convert.py's --save-dir."""


def save(args: Any, model_config_dict: dict[str, Any], global_state: dict,
         tokenizer_info: dict[str, Any] | None) -> list[str]:
    """Returns the names of the files written."""
    from megazero.convert.hf import megazero_to_hf
    from megazero.convert.hf_files import export_tokenizer, write_hf_dir

    if tokenizer_info is None and isinstance(model_config_dict.get("data"), dict):
        tokenizer_info = model_config_dict["data"]
    config, state = megazero_to_hf(model_config_dict, global_state)
    written = write_hf_dir(args.save_dir, config, state)
    tokenizer_files = export_tokenizer(tokenizer_info, args.save_dir)
    if not tokenizer_files:
        print(f"saver_hf: no SentencePiece or GPT-2 BPE tokenizer given; {args.save_dir} holds "
              "the weights alone", file=sys.stderr)
    return written + tokenizer_files
