#!/usr/bin/env bash
# Every GPU check in one pass on one GPU machine, each step's output under $OUT (default
# bench/results/gpu_logs): the environment and the attention kernels megazero selects; the CPU
# suite (niced, in the background, capped at $SUITE_S seconds) beside the gpu-marked tests; the
# save/resume matrix of training paths (bench/gpu_matrix.py: ZeRO 0-3, offload, FP8 recipes,
# asynchronous saves, deferred weight gradients, the fusions off); then, alone on the machine, the
# step-time/MFU benchmark (bench/gpu_step.py) of GPT 1.3B and Llama 1.5B at micro-batch 8, the
# elementwise fusions on and off, with a profiler table of one megazero step; and the GEMMs
# that --tp-comm-overlap splits into row chunks, whole and chunked (bench/chunked_gemm.py).
set -uo pipefail
OUT=${OUT:-bench/results/gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }

{
stamp "1. environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY - <<'PYEOF'
import torch
from megazero.model.attention_probe import describe_attention
try:
    import flash_attn
    fa = flash_attn.__version__
except ImportError:
    fa = "not installed"
d = torch.device("cuda")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, {torch.cuda.get_device_name(d)}, compute capability "
      f"{'.'.join(map(str, torch.cuda.get_device_capability(d)))}, flash-attn {fa}")
for name, heads, groups, dim in (("GPT 1.3B", 16, 16, 128), ("Llama 1.5B", 32, 8, 64)):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        print(f"attention, {name}, {dtype}:",
              describe_attention("auto", True, d, dtype, heads, groups, dim, 0.0))
PYEOF
} 2>&1 | tee "$OUT/steps.log"

stamp "2a. CPU suite in the background" | tee -a "$OUT/steps.log"
# SIGINT at the time limit (KILL 30 s later): pytest then still prints its summary, and
# --tb=short -rfE puts every failure's traceback and a one-line list into suite.log (no extra
# file: only 8 come back from $OUT).
(nice -n 19 timeout -s INT -k 30 "${SUITE_S:-180}" $PY -m pytest -q -n "${SUITE_WORKERS:-10}" \
    -m "not gpu" --tb=short -rfE -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
 echo "suite exit $?" >> "$OUT/suite.log") &
SUITE=$!

stamp "2b. gpu-marked tests, and 3. training paths saved and resumed (side by side)" \
    | tee -a "$OUT/steps.log"
timeout "${GPU_TESTS_S:-150}" $PY -m pytest -q -m gpu -rs -p no:cacheprovider tests \
    > "$OUT/gpu_tests.log" 2>&1 &
TESTS=$!
timeout "${MATRIX_S:-150}" $PY bench/gpu_matrix.py --jobs 4 --out "$OUT/gpu_matrix.json" \
    > "$OUT/matrix.log" 2>&1
wait $TESTS
tail -4 "$OUT/gpu_tests.log"
tail -12 "$OUT/matrix.log"
stamp "waiting for the CPU suite" | tee -a "$OUT/steps.log"
wait $SUITE
grep -E "^(FAILED|ERROR) " "$OUT/suite.log" | head -40 | tee -a "$OUT/steps.log"
tail -3 "$OUT/suite.log" | tee -a "$OUT/steps.log"

{
# --unfused: ZeRO-0 once more with every elementwise fusion off (what megazero.fusions gains);
# the fused runs compile their Triton kernels in the untimed warm-up iterations.
stamp "4. step time and MFU, GPT 1.3B, micro-batch 8"
timeout "${GPT_S:-260}" $PY bench/gpu_step.py --preset gpt --micro-batch-size 8 --stages 0,3 --iters 6 \
    --warmup 2 --profile --unfused --out "$OUT/gpu_step_gpt_mb8.json"
stamp "4. step time and MFU, Llama 1.5B, micro-batch 8"
timeout "${LLAMA_S:-170}" $PY bench/gpu_step.py --preset llama --micro-batch-size 8 --stages 0,3 --iters 6 \
    --warmup 2 --no-compile --unfused --out "$OUT/gpu_step_llama_mb8.json"
# the GEMMs --tp-comm-overlap chunks (Llama-2 70B's at TP 8), whole and in 2/4/8 row chunks:
# the planner's gemm_half_rate_rows. Its JSON goes into bench.log (no ninth file comes back);
# save it as bench/results/chunked_gemm_<device>.json.
stamp "5. chunked GEMMs (gemm_half_rate_rows)"
CG_JSON=${TMPDIR:-/tmp}/chunked_gemm.json
timeout "${CHUNKED_S:-60}" $PY bench/chunked_gemm.py --device cuda --out "$CG_JSON" \
    && { echo "chunked_gemm JSON:"; cat "$CG_JSON"; }
stamp "done"
} 2>&1 | tee "$OUT/bench.log"
