"""Built-in tiny models (`model.pretrained: builtin:NAME`), built offline from fixed configs and a fixed seed.

    ensure_builtin_model(name, cache_dir) -> Path

returns `cache_dir/builtin/<folder_name>/`, a normal diffusers pipeline folder that the family then loads through
the same `from_pretrained(folder, subfolder=...)` path as a user's checkpoint. The first call builds it; later
calls (any process, any run sharing the cache) reuse it. Building is safe under concurrency: one process builds
while the others wait on a file lock, the folder is written beside its final name and renamed into place, and only
a folder holding the completion marker (`dstune_builtin.json`, written last) is ever used; a leftover without it
is deleted and rebuilt. Change a build and you must bump its `folder_name` version, or old caches are reused; the
tiny-sd VAE trains on dstune.data.shapes, so a change to how shapes are drawn is such a change too.

builtin:tiny-sd (~0.8 M-parameter UNet, 32 px images, 16x16x4 latents) comes with a VAE that is actually trained
(a few hundred steps on coloured shapes, deterministic), because a random VAE decodes any latent to noise and a
demo run could never visibly learn. Its latents are nudged to look like a half-size image (the first three
channels follow the 2x2-averaged RGB), which makes them easy for a tiny UNet, and `scaling_factor` is 1/std of
the latents over the shapes set so the diffusion sees unit variance (each channel is also centred on 0). The
noise schedule has zero terminal SNR with v-prediction (see TINY_SD_SCHEDULER), which is what lets the colour
follow the prompt after a few hundred steps. The text encoder stays random: distinct captions still give
distinct embeddings, which is all a conditional demo needs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from dstune.families.base import FamilyError, quiet_hf_libraries, temporary_sibling
from dstune.families.tiny_flow import builtin_models as flow_builtin_models
from dstune.families.tiny_sdxl import TINY_SDXL_ENTRY
from dstune.families.tiny_tts import TINY_SPEECHT5_ENTRY, TINY_TTS_LM_ENTRY

BUILTIN_PREFIX = "builtin:"
BUILTIN_MARKER = "dstune_builtin.json"


@dataclass(frozen=True)
class BuiltinModel:
    name: str  # as written after `builtin:`
    folder_name: str  # cache folder; carries a version, bumped whenever the build's output changes
    family: str  # the model.family it is meant for
    description: str
    build: Callable[[Path], dict]  # writes the pipeline into the (empty) folder; returns facts for the marker


# ----------------------------------------------------------------------------------------- the cache protocol


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in sorted(BUILTIN_MODELS)]


def ensure_builtin_model(name: str, cache_dir: str | os.PathLike) -> Path:
    """The folder of built-in model `name` ("tiny-sd" or "builtin:tiny-sd") under `cache_dir`, built if needed."""
    key = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    if key not in BUILTIN_MODELS:
        raise FamilyError(f"unknown built-in model '{BUILTIN_PREFIX}{key}'. Known built-in models: "
                          f"{', '.join(builtin_names())}.")
    model = BUILTIN_MODELS[key]
    root = Path(cache_dir).expanduser() / "builtin"
    final = root / model.folder_name
    if _is_complete(final, key):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FamilyError(f"cannot create the model cache {root} ({err.strerror or err}); set output.cache_dir "
                          "to a writable folder") from None
    with _exclusive(root / f".{model.folder_name}.lock"):
        if _is_complete(final, key):  # another process finished it while we waited for the lock
            return final
        if final.exists():  # no marker: a leftover we cannot trust; never used, replaced by a fresh build
            stale = temporary_sibling(final, "incomplete")
            os.rename(final, stale / "folder")
            shutil.rmtree(stale, ignore_errors=True)
        _build_into(model, final)
    return final


def _is_complete(folder: Path, key: str) -> bool:
    try:
        return json.loads((folder / BUILTIN_MARKER).read_text()).get("name") == key
    except (OSError, ValueError, AttributeError):
        return False


def _build_into(model: BuiltinModel, final: Path) -> None:
    work = temporary_sibling(final, "building")
    try:
        started = time.perf_counter()
        facts = model.build(work)
        marker = {"name": model.name, "folder": model.folder_name, "family": model.family,
                  "build_seconds": round(time.perf_counter() - started, 2), **facts}
        (work / BUILTIN_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(work, final)
        except OSError:
            if not _is_complete(final, model.name):  # lost a race only a lock-less filesystem allows: use theirs
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def _exclusive(lock_path: Path):
    """An exclusive advisory lock (released by the OS if the holder dies). Without fcntl the atomic rename still
    keeps the cache correct; processes may then just build the same thing twice."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _deterministic_cpu(seed: int, threads: int):
    """Seed torch without disturbing the caller's RNG, and fix the thread count (it changes float sums)."""
    old_threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(old_threads)


