#!/usr/bin/env bash
# The first thing to run on a machine with GPUs: the tests that need CUDA, then the benchmark and the
# harness's cost per step.
# About 8 minutes on one H200 (tests 3, the benchmark 1, the harness's cost 4). The benchmark's table also lands in runs/benchmark/gpu.json, replacing an earlier one.
#
#   bash tests/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| GPUs:', torch.cuda.device_count())"
# bf16, fp16 with the gradient scaler, CPU offload, torch.compile, resuming with the CUDA random state, and
# tools.estimates.estimate_memory's peak per rank against torch.cuda.max_memory_allocated (tests/test_activations.py).
python -m pytest -m cuda -v -p no:cacheprovider
python -m tools.benchmarks.benchmark --out runs/benchmark/gpu.json --overwrite  # a second check replaces the first
# What the harness costs a step where steps are short: the tiny preset, the script beside a bare loop, under
# DDP and FSDP2, on every GPU (docs/performance.md, "What the harness costs a step").
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
for strategy in ddp fsdp2; do
  python -m tools.benchmarks.benchmark --overhead --model tiny --strategy "$strategy" --nproc "$gpus" \
    --out "runs/benchmark/gpu-overhead-$strategy.json" --overwrite
done
