"""megazero: pretraining GPT models with tensor, pipeline and ZeRO data parallelism."""

from typing import Any

__version__ = "0.1.0"


def initialize(*args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``deepspeed.initialize``: see :func:`megazero.engine.initialize`."""
    from megazero.engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(dist_backend: Any = None, **kwargs: Any) -> None:
    """DeepSpeed's ``deepspeed.init_distributed``: see :func:`megazero.engine.init_distributed`."""
    from megazero.engine import init_distributed as _init

    _init(dist_backend, **kwargs)
