"""Loader plug-in of ``tools/checkpoint/convert.py --loader hf``: a Hugging Face model
directory (``save_pretrained`` output of an architecture :mod:`megazero.convert.hf` lists,
offline) -> megazero's model config and global state.

``load(args)`` reads ``args.load_dir`` and returns ``(model_config_dict, global_state,
tokenizer_info)``: the :class:`~megazero.config.ModelConfig` fields as a dict, the global state
(tp=1 names, fp32, vocabulary unpadded) and the megazero tokenizer settings found in the
directory (the ``data`` block of a run config: ``tokenizer_type`` plus ``tokenizer_model`` or
``vocab_file``/``merge_file``), or None when it holds no tokenizer megazero reads.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def add_arguments(parser) -> None:
    """Nothing beyond convert.py's --load-dir."""


def load(args: Any) -> tuple[dict[str, Any], dict, dict[str, str] | None]:
    from megazero.convert.hf import hf_to_megazero
    from megazero.convert.hf_files import find_tokenizer, read_hf_dir

    config, state = read_hf_dir(args.load_dir)
    model_config, global_state = hf_to_megazero(config, state)
    tokenizer = find_tokenizer(args.load_dir)
    if tokenizer is None:
        print(f"loader_hf: {args.load_dir} has no tokenizer.model, vocab.json + merges.txt or "
              "tokenizer.json; "
              "converting the weights alone", file=sys.stderr)
    return dataclasses.asdict(model_config), global_state, tokenizer
