"""Parameter counts of a spec's model without reading a weight: each component's class is built from its config
file on torch's meta device (no memory, no data), then counted.

    count_model(spec, data_samples) -> ModelCounts (dstune.memory_plan), or raises SizesUnknown with the reason

Where the config files come from, first match wins: a `builtin:` model's stored configs (dstune/model_configs/
builtin/<folder>, copies of what the builder writes; a test keeps them equal); a local folder; a hub id in the
local Hugging Face cache; the stored configs of the example specs' hub models (dstune/model_configs/hub/<id>: only
their config.json files, so that `validate` plans them on a machine that has not downloaded them).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

from dstune.activations import (codec_frame_rate, flow_sample_bytes, lm_sample_bytes, speecht5_sample_bytes,
                                tts_tokens, unet_sample_bytes, wan_sample_bytes)
from dstune import wan_layouts
from dstune.hf import HUB_ID, NotAvailableLocally, hub_snapshot, quiet_hf_libraries
from dstune.memory_plan import ModelCounts
from dstune.spec.model_sections import DEFAULT_LORA_TARGET_MODULES, LM_LORA_TARGET_MODULES
from dstune.spec.section import BUILTIN_PREFIX
from dstune.spec.video_models import expert_range, expert_range_text, experts_in

STORE = Path(__file__).resolve().parent / "model_configs"
# builtin name -> its versioned folder (dstune.builtin's BuiltinModel.folder_name; tests/unit/test_model_sizes.py
# checks these agree, without this module importing the builders of layer 3)
BUILTIN_FOLDERS = {"tiny-sd": "tiny-sd-v3", "tiny-sdxl": "tiny-sdxl-v1", "tiny-flow": "tiny-flow-v1",
                   "tiny-flux": "tiny-flux-v1", "tiny-tts-lm": "tiny-tts-lm-v3", "tiny-speecht5": "tiny-speecht5-v1",
                   "tiny-orpheus": "tiny-orpheus-v2", "tiny-qwen-image": "tiny-qwen-image-v1",
                   "tiny-qwen-image-edit": "tiny-qwen-image-edit-v1", "tiny-z-image": "tiny-z-image-v1",
                   "tiny-flux2": "tiny-flux2-v1", "tiny-flux2-dev": "tiny-flux2-dev-v1",
                   "tiny-wan": "tiny-wan-v1", "tiny-wan-a14b": "tiny-wan-a14b-v1",
                   "tiny-wan-i2v": "tiny-wan-i2v-v1", "tiny-wan22-ti2v": "tiny-wan22-ti2v-v1"}
DENOISERS = {"sd": "unet", "sdxl": "unet", "flow": "transformer", "wan": "transformer"}
EDIT_PIPELINES = ("QwenImageEditPipeline",)  # trained on (source, target) pairs: twice the image tokens and latents
FROZEN_PIPELINE_PARTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")


class SizesUnknown(ValueError):
    """The model's config files are not on this machine (nor stored with dstune)."""


def config_folder(reference: str) -> tuple[Path, str]:
    """A model reference (builtin:, folder, hub id) -> (folder holding its config files, where they came from)."""
    if reference.startswith(BUILTIN_PREFIX):
        name = reference[len(BUILTIN_PREFIX):]
        if name in BUILTIN_FOLDERS:
            return STORE / "builtin" / BUILTIN_FOLDERS[name], f"{reference} (its stored configs)"
        raise SizesUnknown(f"{reference} is not a built-in model")
    path = Path(reference).expanduser()
    if path.is_dir():
        return path, str(path)
    if HUB_ID.fullmatch(reference):
        try:
            return hub_snapshot(reference), f"{reference} (local Hugging Face cache)"
        except NotAvailableLocally:
            stored = STORE / "hub" / reference
            if (stored / "config.json").exists() or (stored / "model_index.json").exists():
                return stored, f"{reference} (configs stored with dstune; not downloaded here)"
    named = [folder for folder in (STORE / "hub").glob(f"*/{path.name}") if path.name]
    if len(named) == 1:  # e.g. /models/stable-diffusion-xl-base-1.0 on a machine that does not have it
        hub_id = f"{named[0].parent.name}/{named[0].name}"
        return named[0], f"{reference} is not here: configs of {hub_id} (stored with dstune), matched by its name"
    raise SizesUnknown(f"{reference}: no config files here (not a folder, not in the local Hugging Face cache, "
                       "not stored with dstune), so its parameters cannot be counted")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SizesUnknown(f"{path}: cannot read it ({err})") from None


