"""The three real-size verdicts of docs/memory.md, reproducible: SDXL full on 8 x 24 GB (through `dstune validate`),
a 20B image model's LoRA on 8 x 80 GB (Qwen-Image's transformer) and Wan 2.1 14B full on 8 x 80 GB. dstune has no
family for the last two yet, so their transformers are counted on the meta device from their published configs
(inline below) and the memory plan's arithmetic is applied directly, with the activation formula of
dstune/memory/activations.py for their token counts. Nothing is downloaded; no weight exists anywhere in this.

    python3 bench/memory_cases.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, env  # noqa: E402

sys.path.insert(0, str(REPO))  # this checkout's dstune, not an installed one
from dstune.models.wan.card import sample_bytes as wan_sample_bytes  # noqa: E402
from dstune.memory.activations import ModelShape, measured_sample_bytes  # noqa: E402
from dstune.memory.plan import ModelCounts, Setup  # noqa: E402
from dstune.memory.verdict import memory_json  # noqa: E402
from dstune.memory.counts import count_component  # noqa: E402

QWEN_IMAGE = {
    "_class_name": "QwenImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
}
WAN_14B = {
    "_class_name": "WanTransformer3DModel",
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 13824,
    "freq_dim": 256,
    "in_channels": 16,
    "num_attention_heads": 40,
    "num_layers": 40,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
# frozen companions, published sizes (the cache replaces them on the GPU in both runs): Qwen2.5-VL-7B text encoder
# 8.29 B and the Qwen-Image VAE 0.127 B; UMT5-XXL encoder 5.68 B and the Wan 2.1 VAE 0.127 B
QWEN_COMPANIONS = {"text_encoder": 8_292_166_656, "vae": 126_892_531}
WAN_COMPANIONS = {"text_encoder": 5_680_910_336, "vae": 126_892_531}


def counted(config: dict, folder: Path, lora_targets=(), rank=0) -> tuple[int, int, int]:
    path = folder / f"{config['_class_name']}.json"
    path.write_text(json.dumps(config))
    return count_component(str(path), tuple(lora_targets), rank)


def setup(
    stage: int, world: int = 8, micro: int = 1, checkpointing: bool = True, lora: bool = False, offload: str = "none"
) -> Setup:
    return Setup(
        world_size=world,
        ranks_per_node=8,
        zero_stage=stage,
        offload_optimizer=offload,
        offload_param="none",
        precision="bf16",
        optimizer="adamw",
        momentum=0.0,
        micro_batch=micro,
        accumulation=1,
        gradient_checkpointing=checkpointing,
        lora=lora,
        reduce_bucket=50_000_000,
        allgather_bucket=50_000_000,
        prefetch_bucket=45_000_000,
        overlap_comm=stage == 2,
    )


def show(title: str, counts: ModelCounts, run: Setup, gpu_bytes: float) -> None:
    memory = memory_json(counts, run, gpu_bytes)
    print(f"\n## {title}\nparameters: {json.dumps(memory['parameters'])}")
    print(
        "per GPU (GB): "
        + ", ".join(f"{key.removesuffix('_bytes')} {value / 1e9:.2f}" for key, value in memory["per_gpu"].items())
    )
    print(
        f"host per node {memory['host_per_node_bytes'] / 1e9:.0f} GB; fits in {gpu_bytes / 1e9:.0f} GB: "
        f"{memory['fits']}"
    )
    for item in memory["suggestions"]:
        print(f"  would fit with {item['change']}: {item['per_gpu_total_bytes'] / 1e9:.2f} GB")


def sdxl() -> None:
    for extra in ([], ["--set", "model.gradient_checkpointing=false"]):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "dstune",
                "validate",
                "launch/sdxl-zero2-8gpu.yaml",
                "--num-gpus",
                "8",
                "--num-samples",
                "50000",
                "--gpu-memory",
                "24GB",
                "--json",
                *extra,
            ],
            cwd=REPO,
            env=env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        memory = json.loads(out.stdout)["memory"]
        print(f"\n## SDXL full, launch/sdxl-zero2-8gpu.yaml {' '.join(extra)}, 8 x 24 GB")
        print(
            "per GPU (GB): "
            + ", ".join(f"{key.removesuffix('_bytes')} {value / 1e9:.2f}" for key, value in memory["per_gpu"].items())
        )
        print(f"host per node {memory['host_per_node_bytes'] / 1e9:.0f} GB; fits: {memory['fits']}")
        for item in memory["suggestions"]:
            print(f"  would fit with {item['change']}: {item['per_gpu_total_bytes'] / 1e9:.2f} GB")


def main() -> None:
    sdxl()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        targets = ("to_q", "to_k", "to_v", "to_out.0")
        params, largest, lora = counted(QWEN_IMAGE, folder, targets, 32)
        hidden = QWEN_IMAGE["num_attention_heads"] * QWEN_IMAGE["attention_head_dim"]
        # 1024 px: 64 x 64 patches of 2x2 latents; a 256-token prompt
        full, checkpointed = measured_sample_bytes(  # the measured constants, as model.family: flow counts them
            "qwen-image", ModelShape(hidden, {"transformer_blocks": QWEN_IMAGE["num_layers"]}), (1024 / 16) ** 2, 256
        )
        counts = ModelCounts(
            "transformer",
            params,
            lora,
            largest,
            QWEN_COMPANIONS,
            ("text_encoder", "vae"),
            int(full),
            int(checkpointed),
            lora,
            0,
            "QwenImageTransformer2DModel config, meta device",
        )
        show(
            "20B image model (Qwen-Image) LoRA rank 32, 1024 px, micro 1, ZeRO 2, 8 x 80 GB",
            counts,
            setup(2, lora=True),
            80e9,
        )
        show("same on 8 x 48 GB", counts, setup(2, lora=True), 48e9)
        params, largest, _ = counted(WAN_14B, folder)
        # 81 frames -> 21 latent frames; 480x832 -> 30 x 52 patches; 512 umT5 tokens (model.family: video's count)
        full, checkpointed = wan_sample_bytes(WAN_14B, {}, (832, 480), 81, 512)
        counts = ModelCounts(
            "transformer",
            params,
            params,
            largest,
            WAN_COMPANIONS,
            ("text_encoder", "vae"),
            int(full),
            int(checkpointed),
            0,
            0,
            "WanTransformer3DModel config, meta device",
        )
        show("Wan 2.1 14B full, 81 x 480 x 832, micro 1, ZeRO 2, 8 x 80 GB", counts, setup(2), 80e9)
        show("Wan 2.1 14B full, ZeRO 3", counts, setup(3), 80e9)


if __name__ == "__main__":
    main()
