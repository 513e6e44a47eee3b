"""Portable checkpoints: file I/O (:mod:`.files`), global tensor naming (:mod:`.tensors`), the
streaming save of each rank's ranges (:mod:`.save_ranges`) and reading them back
(:mod:`.reader`, :mod:`.ranged`, :mod:`.restore`).

The public entry points live in :mod:`megazero.checkpointing`.
"""
