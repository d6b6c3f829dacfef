#!/usr/bin/env bash
# GPU benchmark (see bench/gpu_sd.py): SD-1.5-sized UNet, 512 px, bf16, ZeRO 2, one GPU; dstune vs a plain
# accelerate + DeepSpeed loop. Never downloads: the offline switches below make any attempt an error.
#   bash bench/gpu_sd.sh [--micro-batch 8] [--steps 30] [--repeats 2]
#   bash bench/gpu_sd.sh --dry-run        (tiny sizes, 32 px; works without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 DIFFUSERS_OFFLINE=1
if [[ " $* " != *" --dry-run "* ]]; then
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU: use --dry-run')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi
exec python3 bench/gpu_sd.py "$@"
