"""Saver plug-in of ``tools/checkpoint/convert.py --saver hf``: megazero's model config and
global state -> a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load offline.

``save(args, model_config_dict, global_state, tokenizer_info)`` writes into ``args.save_dir``:
``config.json``, ``generation_config.json`` and ``model.safetensors`` (fp32), plus the tokenizer
when ``tokenizer_info`` names SentencePiece, GPT-2 BPE or ``tokenizer.json`` files
(:mod:`megazero.convert.hf_tokenizer`: ``AutoTokenizer`` then gives the ids training saw, and the
configs name that tokenizer's bos/eos/pad ids; without a tokenizer they name none).
``model_config_dict`` may be the ModelConfig fields or a whole run config (``{"model": ...,
"data": ...}``, as in a checkpoint's config.json); in the latter case its ``data`` block is the
tokenizer when none is given.
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
    from megazero.convert.hf_files import write_generation_config, write_hf_dir
    from megazero.convert.hf_tokenizer import export_tokenizer

    if tokenizer_info is None and isinstance(model_config_dict.get("data"), dict):
        tokenizer_info = model_config_dict["data"]
    config, state = megazero_to_hf(model_config_dict, global_state)
    tok = export_tokenizer(tokenizer_info, args.save_dir)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    written = write_hf_dir(args.save_dir, {**config, **ids}, state)
    written.append(write_generation_config(args.save_dir, tok.bos_token_id, tok.eos_token_id,
                                           tok.pad_token_id))
    tokenizer_files = tok.files
    if not tokenizer_files:
        print(f"saver_hf: no SentencePiece, GPT-2 BPE or tokenizer.json tokenizer given; "
              f"{args.save_dir} holds the weights alone", file=sys.stderr)
    return written + tokenizer_files
