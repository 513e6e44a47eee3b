"""GPT model built for one pipeline chunk, with tensor/sequence parallelism."""

from megazero.model.gpt import GPTModel
from megazero.model.init import initialize_parameters
from megazero.model.recompute import apply_recompute

__all__ = ["GPTModel", "apply_recompute", "initialize_parameters"]
