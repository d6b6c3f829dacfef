"""The baseline of bench/validate_bench.py: what a user without dstune does to learn their batch sizes do not fit.

    deepspeed --num_gpus 2 bench/ds_batch_error.py --pipeline FOLDER --ds-config bad.json

Loads the pipeline the way a training script does (UNet, VAE, text encoder), then calls deepspeed.initialize with
the DeepSpeed JSON; DeepSpeed's batch assertion fires inside it. Rank 0 prints `DEEPSPEED ERROR: <message>` and
the process exits 3, so the benchmark can check that DeepSpeed reported the same error dstune validate did.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import deepspeed
import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.distributed.barrier()  # every rank has mapped every shm segment: the names can go
    from dstune.distributed import release_shm_allreduce_name

    release_shm_allreduce_name(torch.distributed.get_rank())  # as dstune does: no 69 MB leak per rank
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    unet = UNet2DConditionModel.from_pretrained(args.pipeline, subfolder="unet")
    AutoencoderKL.from_pretrained(args.pipeline, subfolder="vae")
    CLIPTextModel.from_pretrained(args.pipeline, subfolder="text_encoder")
    config = json.loads(Path(args.ds_config).read_text())
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    try:
        deepspeed.initialize(
            model=unet, model_parameters=unet.parameters(), optimizer=optimizer, config=config, dist_init_required=False
        )
    except Exception as err:  # noqa: BLE001 - whatever DeepSpeed raises is the report we time
        if torch.distributed.get_rank() == 0:
            print(f"DEEPSPEED ERROR: {type(err).__name__}: {err}", flush=True)
        return 3
    print("DeepSpeed accepted the config", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
