"""The models `dstune init --model NAME` writes a spec for: one entry per model dstune trains, with its real
defaults (the published checkpoint, its native resolution, precision, guidance, LoRA targets, the frame rate and
clip length of video models, the codec of speech models) and the built-in tiny model of the same layout.

This is the one list of trainable models. tests/unit/test_model_presets.py keeps it in step with the registries it
is derived from: every family of the spec's `model.family` union and every built-in model of dstune.builtin has
its entry (a built-in belongs to exactly one model, of the same family), and README.md names each one. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dstune.spec.model_sections import DEFAULT_LORA_TARGET_MODULES, LM_LORA_TARGET_MODULES

# the Krea 2 training example's default LoRA layers (its authors' recommendation): attention with its gate, the MLP,
# the image and text input projections, the text fusion's projector, the timestep MLP and modulation, the output
KREA2_LORA_TARGETS = ("img_in", "final_layer.linear", "to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.up",
                      "ff.down", "text_fusion.projector", "txt_in.linear_1", "txt_in.linear_2", "time_embed.linear_1",
                      "time_embed.linear_2", "time_mod_proj")
IMAGE_PROMPTS = ["a photo of a dog on the beach", "an oil painting of a lighthouse at dusk"]
VIDEO_PROMPTS = ["a red fox running through fresh snow"]
SPEECH_PROMPTS = ["Printing, in the only sense with which we are at present concerned.", "The quick brown fox."]


@dataclass(frozen=True)
class ModelPreset:
    name: str  # the `--model` value
    title: str  # what the model is, for the spec's first line and the README
    family: str  # model.family
    pretrained: str  # the published checkpoint (a Hugging Face hub id, downloaded beforehand)
    builtin: str  # the built-in tiny model with the same layout (`builtin:` + this)
    values: dict[str, Any] = field(default_factory=dict)  # dotted spec key -> value, over the shared defaults


def _lora(rank: int = 32, targets=DEFAULT_LORA_TARGET_MODULES) -> dict[str, Any]:
    return {"model.train": "lora", "model.lora": {"rank": rank, "alpha": rank, "target_modules": list(targets)},
            "train.optimizer.lr": 1.0e-4}


def _image(resolution: int, guidance: float, steps: int, **values) -> dict[str, Any]:
    return {"data.path": "/data/my-images", "data.resolution": resolution, "sample.prompts": IMAGE_PROMPTS,
            "sample.guidance": guidance, "sample.steps": steps, **values}


def _video(resolution: int, frames: int, fps: int, guidance: float, **values) -> dict[str, Any]:
    return {"data.path": "/data/my-videos", "data.resolution": resolution,
            "data.video.frames": frames, "data.video.fps": fps, "model.sample_frames": frames,
            "model.gradient_checkpointing": True, "sample.prompts": VIDEO_PROMPTS, "sample.guidance": guidance,
            "sample.steps": 40, **values}


def _speech(**values) -> dict[str, Any]:
    return {"data.path": "/data/LJSpeech-1.1", "data.format": "ljspeech", "train.micro_batch_size": 4,
            "train.optimizer.lr": 2.0e-4, "sample.prompts": SPEECH_PROMPTS, **values}


MODEL_PRESETS: tuple[ModelPreset, ...] = (
    ModelPreset("sd15", "Stable Diffusion 1.5 (UNet, CLIP ViT-L text encoder)", "sd",
                "stable-diffusion-v1-5/stable-diffusion-v1-5", "tiny-sd",
                _image(512, 7.5, 30, **{"train.micro_batch_size": 4, "train.optimizer.lr": 1.0e-5,
                                        "model.gradient_checkpointing": True})),
    ModelPreset("sdxl", "Stable Diffusion XL base 1.0 (UNet, two CLIP text encoders)", "sdxl",
                "stabilityai/stable-diffusion-xl-base-1.0", "tiny-sdxl",
                _image(1024, 5.0, 30, **{"train.optimizer.lr": 1.0e-5, "model.gradient_checkpointing": True})),
    ModelPreset("sd3", "Stable Diffusion 3 Medium (SD3 MMDiT; CLIP x2 + T5)", "flow",
                "stabilityai/stable-diffusion-3-medium-diffusers", "tiny-flow",
                _image(1024, 7.0, 28, **_lora(), **{"model.precondition_outputs": True,
                                                    "model.max_sequence_length": 77})),
    ModelPreset("flux", "FLUX.1 [dev] (Flux transformer with a guidance embedding; CLIP + T5)", "flow",
                "black-forest-labs/FLUX.1-dev", "tiny-flux",
                _image(1024, 3.5, 28, **_lora(), **{"model.guidance": 1.0, "model.max_sequence_length": 512})),
    ModelPreset("qwen-image", "Qwen-Image (20 B MMDiT; Qwen2.5-VL text encoder)", "flow", "Qwen/Qwen-Image",
                "tiny-qwen-image", _image(1328, 4.0, 30, **_lora(), **{"model.max_sequence_length": 512})),
    ModelPreset("qwen-image-edit", "Qwen-Image-Edit (Qwen-Image trained to edit a source image)", "flow",
                "Qwen/Qwen-Image-Edit", "tiny-qwen-image-edit",
                _image(1024, 4.0, 30, **_lora(), **{"data.path": "/data/edits/target", "data.control_dir": "../source",
                                                    "sample.prompts": []})),
    ModelPreset("z-image", "Z-Image (6 B single-stream transformer; Qwen3 text encoder)", "flow", "Tongyi-MAI/Z-Image",
                "tiny-z-image", _image(1024, 4.0, 28, **{"train.optimizer.lr": 1.0e-5,
                                                         "model.gradient_checkpointing": True,
                                                         "model.max_sequence_length": 512})),
    ModelPreset("flux2-klein", "FLUX.2 [klein] 4B (Flux2 transformer; Qwen3 text encoder; distilled)", "flow",
                "black-forest-labs/FLUX.2-klein-4B", "tiny-flux2",
                _image(1024, 1.0, 4, **_lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "to_qkv_mlp_proj")),
                       **{"model.max_sequence_length": 512})),
    ModelPreset("flux2-dev", "FLUX.2 [dev] (Flux2 transformer with a guidance embedding; Mistral3 text encoder)",
                "flow", "black-forest-labs/FLUX.2-dev", "tiny-flux2-dev",
                _image(1024, 4.0, 28, **_lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "to_qkv_mlp_proj")),
                       **{"model.guidance": 4.0, "model.max_sequence_length": 512})),
    ModelPreset("ideogram4", "Ideogram 4 (9 B transformer; Qwen3-VL text encoder; frozen unconditional transformer)",
                "flow", "ideogram-ai/ideogram-v4", "tiny-ideogram4",
                _image(1024, 7.0, 48, **_lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "w1", "w2", "w3")),
                       **{"model.gradient_checkpointing": True})),
    ModelPreset("krea2", "Krea 2 Raw (12 B single-stream transformer; Qwen3-VL text encoder; the base to train)",
                "flow", "krea/Krea-2-Raw", "tiny-krea2",
                _image(1024, 4.5, 28, **{**_lora(targets=KREA2_LORA_TARGETS), "train.optimizer.lr": 3.0e-4,
                                         "model.gradient_checkpointing": True, "model.max_sequence_length": 512})),
    ModelPreset("krea2-turbo", "Krea 2 Turbo (Krea 2 distilled to 8 steps without guidance)", "flow",
                "krea/Krea-2-Turbo", "tiny-krea2-turbo",
                _image(1024, 0.0, 8, **_lora(targets=KREA2_LORA_TARGETS), **{"model.gradient_checkpointing": True,
                                                                              "model.max_sequence_length": 512})),
    ModelPreset("qwen-image-21", "Qwen-Image 2.1 (7 B single-stream transformer; Qwen3-VL text encoder; RGBA VAE)",
                "flow", "Qwen/Qwen-Image-2.1", "tiny-qwen-image-21",
                _image(1024, 1.0, 40, **_lora(rank=16), **{"model.gradient_checkpointing": True,
                                                          "model.timestep_sampling": "uniform"})),
    ModelPreset("wan21", "Wan 2.1 text-to-video 14B", "wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "tiny-wan",
                _video(480, 81, 16, 5.0, **_lora(), **{"model.max_sequence_length": 512})),
    ModelPreset("wan21-i2v", "Wan 2.1 image-to-video 14B 480P", "wan", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                "tiny-wan-i2v", _video(480, 81, 16, 5.0, **_lora(), **{"model.image_to_video": True,
                                                                       "sample.prompts": []})),
    ModelPreset("wan22-a14b", "Wan 2.2 text-to-video A14B (two experts; the low-noise one trained here)", "wan",
                "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "tiny-wan-a14b",
                _video(480, 81, 16, 4.0, **_lora(), **{"model.expert": "low_noise"})),
    ModelPreset("wan22-ti2v", "Wan 2.2 TI2V 5B (text-to-video, 16x VAE)", "wan", "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                "tiny-wan22-ti2v", _video(704, 121, 24, 5.0, **_lora())),
    ModelPreset("hunyuan-video15", "HunyuanVideo 1.5 480p text-to-video (8.3 B; Qwen2.5-VL + ByT5)", "wan",
                "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "tiny-hunyuan-video15",
                _video(480, 121, 24, 6.0, **_lora(), **{"model.timestep_sampling": "logit_normal"})),
    ModelPreset("hunyuan-video15-i2v", "HunyuanVideo 1.5 480p image-to-video (SigLIP first-frame embedding)", "wan",
                "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v", "tiny-hunyuan-video15-i2v",
                _video(480, 121, 24, 6.0, **_lora(), **{"model.timestep_sampling": "logit_normal",
                                                        "sample.prompts": []})),
    ModelPreset("llama-tts", "Llama-3.2-1B learning speech as EnCodec 24 kHz tokens (4 codebooks)", "tts_lm",
                "meta-llama/Llama-3.2-1B", "tiny-tts-lm",
                _speech(**{"model.codec": "encodec", "model.codec_pretrained": "facebook/encodec_24khz",
                           "model.num_codebooks": 4, "model.gradient_checkpointing": True,
                           "data.cache.codec_tokens": True})),
    ModelPreset("orpheus", "Orpheus 3B TTS (Llama with SNAC 24 kHz tokens), LoRA on its attention", "tts_lm",
                "canopylabs/orpheus-3b-0.1-ft", "tiny-orpheus",
                _speech(**_lora(16, LM_LORA_TARGET_MODULES), **{
                    "model.codec": "snac", "model.token_layout": "orpheus",
                    "model.codec_pretrained": "hubertsiuzdak/snac_24khz"})),
    ModelPreset("csm", "Sesame CSM 1B (backbone + depth decoder over 32 Mimi codebooks), LoRA on both", "tts_codebooks",
                "sesame/csm-1b", "tiny-csm",
                _speech(**_lora(16, LM_LORA_TARGET_MODULES), **{"model.gradient_checkpointing": True,
                                                                "data.cache.codec_tokens": True})),
    ModelPreset("dia", "Dia 1.6B (text encoder + audio decoder over 9 DAC 44.1 kHz codebooks, delay pattern), LoRA on "
                "its attention", "tts_codebooks", "nari-labs/Dia-1.6B-0626", "tiny-dia",
                _speech(**_lora(16, LM_LORA_TARGET_MODULES), **{
                    "model.gradient_checkpointing": True, "model.sample_temperature": 1.8,
                    "data.cache.codec_tokens": True, "data.max_clip_seconds": 20.0,
                    "sample.prompts": ["[S1] Printing, in the only sense with which we are at present concerned. "
                                       "[S2] The quick brown fox."]})),
    ModelPreset("speecht5", "SpeechT5 TTS (encoder-decoder to mel frames, HiFi-GAN vocoder)", "speecht5",
                "microsoft/speecht5_tts", "tiny-speecht5",
                _speech(**{"model.vocoder": "microsoft/speecht5_hifigan", "train.optimizer.lr": 1.0e-5})),
)

PRESETS_BY_NAME: dict[str, ModelPreset] = {preset.name: preset for preset in MODEL_PRESETS}


def model_names() -> list[str]:
    return [preset.name for preset in MODEL_PRESETS]
