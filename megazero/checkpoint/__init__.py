"""Portable checkpoints: file I/O (:mod:`.files`) and global tensor naming (:mod:`.tensors`).

The public entry points live in :mod:`megazero.checkpointing`.
"""
