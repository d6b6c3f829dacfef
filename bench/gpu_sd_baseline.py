"""The baseline of bench/gpu_sd.py: a plain diffusers-style training loop on accelerate + DeepSpeed, no dstune.

    deepspeed --num_gpus 1 bench/gpu_sd_baseline.py --pipeline FOLDER --resolution 512 --micro-batch 8 \
        --steps 35 --out times.json

What diffusers' examples/text_to_image/train_text_to_image.py does per step once the latents and text embeddings
are at hand (here random tensors of the right shapes in a DataLoader: the UNet's work does not depend on their
values): Accelerator(mixed_precision="bf16") with a DeepSpeedPlugin (ZeRO 2, clipping 1.0), AdamW, noise,
timesteps, add_noise, UNet forward in bf16, MSE in fp32, accelerator.backward, optimizer.step, zero_grad, and the
loss logged every step. Writes the wall time of every step's end to --out (main process).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from diffusers import DDPMScheduler, UNet2DConditionModel

    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    unet = UNet2DConditionModel.from_pretrained(args.pipeline, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pipeline, subfolder="scheduler")
    vae_config = json.loads((Path(args.pipeline) / "vae" / "config.json").read_text())
    latent_px = args.resolution // 2 ** (len(vae_config["block_out_channels"]) - 1)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(256, unet.config.in_channels, latent_px, latent_px, generator=generator)
    hidden = torch.randn(256, 77, unet.config.cross_attention_dim, generator=generator)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(latents, hidden), batch_size=args.micro_batch, shuffle=True, drop_last=True
    )
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    import deepspeed

    if not isinstance(unet, deepspeed.DeepSpeedEngine):  # accelerate falls back silently, e.g. without a launcher
        raise SystemExit(
            f"accelerate did not wrap the UNet in DeepSpeed (distributed type "
            f"{accelerator.distributed_type}); this would not be the baseline the benchmark claims"
        )
    weight_dtype = torch.bfloat16
    ends, step = [], 0
    while step < args.steps:
        for batch_latents, batch_hidden in loader:
            with accelerator.accumulate(unet):
                noise = torch.randn_like(batch_latents)
                timesteps = torch.randint(
                    0, noise_scheduler.config.num_train_timesteps, (len(batch_latents),), device=batch_latents.device
                )
                noisy = noise_scheduler.add_noise(batch_latents, noise, timesteps)
                prediction = unet(noisy.to(weight_dtype), timesteps, batch_hidden.to(weight_dtype), return_dict=False)[
                    0
                ]
                loss = F.mse_loss(prediction.float(), noise.float(), reduction="mean")
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loss_value = loss.detach().item()  # diffusers logs it every step (and it syncs, as dstune's loop does)
            ends.append(time.perf_counter())
            step += 1
            if step >= args.steps:
                break
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"step_end_s": ends, "last_loss": loss_value}))


if __name__ == "__main__":
    main()
