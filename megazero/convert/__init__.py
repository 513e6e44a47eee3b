"""Conversion between megazero's global (tp=1, unpadded) model state and other formats."""

from megazero.convert.hf import (
    ConversionError,
    hf_to_megazero,
    megazero_to_hf,
    model_config_from_dict,
)
from megazero.convert.state import load_global_state, model_global_state

__all__ = ["ConversionError", "hf_to_megazero", "megazero_to_hf", "model_config_from_dict",
           "load_global_state", "model_global_state"]