# ---------------------------------------------------------------------------------------------- builtin:tiny-sd

_TINY_SD_SEED = 0
# The thread count changes float summation order; one thread gives the same bytes whatever the core count (and
# cannot be starved by busy-waiting OpenMP threads when ranks share the cores).
_BUILD_THREADS = 1
_CLIP_BOS, _CLIP_EOS = 517, 518
TINY_SD_UNET = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
# Two blocks: spatial factor 2 (32 px -> 16x16 latents). One norm group: with several groups, GroupNorm over a
# flat-coloured image erases most of the absolute colour, and this VAE has too few channels to carry it otherwise.
TINY_SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=1,
    sample_size=32, mid_block_add_attention=False)
# SD's schedule, rescaled to zero terminal SNR (Lin et al. 2024), hence v-prediction and "trailing" sampling steps.
# SD's own schedule leaves 7% of the image in x_T; on 16x16 latents that leak carries the mean colour as clearly as
# the caption does, the model learns to read it, and at sampling the colour comes from the seed, not the prompt.
TINY_SD_SCHEDULER = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
    prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing", steps_offset=1)


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte-level alphabet: one printable character per byte value."""
    byte_values = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                   + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = byte_values[:], 0
    for value in range(256):
        if value not in byte_values:
            byte_values.append(value)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A byte-level CLIP BPE tokenizer built in memory (519 ids; every string is encodable, nothing downloaded)."""
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for suffix in ("", "</w>"):
        for char in chars:
            vocab[char + suffix] = len(vocab)
    merges = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("c", "a"), ("ca", "t</w>")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    assert (vocab["<|startoftext|>"], vocab["<|endoftext|>"]) == (_CLIP_BOS, _CLIP_EOS)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_clip_config(hidden_size: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=_CLIP_EOS + 1, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                          projection_dim=hidden_size, bos_token_id=_CLIP_BOS, eos_token_id=_CLIP_EOS,
                          pad_token_id=_CLIP_EOS, hidden_act="quick_gelu")


def _build_tiny_sd(out: Path) -> dict:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    with quiet_hf_libraries():
        from diffusers import StableDiffusionPipeline

    with _deterministic_cpu(_TINY_SD_SEED, _BUILD_THREADS):
        text_encoder = CLIPTextModel(tiny_clip_config())
        unet = UNet2DConditionModel(**TINY_SD_UNET)
        vae = AutoencoderKL(**TINY_SD_VAE)
        facts = train_tiny_vae(vae)
    vae.register_to_config(scaling_factor=facts["vae_scaling_factor"])
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tiny_clip_tokenizer(), unet=unet,
        scheduler=DDPMScheduler(**TINY_SD_SCHEDULER), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    with quiet_hf_libraries():
        pipeline.save_pretrained(out, safe_serialization=True)
    facts["unet_parameters"] = sum(p.numel() for p in unet.parameters())
    return facts


# ------------------------------------------------------------------------------------------ tiny VAE training

VAE_TRAIN_STEPS = 500
VAE_BATCH = 32
VAE_CROP_PX = 16  # most steps see random crops: 4x cheaper than whole 32 px images
VAE_FULL_FRACTION = 0.2  # the last steps see whole images, so borders decode cleanly
VAE_LR = 5e-3
VAE_IMAGE_PX = 32
VAE_EXTRA_SHAPES = 768  # random shapes in any colour beside the built-in set, so other colours decode too
_LATENT_LOOKS_LIKE_IMAGE = 1.0  # weight of "first 3 latent channels = 2x2-averaged RGB"
_KL_WEIGHT = 1e-4  # keeps latents bounded; small enough not to blur