STORED_COUNTS = STORE / "counts.json"  # the stored configs' counts, so that validate need not import diffusers


@lru_cache(maxsize=64)
def count_component(config_path: str, lora_targets: tuple = (), lora_rank: int = 0) -> tuple[int, int, int]:
    """(parameters, largest layer's parameters, LoRA adapter parameters for those targets) of the class the config
    names. A stored config (dstune/model_configs) with the default LoRA targets is looked up in counts.json (made
    from the same meta-device count by write_stored_counts, checked by tests/unit/test_memory_plan.py); anything
    else is built on the meta device here. Cached per process."""
    stored = _stored_count(Path(config_path), lora_targets)
    if stored is not None:
        return stored["params"], stored["largest_layer_params"], stored["lora_params_per_rank"] * lora_rank
    return meta_count(config_path, lora_targets, lora_rank)


def _stored_count(path: Path, lora_targets: tuple) -> Optional[dict]:
    if lora_targets not in ((), DEFAULT_LORA_TARGET_MODULES) or not path.resolve().is_relative_to(STORE):
        return None
    try:
        table = json.loads(STORED_COUNTS.read_text())
        entry = table[str(path.resolve().relative_to(STORE))]
    except (OSError, ValueError, KeyError):
        return None
    return entry if entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() else None


def meta_count(config_path: str, lora_targets: tuple = (), lora_rank: int = 0) -> tuple[int, int, int]:
    """count_component, always on the meta device."""
    import torch

    config = _read_json(Path(config_path))
    try:
        with torch.device("meta"):
            module = _instantiate(config, Path(config_path))
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a config its class does not accept
        raise SizesUnknown(f"{config_path}: cannot build its class from it ({type(err).__name__}: {err})") from None
    params = sum(dict((id(p), p.numel()) for p in module.parameters()).values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    lora = sum(_adapter_params(m, lora_rank) for name, m in module.named_modules()
               if lora_targets and any(name == t or name.endswith("." + t) for t in lora_targets))
    return params, largest, lora


def stored_counts() -> dict:
    """counts.json as it should be: every stored component config counted on the meta device."""
    table = {}
    for path in sorted(STORE.rglob("config.json")):
        params, largest, per_rank = meta_count(str(path), DEFAULT_LORA_TARGET_MODULES, 1)
        table[str(path.relative_to(STORE))] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                               "params": params, "largest_layer_params": largest,
                                               "lora_params_per_rank": per_rank}
    return table


def write_stored_counts() -> None:
    """Regenerate dstune/model_configs/counts.json after adding or changing a stored config."""
    STORED_COUNTS.write_text(json.dumps(stored_counts(), indent=1, sort_keys=True) + "\n")


def _instantiate(config: dict, path: Path):
    """The diffusers class of `_class_name`, or the transformers class of `architectures[0]`."""
    with quiet_hf_libraries():
        if "_class_name" in config:
            import diffusers

            cls = getattr(diffusers, config["_class_name"], None)
            if cls is None:
                raise SizesUnknown(f"{path}: diffusers has no class {config['_class_name']}")
            return cls.from_config(config)
        import transformers

        names = config.get("architectures") or []
        cls = getattr(transformers, names[0], None) if names else None
        if cls is None:
            raise SizesUnknown(f"{path}: no transformers class named in `architectures`")
        return cls(transformers.AutoConfig.for_model(**config))


def import_model_classes(spec) -> None:
    """Import, without building, the class of every component config of the spec's model: a memory baseline taken
    afterwards (dstune.memory_record) then holds the libraries' code, so that what grows after it is the model."""
    try:
        folder, _ = config_folder(spec.model.pretrained)
    except SizesUnknown:
        return
    with quiet_hf_libraries():
        for path in sorted(folder.glob("config.json")) + sorted(folder.glob("*/config.json")):
            config = json.loads(path.read_text())
            if "_class_name" in config:
                import diffusers

                getattr(diffusers, config["_class_name"], None)
            elif config.get("architectures"):
                import transformers

                getattr(transformers, config["architectures"][0], None)


