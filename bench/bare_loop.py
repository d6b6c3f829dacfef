"""The baseline of bench/loop_overhead.py: the DeepSpeed training loop a user would write by hand, no dstune.

    deepspeed --num_gpus 2 bench/bare_loop.py --pipeline FOLDER --ds-config ds_config.json --steps 28 \
        --resolution 32 --out times.json

Loads the same pipeline folder, encodes the same built-in shapes once up front (latents and text embeddings held
in memory as tensors: the cheapest possible data path), then trains the UNet with the diffusers text-to-image loss
(noise, timesteps, add_noise, v/epsilon target, MSE) under the same DeepSpeed JSON and the same optimizer (AdamW,
constant LR). Rank 0 writes the wall time of every step's end to --out, which is what loop_overhead.py compares.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # only for the built-in shapes data, so both sides train on the same images

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True, help="diffusers pipeline folder")
    parser.add_argument("--ds-config", required=True, help="the DeepSpeed JSON dstune compiled for the same run")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", required=True, help="JSON file for rank 0's step end times")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser.parse_args()


def encoded_dataset(folder: str, resolution: int, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, text embeddings) of the first `count` built-in shapes, encoded once."""
    import numpy as np
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer

    from dstune.data.synthetic import SHAPES_NUM_SAMPLES, render_shape

    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae").to(device).eval()
    text_encoder = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder").to(device).eval()
    tokenizer = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")
    images, captions = zip(*(render_shape(i, resolution) for i in range(min(count, SHAPES_NUM_SAMPLES))))
    pixels = torch.from_numpy(np.stack([np.asarray(im.convert("RGB"), np.float32) for im in images]))
    pixels = (pixels.permute(0, 3, 1, 2) / 127.5 - 1.0).to(device)
    with torch.no_grad():
        latents = torch.cat([vae.encode(chunk).latent_dist.sample() for chunk in pixels.split(64)])
        ids = tokenizer(
            list(captions),
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(device)
        hidden = text_encoder(ids)[0]
    return latents * vae.config.scaling_factor, hidden


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    torch.distributed.barrier()  # every rank has mapped every shm segment: the names can go
    from dstune.distributed import release_shm_allreduce_name

    release_shm_allreduce_name(torch.distributed.get_rank())  # as dstune does: no 69 MB leak per rank
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    from diffusers import DDPMScheduler, UNet2DConditionModel

    config = json.loads(Path(args.ds_config).read_text())
    micro = config["train_micro_batch_size_per_gpu"]
    unet = UNet2DConditionModel.from_pretrained(args.pipeline, subfolder="unet").to(device).train()
    scheduler = DDPMScheduler.from_pretrained(args.pipeline, subfolder="scheduler")
    latents, hidden = encoded_dataset(args.pipeline, args.resolution, args.steps * world * micro, device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(
        model=unet, model_parameters=unet.parameters(), optimizer=optimizer, config=config, dist_init_required=False
    )
    dtype = next(engine.module.parameters()).dtype
    generator = torch.Generator().manual_seed(1000 + rank)
    ends = []
    for step in range(args.steps):
        rows = torch.arange(micro) + (step * world + rank) * micro
        rows = rows % len(latents)
        x0, text = latents[rows], hidden[rows]
        noise = torch.randn(x0.shape, generator=generator).to(device)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (micro,), generator=generator).to(device)
        noisy = scheduler.add_noise(x0, noise, timesteps)
        target = (
            noise if scheduler.config.prediction_type == "epsilon" else scheduler.get_velocity(x0, noise, timesteps)
        )
        prediction = engine(noisy.to(dtype), timesteps, text.to(dtype), return_dict=False)[0]
        loss = F.mse_loss(prediction.float(), target.float())
        engine.backward(loss)
        engine.step()
        loss_value = loss.item()  # what a user's loop logs each step (and a sync point, as in dstune's loop)
        ends.append(time.perf_counter())
    if rank == 0:
        Path(args.out).write_text(json.dumps({"step_end_s": ends, "last_loss": loss_value}))


if __name__ == "__main__":
    main()
