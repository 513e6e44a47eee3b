"""Save and load training state in a layout-independent ("portable") format, atomically.

::

    SAVE/latest_checkpointed_iteration.txt     "10": the newest complete checkpoint
    SAVE/.megazero-run.lock                    the run writing here (one at a time, see
                                               :mod:`megazero.checkpoint.ownership`)
    SAVE/iter_0000010/metadata.json            index of every tensor + file checksums, the
                                               run id that wrote it; written
                                               last, so its presence means "complete"
    SAVE/iter_0000010/config.json              the run's configuration
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/model_NNN.pt
                                               {"<global name>@<lo>": {"weight": 1-D range}}:
                                               the ranges of the weights' TP shards this rank
                                               owns, one file per I/O bucket
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/optim_NNN.pt
                                               the same for {master, exp_avg, exp_avg_sq, step}
                                               (Adam; SGD: {master, momentum_buffer}; Lion:
                                               {master, exp_avg})
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/optim_rng.pt
                                               each rank's RNG states (and the state of an
                                               optimizer that is not the ZeRO engine)
    SAVE/iter_0000010/extra_state.pt           optional: the caller's own state (the
                                               DeepSpeed-style engine's counters and
                                               ``client_state``), written by rank 0

With ``tag`` (the DeepSpeed-style engine) the directory is ``SAVE/<tag>`` and the tracker is
``SAVE/latest`` holding the tag, as DeepSpeed lays them out; the files inside are the same.

**Portable.** Every tensor is saved under its global name (its key in the tp=1, pp=1 model)
with the index recording its global shape (vocabulary padding stripped), TP split dim and
stride; see :mod:`megazero.checkpoint.tensors`. Each rank writes the flat ranges of each
parameter's TP shard that it owns (its ZeRO pieces: fp32 masters, moments and, at stages 1-3,
the weights of those ranges), from where they live, one I/O bucket at a time, and the index
lists every range (:mod:`megazero.checkpoint.save_ranges`); a save adds one bucket of host
memory and reduces nothing over dp but the step count. The ranges are cut by dp, the stage
and the buckets, but the index describes each as elements ``[lo, hi)`` of a named TP shard, so
nothing a reader needs depends on them. A loading rank computes the tensors it needs and
reads only those (``torch.load(mmap=True)``), range by range, straight into the parameters,
ZeRO-3 partitions and optimizer pieces that keep them (:mod:`megazero.checkpoint.restore`): no
rank builds the model, and its memory rises by little more than the Adam moments it creates.
Format version 2 (one whole TP piece per ``mp_rank_TT_PPP/model.pt`` / ``optim.pt``, written
by dp rank 0) still loads.
Weights, masters, Adam moments and step, the loss scaler, the scheduler and consumed samples
load at any tp / pp / vpp / dp / ZeRO stage / offload.
Random states are saved per rank and restored at the same tp, pp and vpp, whatever dp or the
ZeRO stage (see :func:`_rng_source` for why that is well defined and where it stops).

Why our own index rather than ``torch.distributed.checkpoint``: DCP's planner resolves
overlapping reads collectively and needs a process group to read, while this format must also
be read by one process with no ``torch.distributed`` (:func:`read_model_state`, the converter);
its flattened-shard support also doesn't cover TP strides or vocabulary un-padding. The index
is one JSON file a person can read.

**Safe.** Files are data: ``torch.load(weights_only=True)`` only (RNG states stored as tensors
and lists). ``metadata.json`` holds every file's size and SHA-256, checked before use. A rank
that cannot load reports its error and every rank raises the same :class:`CheckpointError`
(errors are gathered before anything is applied), so no rank goes on with half a checkpoint.

**Refused whole.** ``metadata.json`` names the format and its version; an index of another
version (older or newer), another format, or a directory another tool wrote (Megatron-LM's
``mp_rank_00/model_optim_rng.pt``, DeepSpeed's ``latest`` tag) is refused in one line naming the
file and what to do, before anything is read (:func:`megazero.checkpoint.reader.check_format`).

**Crash-safe.** Files are written under temporary names and renamed; every rank meets at a
barrier; only then rank 0 writes ``metadata.json`` and the ``latest`` pointer, and removes
temporaries left by earlier crashed saves. A crash at any point leaves ``latest`` naming the
previous complete checkpoint. Writes go through an injectable ``writer`` (tests crash it).

The package's modules: :mod:`.save` and :mod:`.load` (the entry points below), :mod:`.common`
(what both share), :mod:`.files` (atomic writes, checksums), :mod:`.tensors` (global tensor
naming), :mod:`.save_ranges` (the streaming save of each rank's ranges), :mod:`.reader`,
:mod:`.ranged` and :mod:`.restore` (reading them back), :mod:`.rng`, :mod:`.ownership` (one run
per ``--save`` directory) and :mod:`.save_check` (``--save`` checked before the first iteration).
"""

from megazero.checkpoint.common import config_dict
from megazero.checkpoint.files import Writer
from megazero.checkpoint.load import LoadResult, load_checkpoint
from megazero.checkpoint.reader import MARKER, TRACKER, iteration_dir, read_tracker
from megazero.checkpoint.save import save_checkpoint, write_model_state
from megazero.checkpoint.shard_reader import read_global_tensors, read_model_state
from megazero.errors import CheckpointError

__all__ = ["CheckpointError", "LoadResult", "Writer", "config_dict", "iteration_dir",
           "load_checkpoint", "read_global_tensors", "read_model_state", "read_tracker",
           "save_checkpoint", "write_model_state", "TRACKER", "MARKER"]