def _to_tensor(images: list) -> torch.Tensor:
    import numpy as np

    array = np.stack([np.asarray(image.convert("RGB"), dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0


def shapes_images(resolution: int = VAE_IMAGE_PX) -> torch.Tensor:
    """All images of the built-in shapes dataset, (N, 3, R, R) in [-1, 1]."""
    from dstune.data.shapes import SHAPES_NUM_SAMPLES, render_shape

    return _to_tensor([render_shape(i, resolution)[0] for i in range(SHAPES_NUM_SAMPLES)])


def _random_shape(rng: random.Random, resolution: int):
    """A random-colour circle/square/triangle on a random-colour background (drawn at 4x, box-filtered down)."""
    from PIL import Image, ImageDraw

    side = resolution * 4
    colour = lambda: tuple(rng.randrange(256) for _ in range(3))  # noqa: E731
    canvas = Image.new("RGB", (side, side), colour())
    draw = ImageDraw.Draw(canvas)
    for _ in range(rng.randint(1, 2)):
        r = rng.uniform(0.15, 0.4) * side
        cx, cy = rng.uniform(r, side - r), rng.uniform(r, side - r)
        kind = rng.randrange(3)
        if kind == 0:
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour())
        elif kind == 1:
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour())
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour())
    return canvas.resize((resolution, resolution), Image.Resampling.BOX)


def _vae_training_images() -> torch.Tensor:
    rng = random.Random(_TINY_SD_SEED)
    extra = _to_tensor([_random_shape(rng, VAE_IMAGE_PX) for _ in range(VAE_EXTRA_SHAPES)])
    return torch.cat([shapes_images(), extra])


def _vae_batch(images: torch.Tensor, step: int, generator: torch.Generator) -> torch.Tensor:
    batch = images[torch.randint(0, len(images), (VAE_BATCH,), generator=generator)]
    if step >= VAE_TRAIN_STEPS * (1 - VAE_FULL_FRACTION):
        return batch[: VAE_BATCH // 2]  # whole images cost 4x: halve the batch
    x, y = torch.randint(0, VAE_IMAGE_PX - VAE_CROP_PX + 1, (2,), generator=generator).tolist()
    return batch[:, :, y:y + VAE_CROP_PX, x:x + VAE_CROP_PX]


def train_tiny_vae(vae) -> dict:
    """Train `vae` in place to reconstruct shapes; returns its scaling factor and reconstruction error.
    Deterministic given the global torch seed and thread count (the caller fixes both)."""
    images = _vae_training_images()
    generator = torch.Generator().manual_seed(_TINY_SD_SEED)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    optimizer = torch.optim.Adam(vae.parameters(), lr=VAE_LR)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=VAE_LR, total_steps=VAE_TRAIN_STEPS,
                                                   pct_start=0.15)
    vae.train()
    for step in range(VAE_TRAIN_STEPS):
        x = _vae_batch(images, step, generator)
        posterior = vae.encode(x).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        reconstruction = vae.decode(latents).sample
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        image_like = F.mse_loss(posterior.mean[:, :3], F.avg_pool2d(x, factor))
        loss = F.l1_loss(reconstruction, x) + _LATENT_LOOKS_LIKE_IMAGE * image_like + _KL_WEIGHT * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    vae.eval().requires_grad_(False)
    shapes = shapes_images()
    with torch.no_grad():
        _center_latents(vae, vae.encode(shapes).latent_dist.mean.mean(dim=(0, 2, 3)))
        means = vae.encode(shapes).latent_dist.mean
        error = F.mse_loss(vae.decode(means).sample, shapes).item()
    return {"vae_scaling_factor": round(1.0 / means.std().item(), 5), "vae_reconstruction_mse": round(error, 6),
            "vae_train_steps": VAE_TRAIN_STEPS}


def _center_latents(vae, channel_means: torch.Tensor) -> None:
    """Shift the latent space so each channel has mean 0 over the shapes set, without changing what decodes:
    quant_conv's mean outputs lose m, post_quant_conv (1x1, linear) adds W @ m back. Off-centre latents are what
    the noise schedule handles worst: sampling starts from zero-mean noise, so the images' mean colour drifts."""
    channels = channel_means.numel()
    vae.quant_conv.bias[:channels] -= channel_means
    vae.post_quant_conv.bias += vae.post_quant_conv.weight[:, :, 0, 0] @ channel_means


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-sd": BuiltinModel(
        name="tiny-sd", folder_name="tiny-sd-v3", family="sd",
        description="Stable-Diffusion-1.x-shaped pipeline: 0.8 M-parameter UNet, 32 px images, trained tiny VAE",
        build=_build_tiny_sd),
    **flow_builtin_models(),  # builtin:tiny-flow, builtin:tiny-flux
    "tiny-sdxl": BuiltinModel(**TINY_SDXL_ENTRY),
    "tiny-tts-lm": BuiltinModel(**TINY_TTS_LM_ENTRY),
    "tiny-speecht5": BuiltinModel(**TINY_SPEECHT5_ENTRY),
}
