"""One ``pretrain_gpt.py`` run: :func:`megazero.training.pretrain.pretrain` sets it up
(:mod:`.lifecycle`, with the builders of :mod:`.builders`), runs the loop (:mod:`.loop`, one
iteration in :mod:`.step`), saves and loads by :mod:`.save_policy`, and ends it.

Around the loop: the start-up banner (:mod:`.banner`), checks before resuming
(:mod:`.resume_checks`), agreed exit conditions (:mod:`.exit_conditions`), non-finite steps and
spikes (:mod:`.divergence`) and the watchdog that ends a stuck rank (:mod:`.watchdog`).

This package uses the library; nothing in the library imports it (megatron-core's rule for
``core/`` and ``megatron/training``).
"""