def _adapter_params(module, rank: int) -> int:
    """A peft LoRA adapter on a Linear (A: r x in, B: out x r) or a Conv (A: r x in x kernel, B: out x r)."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return rank * (module.in_features + module.out_features)
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = 1
        for side in module.kernel_size:
            kernel *= side
        return rank * (module.in_channels * kernel + module.out_channels)
    return 0


def count_model(spec, num_samples: int, clips: Sequence[tuple[int, int, int, int]] = ()) -> ModelCounts:
    """The spec's model: its trainable module, its frozen companions, activations per sample and cache size.
    `clips`: a video dataset's buckets [(frames, width, height, clips)] (dstune.video_plan.clip_buckets): the
    activations are the largest bucket's, the cache the sum over the buckets; without them every clip is
    data.video's longest count at data.resolution's square."""
    family = spec.model.family
    if family in DENOISERS:
        return _count_denoiser(spec, num_samples, clips)
    if family == "tts_lm":
        return _count_tts_lm(spec, num_samples)
    return _count_speecht5(spec)


def _lora(spec) -> tuple[tuple, int]:
    settings = spec.model.lora_settings
    return (tuple(settings.target_modules), settings.rank) if settings else ((), 0)


def _count_denoiser(spec, num_samples: int, clips=()) -> ModelCounts:
    folder, origin = config_folder(spec.model.pretrained)
    module = DENOISERS[spec.model.family]
    index = _read_json(folder / "model_index.json")
    expert, sampling_only = None, {}
    if getattr(spec.model, "expert", None) is not None and "transformer_2" in experts_in(index):
        module, other = ("transformer_2", "transformer") if spec.model.expert == "low_noise" else \
            ("transformer", "transformer_2")
        sampling_only = {other: count_component(str(folder / other / "config.json"))[0]}
        expert = expert_summary(index, spec.model.expert, spec.model.timestep_range)
    targets, rank = _lora(spec)
    config_path = folder / module / "config.json"
    params, largest, lora = count_component(str(config_path), targets, rank)
    default_lora = count_component(str(config_path), DEFAULT_LORA_TARGET_MODULES, 16)[2]
    companions = {part: count_component(str(folder / part / "config.json"))[0]
                  for part in FROZEN_PIPELINE_PARTS if (index.get(part) or [None])[0]}
    cache = spec.data.cache
    image = _wan_image_to_video(spec, folder, index)
    if not image:  # a text-to-video run of an image-to-video-capable folder never loads its image encoder
        companions.pop("image_encoder", None)
    # the image encoder's embeddings are stored beside the latents (dstune.families.wan_i2v)
    cached = tuple(part for part in companions if (cache.latents if part in ("vae", "image_encoder")
                                                   else cache.text_embeddings))
    config = _read_json(config_path)
    resolution = spec.data.resolution
    if module == "unet":
        full, checkpointed = unet_sample_bytes(config, resolution)
    elif spec.model.family == "wan":
        vae = _read_json(folder / "vae" / "config.json")
        context = _text_tokens(spec, index) + (_image_tokens(folder) if image and "image_encoder" in companions else 0)
        frames, width, height, _ = max(_clip_buckets(spec, num_samples, clips), key=lambda b: _clip_volume(*b))
        full, checkpointed = wan_sample_bytes(config, (width, height), frames, context, _vae_factor(vae))
    else:
        full, checkpointed = flow_sample_bytes(config, resolution, _text_tokens(spec, index),
                                               2 if index.get("_class_name") in EDIT_PIPELINES else 1)
    return ModelCounts(module, params, lora or params, largest, companions, cached, int(full), int(checkpointed),
                       default_lora, _image_cache_bytes(spec, folder, companions, num_samples, clips), origin,
                       builds_partitioned=True,  # sd, sdxl, flow and wan build the denoiser partitioned under ZeRO-3
                       sampling_companions=sampling_only, expert=expert)


def expert_summary(index: dict, expert: str, timestep_range) -> dict:
    """`memory.parameters.expert` of validate --json: the expert, its component and the timesteps it trains."""
    low, high, inclusive = expert_range(index, expert, timestep_range)
    return {"name": expert, "component": "transformer_2" if expert == "low_noise" else "transformer",
            "boundary_ratio": index["boundary_ratio"], "timesteps": [low, high], "max_included": inclusive,
            "text": expert_range_text(index, expert, timestep_range)}


def _wan_image_to_video(spec, folder: Path, index: dict) -> bool:
    """Whether a wan spec trains image-to-video on this folder (dstune.wan_layouts); False for other
    families and for folders whose channels fit no Wan layout (startup says why)."""
    if spec.model.family != "wan":
        return False
    kind, _ = wan_layouts.layout(index, _read_json(folder / "transformer" / "config.json"),
                               _read_json(folder / "vae" / "config.json"))
    return kind is not None and wan_layouts.image_to_video(kind, spec.model.image_to_video)[0]


def _image_tokens(folder: Path) -> int:
    """Wan 2.1 I2V's image embedding in the cross-attention context: the CLIP vision tower's patches and class
    token (257 for ViT-H/14 at 224 px)."""
    config = _read_json(folder / "image_encoder" / "config.json")
    return (config.get("image_size", 224) // config.get("patch_size", 14)) ** 2 + 1


def _text_tokens(spec, index: dict) -> int:
    """Text tokens per sample: SD3's 77 CLIP tokens + T5's (77 by default); every other flow model's
    max_sequence_length (512 by default: the Flux and Qwen-Image training examples')."""
    sd3 = (index.get("transformer") or [None, ""])[1] == "SD3Transformer2DModel"
    tokens = spec.model.max_sequence_length or (77 if sd3 else 512)
    if index.get("_class_name") in EDIT_PIPELINES:  # the source image's vision tokens (28 px each) join the text
        tokens += int((spec.data.resolution / 28) ** 2)
    return 77 + tokens if sd3 else tokens


def _clip_buckets(spec, num_samples: int, clips) -> list[tuple[int, int, int, int]]:
    """A video family's (frames, width, height, clips) buckets, or all clips at the longest count and the square."""
    side = spec.data.resolution
    return list(clips) or [(spec.data.video.max_frames, side, side, num_samples)]


def _clip_volume(frames: int, width: int, height: int, *_) -> int:
    """Latent frames x pixels: what a clip's tokens and its cached latent grow with."""
    return (1 + (frames - 1) // 4) * width * height


def _image_cache_bytes(spec, folder: Path, companions: dict, num_samples: int, clips=()) -> int:
    """The encoder cache on disk: per sample the VAE posterior's mean and std (float32, one latent each) and each
    text encoder's embeddings (the frozen parts' dtype: 2 bytes under mixed precision), times the samples (a video
    dataset's latents summed over its buckets)."""
    cache, width = spec.data.cache, 2 if spec.train.precision in ("bf16", "fp16") else 4
    per_sample, latents = 0, 0
    if cache.latents and "vae" in companions:
        vae = _read_json(folder / "vae" / "config.json")
        channels, factor = vae.get("latent_channels") or vae.get("z_dim", 4), _vae_factor(vae)
        pictures = 2 if _read_json(folder / "model_index.json").get("_class_name") in EDIT_PIPELINES else 1
        if spec.model.family == "wan":  # clips: (1 + (frames - 1) / 4) latent frames, per bucket
            latents = sum(2 * channels * _clip_volume(f, w // factor, h // factor) * 4 * n
                          for f, w, h, n in _clip_buckets(spec, num_samples, clips))
            latents += _condition_cache_bytes(spec, folder, companions, channels, factor, width,
                                              _clip_buckets(spec, num_samples, clips))
        else:
            side = spec.data.resolution // factor
            per_sample += pictures * 2 * channels * side ** 2 * 4  # edit: + the source's latents
    if cache.text_embeddings and (folder / "transformer" / "config.json").exists():  # flow: what the transformer reads
        transformer = _read_json(folder / "transformer" / "config.json")
        tokens = _text_tokens(spec, _read_json(folder / "model_index.json"))
        text_width = (transformer.get("joint_attention_dim") or transformer.get("cap_feat_dim")  # Z-Image's name
                      or transformer.get("text_dim", 0))  # Wan's
        per_sample += (tokens * text_width + transformer.get("pooled_projection_dim", 0)) * width
    elif cache.text_embeddings:  # sd, sdxl: each CLIP's 77 hidden states
        for part in companions:
            if part.startswith("text_encoder"):
                per_sample += 77 * _read_json(folder / part / "config.json").get("hidden_size", 0) * width
    return per_sample * num_samples + latents


def _condition_cache_bytes(spec, folder: Path, companions: dict, channels: int, factor: int, width: int,
                           buckets) -> int:
    """Image-to-video's cached condition (dstune.families.wan_i2v): its latent mode in float32 (TI2V: one latent
    frame), and Wan 2.1 I2V's first-frame CLIP hidden states in the frozen parts' dtype, summed over the buckets."""
    index = _read_json(folder / "model_index.json")
    if not _wan_image_to_video(spec, folder, index):
        return 0
    total = 0
    for frames, clip_width, clip_height, count in buckets:
        frames = 1 if index.get("expand_timesteps") else frames
        total += channels * _clip_volume(frames, clip_width // factor, clip_height // factor) * 4 * count
    if "image_encoder" in companions:
        hidden = _read_json(folder / "image_encoder" / "config.json").get("hidden_size", 0)
        total += _image_tokens(folder) * hidden * width * sum(count for *_, count in buckets)
    return total


def _vae_factor(vae_config: dict) -> int:
    if "temperal_downsample" in vae_config:  # a video-style VAE (Qwen-Image's, Wan's): one spatial halving per
        # stage, times the pixel patches of Wan 2.2's VAE (2x2: 16x in all)
        return 2 ** len(vae_config["temperal_downsample"]) * (vae_config.get("patch_size") or 1)
    return 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1)


def _codec_reference(spec, folder: Path) -> Optional[str]:
    if spec.model.codec_pretrained:
        return spec.model.codec_pretrained
    return str(folder / "codec") if (folder / "codec" / "config.json").exists() else None


def _count_tts_lm(spec, num_samples: int) -> ModelCounts:
    folder, origin = config_folder(spec.model.pretrained)
    targets, rank = _lora(spec)  # train: lora puts adapters on the Llama's attention (q/k/v/o_proj by default)
    params, largest, lora = count_component(str(folder / "config.json"), targets, rank)
    default_lora = count_component(str(folder / "config.json"), LM_LORA_TARGET_MODULES, 16)[2]
    config = _read_json(folder / "config.json")
    companions, frame_rate, codebooks = {}, 75.0, spec.model.num_codebooks or 8
    layout = _read_json(folder / "dstune_tts.json") if (folder / "dstune_tts.json").exists() else {}
    if layout.get("frame_rate"):  # a described layout (dstune.token_layouts) states its codec's frames and codes
        frame_rate, codebooks = float(layout["frame_rate"]), spec.model.num_codebooks or layout.get("num_codebooks", 8)
    codec_ref = _codec_reference(spec, folder)
    if codec_ref:
        codec_folder, _ = config_folder(codec_ref)
        try:
            companions["codec"] = count_component(str(codec_folder / "config.json"))[0]
        except SizesUnknown:  # SNAC's config names no class to build on meta; it is small (~20 M) and frozen
            pass
        codec_config = _read_json(codec_folder / "config.json")
        frame_rate = codec_frame_rate(codec_config)
        if not spec.model.num_codebooks:
            saved = folder / "dstune_tts.json"
            codebooks = _read_json(saved).get("num_codebooks", 8) if saved.exists() else \
                codec_config.get("num_quantizers", 8)
    tokens = tts_tokens(spec.data.max_clip_seconds or 10.0, frame_rate, codebooks)
    full, checkpointed = lm_sample_bytes(config, tokens)
    cached = ("codec",) if spec.data.cache.codec_tokens and "codec" in companions else ()
    cache_bytes = int(4 * frame_rate * codebooks * (spec.data.max_clip_seconds or 10.0) * num_samples) \
        if spec.data.cache.codec_tokens else 0  # int32 codes; an upper bound (every clip at the longest length)
    return ModelCounts("lm", params, lora or params, largest, companions, cached, int(full), int(checkpointed),
                       default_lora, cache_bytes, origin)


def _count_speecht5(spec) -> ModelCounts:
    folder, origin = config_folder(spec.model.pretrained)
    params, largest, _ = count_component(str(folder / "config.json"))
    companions = {}
    vocoder = spec.model.vocoder or (str(folder / "vocoder") if (folder / "vocoder" / "config.json").exists() else None)
    if vocoder:
        companions["vocoder"] = count_component(str(config_folder(vocoder)[0] / "config.json"))[0]
    full, checkpointed = speecht5_sample_bytes(_read_json(folder / "config.json"), spec.data.max_clip_seconds or 10.0)
    return ModelCounts("speecht5", params, params, largest, companions, (), int(full), int(checkpointed), 0, 0, origin)
