#!/usr/bin/env bash
# The first thing to run on a machine with GPUs: the tests that need CUDA, then the table of speed-ups (the gpt2
# preset in bf16 at one process: DDP, FSDP2, FSDP1, eager and then one option more a row; docs/performance.md,
# "Step by step"). The tests took 1.5 minutes on one H200 (18 of them, before issue 73 added 2); the table is held
# to 8 minutes: each row it finished is in runs/benchmark/gpu-speedups.json by then, which replaces an earlier one.
#
#   bash tests/gpu_check.sh
#
# Two more benchmarks, not run here (4 and 1 minutes on one H200): what the harness costs a step beside a bare loop,
# and the three strategies at the scripts' own logging:
#   python -m tools.benchmarks.benchmark --overhead --model tiny --strategy ddp --nproc 1
#   python -m tools.benchmarks.benchmark --out runs/benchmark/gpu.json --overwrite
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| GPUs:', torch.cuda.device_count())"
# bf16, fp16 with the gradient scaler, CPU offload, torch.compile, fused AdamW and flash attention, resuming with the
# CUDA random state, and tools.estimates.estimate_memory's peak per rank against torch.cuda.max_memory_allocated.
# In 4 processes where pytest-xdist is installed; a failure here still leaves the table its turn (one session, one GPU).
workers=()
python -c "import xdist" 2>/dev/null && workers=(-n 4)
tests=0
python -m pytest -m cuda ${workers[@]+"${workers[@]}"} -v -p no:cacheprovider || tests=$?
# Each row is printed as it finishes; stopped at 8 minutes (exit 124), the JSON keeps the rows it finished.
timeout --signal=TERM 480 python -m tools.benchmarks.benchmark --speedups --nproc 1 --out runs/benchmark/gpu-speedups.json --overwrite
exit "$tests"
