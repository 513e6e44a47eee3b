"""What a run reports: the Megatron-style log line and its sinks (:mod:`.monitor`), wall-clock
regions (:mod:`.timers`), DeepSpeed's communication logger (:mod:`.comms_logging`) and FLOPs
profiler (:mod:`.flops_profiler`), model FLOPs and MFU (:mod:`.flops`), and Megatron's
``--profile`` window (:mod:`.profiling`).

Their settings (the ``comms_logger`` and ``flops_profiler`` blocks) are validated in
:mod:`megazero.config`; the training run (:mod:`megazero.training`) drives them.
"""
