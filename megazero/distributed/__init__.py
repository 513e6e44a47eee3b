"""Processes and how they talk: the layout's process groups (:mod:`.topology`), start-up from any
launcher's environment (:mod:`.startup`, :mod:`.device`), guards for older torch
(:mod:`.compat`), the backend-dependent collectives (:mod:`.collectives`, the shared-memory ones
of :mod:`.shm_collectives`, and :mod:`.group_comm`, the byte-counting wrapper that ZeRO and the
optimizers share), which peer died (:mod:`.peers`) and host memory (:mod:`.host_allocator`,
:mod:`.host_resident`).

Nothing here imports the model, the optimizers or the training run; the layout's pure rank
arithmetic lives in :mod:`megazero.config.layout`, below it.
"""
