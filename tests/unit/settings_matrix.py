"""The settings matrix: every built-in model at the settings users pick, in a pairwise design (docs/testing.md).

Each model has its factors (a setting and the values users give it: micro batch 1 or 2, aspect-ratio buckets, clip
lengths, gradient checkpointing, bf16, LoRA, the caches, and the model's own options that change the step). The
cases are a covering array of them (tests/unit/covering_array.py): every pair of (setting, value) x (setting, value) of a
model meets in at least one case, in far fewer cases than every combination. Two tiers run them:

- one process (tests/unit/test_settings_matrix.py): the real start-up on one rank without DeepSpeed (validate_spec,
  load_trained_model with LoRA and the precision's cast, checked_records, hear_speakers, prepare_caches,
  make_training_loader), then one batch through the model's encode_batch and loss, and backward; `run_case` here.
- two ranks (tests/dist/test_settings_matrix_two_ranks.py): what only DeepSpeed and several ranks do: ZeRO 0, 2 and 3,
  gradient accumulation through the engine, caches built by both ranks; the whole `dstune train` path.

A setting a model cannot take is not in its factors: `dstune validate` refuses it with the reason (REFUSALS, a test
each). The datasets are small folders written per session (`write_datasets`): images and videos in two aspect
ratios, clips with and without a sound track, speech of two lengths with and without speakers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from dstune.spec.section import VIDEO_FAMILY

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------------------- the datasets

IMAGES, PAIRS, VIDEOS, VIDEOS_WITH_SOUND, SPEECH, SPEECH_WITH_SPEAKERS = (
    "images",
    "pairs",
    "videos",
    "videos-with-sound",
    "speech",
    "speech-with-speakers",
)
WIDE, TALL = (64, 32), (32, 64)  # the images' and clips' sizes: two aspect ratios, so buckets of both are used
FILES_PER_SHAPE = 4  # of each size: 8 samples in all
CLIP_FRAMES, CLIP_FPS = 9, 16
SHORT_TONES, LONG_TONES = "27", "31415"  # 0.26 s and 0.65 s of builtin:tones' digits
SPEAKER_DIM = 16  # tiny-speecht5's speaker_embedding_dim


def _frames(index: int, size: tuple[int, int], frames: int) -> list:
    """A moving shape's frames cropped to `size` (the larger side rendered, the middle kept)."""
    from dstune.data.synthetic import render_moving_shape

    images, caption = render_moving_shape(index, max(size), frames)
    left, top = (max(size) - size[0]) // 2, (max(size) - size[1]) // 2
    return [image.crop((left, top, left + size[0], top + size[1])) for image in images], caption


def _write_clip(path: Path, frames: list, sound: Optional[np.ndarray]) -> None:
    import av

    if sound is not None:
        from dstune.data.sound import mp4_with_sound

        path.write_bytes(mp4_with_sound(frames, CLIP_FPS, sound, 24000))
        return
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=CLIP_FPS)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt, stream.thread_count = "yuv420p", 1
        for image in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")))
        container.mux(stream.encode())


def _sizes() -> list[tuple[int, int]]:
    return [WIDE] * FILES_PER_SHAPE + [TALL] * FILES_PER_SHAPE


def write_datasets(root: Path) -> dict[str, Path]:
    """The matrix's data under `root` (made once per session): name -> folder."""
    import soundfile

    from dstune.data.synthetic import moving_shape_tone, render_tones

    folders = {name: root / name for name in (IMAGES, PAIRS, VIDEOS, VIDEOS_WITH_SOUND, SPEECH, SPEECH_WITH_SPEAKERS)}
    for name in (IMAGES, VIDEOS, VIDEOS_WITH_SOUND):
        folders[name].mkdir(parents=True)
    for folder in ("target", "control"):
        (folders[PAIRS] / folder).mkdir(parents=True)
    for number, size in enumerate(_sizes()):
        frames, caption = _frames(number, size, CLIP_FRAMES)
        frames[0].save(folders[IMAGES] / f"{number:03d}.png")
        (folders[IMAGES] / f"{number:03d}.txt").write_text(caption.replace(" moving", ""))
        frames[0].save(folders[PAIRS] / "target" / f"{number:03d}.png")
        (folders[PAIRS] / "target" / f"{number:03d}.txt").write_text(f"turn it into {caption.replace(' moving', '')}")
        _frames(number + 100, size, 1)[0][0].save(folders[PAIRS] / "control" / f"{number:03d}.png")
        for name, sound in ((VIDEOS, None), (VIDEOS_WITH_SOUND, moving_shape_tone(number, CLIP_FRAMES, CLIP_FPS))):
            _write_clip(folders[name] / f"{number:03d}.mp4", frames, sound)
            (folders[name] / f"{number:03d}.txt").write_text(caption)
    for name, speakers in ((SPEECH, False), (SPEECH_WITH_SPEAKERS, True)):
        (folders[name] / "clips").mkdir(parents=True)
        lines = []
        for number in range(2 * FILES_PER_SHAPE):
            text = SHORT_TONES if number % 2 else LONG_TONES
            soundfile.write(folders[name] / "clips" / f"{number:03d}.wav", render_tones(text), 16000)
            line = {"audio": f"clips/{number:03d}.wav", "text": " ".join(text)}
            lines.append({**line, "speaker": str(number // 2 % 2)} if speakers else line)
        (folders[name] / "metadata.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    from safetensors.numpy import save_file

    vectors = {str(s): np.random.default_rng(s).standard_normal(SPEAKER_DIM).astype(np.float32) for s in (0, 1)}
    save_file({name: v / np.linalg.norm(v) for name, v in vectors.items()}, str(root / "speakers.safetensors"))
    folders["speaker_embeddings"] = root / "speakers.safetensors"
    return folders


# ----------------------------------------------------------------------------------------- each model's factors

IMAGE, EDIT, VIDEO, SPEECH_KIND = "image", "edit", "video", "speech"
LORA_RANK = 4
# the options the golden losses also set: the default text lengths (512-1024 tokens) would make the text side most
# of every tiny case's time, and say nothing more about the step
FIXED_OPTIONS = {
    "tiny-flux2": {"max_sequence_length": 64},
    "tiny-flux2-dev": {"max_sequence_length": 64},
    "tiny-ernie-image": {"max_sequence_length": 64},
    "tiny-hunyuan-video15": {"max_sequence_length": 48},
    "tiny-hunyuan-video15-i2v": {"max_sequence_length": 48},
    "tiny-ltx2": {"max_sequence_length": 32},
    "tiny-ltx2-3": {"max_sequence_length": 32},
    "tiny-ltx2-5": {"max_sequence_length": 32},
    "tiny-minimax-h3": {"max_sequence_length": 16},
    # Kandinsky 6: the tiny tokenizer's template keeps ~500 tokens after the pipeline's crop; u is drawn uniformly
    "tiny-kandinsky6": {"max_sequence_length": 560, "timestep_sampling": "uniform"},
}
# the LoRA targets of a model whose layers are not diffusers' to_q / to_k / to_v / to_out.0
LORA_TARGETS = {"tiny-kandinsky6": ["to_query", "to_key", "to_value", "attn.out_layer", "self_attention.out_layer"]}
SIDE_PX = {
    "tiny-qwen-image-21": 32,
    "tiny-wan22-ti2v": 32,
    "tiny-minimax-h3": 32,
}  # bucket sides: the latent factor x the patch; else 16
# each model's own settings that change the step (the factors every model has are added by `factors`)
OWN_FACTORS = {
    "tiny-wan-a14b": {"expert": ("high_noise", "low_noise")},
    "tiny-wan22-ti2v": {"image_to_video": (False, True)},
    "tiny-ltx2": {"image_to_video": (False, True), "sound": (False, True)},
    # LTX-2.3 and 2.5: the same class; their own parts (projections, gated and modulated attention) with and without
    # sound, image-to-video being tiny-ltx2's
    "tiny-ltx2-3": {"sound": (False, True)},
    "tiny-ltx2-5": {"sound": (False, True)},
    # MiniMax-H3: clips of 17k+5 frames (the cases' clips are 9 frames long: 5, 2 latent frames), with and without
    # sound
    "tiny-minimax-h3": {"sound": (False, True), "frames": (5,)},
    "tiny-kandinsky6": {"image_to_video": (False, True), "sound": (False, True)},
    **{
        name: {"speakers": (False, True)}
        for name in ("tiny-orpheus", "tiny-csm", "tiny-dia", "tiny-vibevoice", "tiny-pocket-tts", "tiny-gradium-phonon")
    },
    "tiny-speecht5": {"speakers": (False, True)},
}
NO_TRAIN_MODE = {"tiny-speecht5"}  # SpeechT5's section has neither `train` (LoRA) nor gradient_checkpointing
NO_CACHE = {"tiny-speecht5"}  # its mel targets are computed from the waveform; no codec-token cache
EDIT_MODELS = {
    "tiny-qwen-image-edit",
    "tiny-qwen-image-edit-plus",
    "tiny-flux-kontext",
}  # trained on source/target pairs (data.control_dir)


def kind(name: str) -> str:
    from dstune.builtin import BUILTIN_MODELS

    family = BUILTIN_MODELS[name].family
    if family in ("tts_lm", "tts_codebooks", "speecht5"):
        return SPEECH_KIND
    if family == VIDEO_FAMILY:
        return VIDEO
    return EDIT if name in EDIT_MODELS else IMAGE


def factors(name: str) -> dict[str, tuple]:
    """The settings the one-process cases vary for `name`, and their values."""
    out: dict[str, tuple] = {"micro_batch_size": (1, 2), "precision": ("fp32", "bf16")}
    if name not in NO_TRAIN_MODE:
        out.update(train=("full", "lora"), gradient_checkpointing=(False, True))
    if name not in NO_CACHE:
        out["cache"] = (False, True)
    out.update(
        {
            IMAGE: {"buckets": (False, True)},
            EDIT: {"buckets": (False, True)},
            SPEECH_KIND: {"durations": ("mixed", "bucketed")},
        }.get(kind(name), {"buckets": (False, True), "frames": (5, 9)})
    )
    return {**out, **OWN_FACTORS.get(name, {})}


def model_section(name: str, row: dict) -> dict:
    from dstune.builtin import BUILTIN_MODELS

    section = {"family": BUILTIN_MODELS[name].family, "pretrained": f"builtin:{name}", **FIXED_OPTIONS.get(name, {})}
    if name not in NO_TRAIN_MODE:
        section.update(train=row.get("train", "full"), gradient_checkpointing=row.get("gradient_checkpointing", False))
        if section["train"] == "lora":
            section["lora"] = {
                "rank": LORA_RANK,
                **({"target_modules": LORA_TARGETS[name]} if name in LORA_TARGETS else {}),
            }
    for option in ("expert", "image_to_video"):
        if option in row:
            section[option] = row[option]
    if name == "tiny-speecht5" and row.get("speakers"):
        section["speaker_embeddings"] = "SPEAKER_EMBEDDINGS"
    return section


def data_section(name: str, row: dict, folders: dict, cache_dir: Path) -> dict:
    what = kind(name)
    cache = row.get("cache", False)
    if what == SPEECH_KIND:
        data = {"path": str(folders[SPEECH_WITH_SPEAKERS if row.get("speakers") else SPEECH]), "format": "jsonl"}
        if row.get("durations") == "bucketed":
            data["duration_bucket_seconds"] = 0.25
        if cache:
            data["cache"] = {"codec_tokens": True, "dir": str(cache_dir)}
        return {**data, "num_workers": 0}
    data = {"path": str(folders[IMAGES]), "resolution": 32}
    if what == EDIT:
        data.update(path=str(folders[PAIRS] / "target"), control_dir="../control")
    if what == VIDEO:
        data.update(
            path=str(folders[VIDEOS_WITH_SOUND if row.get("sound") else VIDEOS]), video={"frames": row["frames"]}
        )
    if row.get("buckets"):
        data.update(resolution=48, buckets={"enabled": True, "step": SIDE_PX.get(name, 16)})
    if cache:  # the edit model's text is encoded with its source image: only its latents cache
        data["cache"] = {"latents": True, "text_embeddings": what != EDIT, "dir": str(cache_dir)}
    return {**data, "num_workers": 0}


def case_spec(name: str, row: dict, folders: dict, run_dir: Path, models_cache: Path) -> dict:
    """The spec of one case: `row` (setting -> value) on built-in model `name`, one optimizer step."""
    model = model_section(name, row)
    if model.get("speaker_embeddings"):
        model["speaker_embeddings"] = str(folders["speaker_embeddings"])
    micro, accumulation = row.get("micro_batch_size", 2), row.get("gradient_accumulation_steps", 1)
    spec = {
        "model": model,
        "data": data_section(name, row, folders, run_dir.parent / "encoded"),
        "train": {
            "micro_batch_size": micro,
            "gradient_accumulation_steps": accumulation,
            "max_steps": 1,
            "precision": row.get("precision", "fp32"),
            "seed": 7,
            "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        },
        "output": {"dir": str(run_dir), "cache_dir": str(models_cache), "export": "none"},
        "sample": {"prompts": []},
    }
    if "zero_stage" in row:
        spec["deepspeed"] = {"zero_stage": row["zero_stage"]}
    return spec


def case_id(name: str, row: dict) -> str:
    """A case's name: the model and its values, as test ids and messages show them."""
    return name + "[" + ",".join(f"{k}={v}" for k, v in row.items()) + "]"


# --------------------------------------------------------------------------------- parameters a model leaves out

_LAST = r"transformer_blocks\.1\."  # the last block of the tiny two-block transformers
_DEAD_TEXT_STREAM = (
    _LAST + r"(attn\.(to_add_out|add_q_proj|norm_added_q)|txt_mlp|ff_context)\.",
    "the last block's text stream: the transformer keeps only the image tokens after its last block, so the text "
    "tokens' output there (and the text queries that make only it) reaches no loss, in any trainer",
)
_GLYPH = (
    r"^context_embedder_2\.",
    "the ByT5 glyph encoder reads only quoted text in a caption; the shapes' captions quote none, so its tokens are "
    "masked out",
)


def _always(row: dict) -> bool:
    return True


# model -> (when (row -> bool), parameter-name pattern, why): trainable parameters the model itself gives no gradient
# (or an all-zero one) in those settings, as its reference training would; every other one must get a gradient
LEFT_OUT = {
    "tiny-flow": [
        (
            _always,
            _LAST + r"attn\.add_q_proj\.",
            "SD3's last block is context_pre_only: its text queries make only text outputs, which it drops",
        )
    ],
    "tiny-qwen-image": [(_always, *_DEAD_TEXT_STREAM)],
    "tiny-qwen-image-edit": [(_always, *_DEAD_TEXT_STREAM)],
    "tiny-qwen-image-edit-plus": [(_always, *_DEAD_TEXT_STREAM)],
    "tiny-z-image": [
        (
            _always,
            r"^x_pad_token$",
            "Z-Image's padding token fills the image tokens up to a multiple of 32 and is masked out of attention",
        )
    ],
    "tiny-hunyuan-video15": [
        (_always, *_DEAD_TEXT_STREAM),
        (_always, *_GLYPH),
        (
            _always,
            r"^image_embedder\.",
            "text-to-video: HunyuanVideo 1.5 feeds its image embedder zeros (no first frame)",
        ),
    ],
    "tiny-hunyuan-video15-i2v": [(_always, *_DEAD_TEXT_STREAM), (_always, *_GLYPH)],
    "tiny-pocket-tts": [
        (
            _always,
            r"^model\.loss_weighting\.(layers\.|proj\.weight)",
            "Pocket TTS's loss weighting MLP starts at zero (the class's init): only its output bias has a first gradient",
        )
    ],
    "tiny-gradium-phonon": [
        (
            _always,
            r"^model\.loss_weighting\.(layers\.|proj\.weight)",
            "Phonon's loss weighting MLP starts at zero (the class's init): only its output bias has a first gradient",
        )
    ],
    "tiny-ltx2": [
        (
            lambda row: not row.get("sound"),
            r"(audio|a2v|av_cross_attn)",
            "clips without sound: LTX-2's audio stream and its audio-video attention do not run (isolate_modalities)",
        )
    ],
    **{
        name: [
            (
                lambda row: not row.get("sound"),
                r"(audio|a2v|av_cross_attn)",
                "clips without sound: LTX-2's audio stream and its audio-video attention do not run",
            )
        ]
        for name in ("tiny-ltx2-3", "tiny-ltx2-5")
    },
    "tiny-minimax-h3": [
        (
            lambda row: not row.get("sound"),
            r"^audio_proj_out\.",
            "clips without sound: MiniMax-H3's sound rows are zeros with no loss (the published trainer's), so the "
            "sound's output projection has no gradient",
        )
    ],
}
LEFT_OUT["tiny-kandinsky6"] = [
    (
        lambda row: not row.get("image_to_video"),
        r"^visual_token_type_embeddings\.",
        "text-to-video: no reference frame, so no token type but the generated frames' (0) is embedded",
    ),
    (
        lambda row: not row.get("sound"),
        r"^(audio_out_layer\.|visual_transformer_blocks\.1\.(audio_dec_block\.(cross_attention|feed_forward)|av_cross_attention)\.)",
        "clips without sound: the sound's prediction is outside the loss (the fork's audio weight 0), and with it what "
        "only the sound's stream computes after the last block's video reads it (the tiny model's block 1)",
    ),
]
LEFT_OUT["tiny-ltx2-5"] = LEFT_OUT["tiny-ltx2-5"] + [
    (
        _always,
        r"^keyframes_abs_pos_embedding$",
        "LTX-2.5's keyframe embedding marks generated keyframes when rendering; training marks none (ltx-trainer's)",
    )
]
LORA_A = (r"\.lora_A\.", "LoRA's B starts at zero, so A's first gradient is zero (peft's initialisation)")
# The warnings a case must give, because the setting asks for what they warn about: a model that trains sound on
# clips without any is told that the run trains the video alone (docs/family-ltx2.md). Each must appear in those
# cases, and nowhere else is a warning allowed.
EXPECTED_WARNINGS = {
    "tiny-ltx2": [
        (lambda row: not row.get("sound"), "clips has a sound track: builtin:tiny-ltx2 trains each clip's sound")
    ],
    **{
        name: [(lambda row: not row.get("sound"), f"clips has a sound track: builtin:{name} trains each clip's sound")]
        for name in ("tiny-ltx2-3", "tiny-ltx2-5", "tiny-minimax-h3", "tiny-kandinsky6")
    },
}


def expected_warnings(name: str, row: dict) -> list[str]:
    """The texts of the warnings this case must give (each a substring of one warning)."""
    return [text for when, text in EXPECTED_WARNINGS.get(name, []) if when(row)]


def unexpected_warnings(name: str, row: dict, warnings: list[str]) -> tuple[list[str], list[str]]:
    """(the warnings EXPECTED_WARNINGS does not name, the expected ones that did not come)."""
    expected = expected_warnings(name, row)
    unexpected = [w for w in warnings if not any(text in w for text in expected)]
    missing = [text for text in expected if not any(text in w for w in warnings)]
    return unexpected, missing


def unexplained(name: str, row: dict, grads: dict[str, list[str]]) -> dict[str, list[str]]:
    """grad_problems' parameters that LEFT_OUT (and, with LoRA, LORA_A for zero gradients) do not explain."""
    import re

    patterns = [pattern for when, pattern, _ in LEFT_OUT.get(name, []) if when(row)]
    out = {}
    for problem, names in grads.items():
        allowed = patterns + ([LORA_A[0]] if problem == "zero gradient" else [])
        left = [n for n in names if problem == "non-finite gradient" or not any(re.search(p, n) for p in allowed)]
        if left:
            out[problem] = left
    return out


# ---------------------------------------------------------------------------------------- one case, one process


def grad_problems(trainable) -> dict[str, list[str]]:
    """Trainable parameters without a gradient, with a non-finite one, or with one that is zero everywhere."""
    import torch

    params = [(name, p) for name, p in trainable.named_parameters() if p.requires_grad]
    return {
        "no gradient": [name for name, p in params if p.grad is None],
        "non-finite gradient": [name for name, p in params if p.grad is not None and not torch.isfinite(p.grad).all()],
        "zero gradient": [name for name, p in params if p.grad is not None and not p.grad.any()],
    }


def run_case(spec_path: Path) -> dict:
    """One case as one rank of `python dstune/train.py` starts it, without DeepSpeed: the spec validated for a world
    of one, the model built and made trainable (LoRA, the precision's dtype), the records checked, the caches built,
    the training loader; then its first batch through encode_batch, loss and backward. {"loss", "batch",
    "warnings" (validate's), "grads" (grad_problems)}; an exception propagates."""
    import torch

    from dstune.distributed import Run
    from dstune.ds_json.fill_spec import merged_spec
    from dstune.engine import PRECISION_DTYPES
    from dstune.spec.load import load_spec
    from dstune.startup import (
        checked_records,
        give_voices,
        hear_speakers,
        load_trained_model,
        make_training_loader,
        prepare_caches,
    )
    from dstune.validate import validate_spec
    from dstune.world import World

    world = World(1, 1, (1,), ("localhost",), "the settings matrix: one process")
    spec, source = merged_spec(*load_spec(str(spec_path), []))
    resolved = validate_spec(spec, source, world)
    spec, plan = resolved.spec, resolved.plan
    run = Run(rank=0, local_rank=0, world=world, device="cpu", accelerator="cpu", node_rank=0, launched=False)
    model = load_trained_model(run, spec, ds_config=resolved.ds_config)
    records = checked_records(run, spec, model.modality, model.sound_rate if model.modality == "video" else None)
    give_voices(model, records)
    hear_speakers(run, spec, model, records)
    caches, code = prepare_caches(run, spec, model, records)
    assert code == 0, "the caches were not built"
    loader, _ = make_training_loader(spec, plan, 0, model, records, caches, 0, 0)
    batch = next(iter(loader))
    encoded = model.encode_batch(batch, PRECISION_DTYPES[spec.train.precision][0])
    loss = model.loss(model.trainable, encoded, spec.train.seed, 0)
    loss.backward()
    return {
        "loss": float(loss.detach().float()),
        "finite": bool(torch.isfinite(loss.detach()).all()),
        "batch": len(batch["index"]),
        "warnings": [str(w) for w in resolved.warnings],
        "grads": grad_problems(model.trainable),
    }


def run_cases(cases: list[tuple[str, str]]) -> None:
    """(case id, spec path) -> one JSON line each on stdout, flushed as it ends: what run_case returned (or the
    traceback), the warnings raised from dstune's own files, what the case printed, and its seconds."""
    import contextlib
    import io
    import time
    import traceback
    import warnings

    import torch

    torch.set_num_threads(1)  # the pytest workers already share the cores
    ours = str(REPO / "dstune")
    for name, path in cases:
        started, printed = time.perf_counter(), io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
            warnings.simplefilter("always")
            with contextlib.redirect_stderr(printed):
                try:
                    result = run_case(Path(path))
                except SystemExit as stopped:  # dstune.distributed.stop: a clear message was printed, then exit
                    result = {"stopped": stopped.code}
                except Exception:  # noqa: BLE001 - the case's failure, reported by the test that reads it
                    result = {"traceback": traceback.format_exc()[-4000:]}
        result["dstune_warnings"] = [
            f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.filename.startswith(ours)
        ]
        result.update(case=name, printed=printed.getvalue()[-3000:], seconds=round(time.perf_counter() - started, 2))
        print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------- the 2-rank runs

# what only DeepSpeed at two ranks does, with the step settings whose interaction with it matters most
DEEPSPEED_FACTORS = {
    "zero_stage": (0, 2, 3),
    "accumulation": (1, 2),  # 2: micro batch 1 x 2 micro steps through the engine; 1: micro batch 2
    "cache": (False, True),  # built by both ranks, each a share
    "precision": ("fp32", "bf16"),  # DeepSpeed's bf16: its own optimizer over fp32 master weights
    "train": ("full", "lora"),
    "gradient_checkpointing": (False, True),
    "grouped": (False, True),  # aspect-ratio buckets (images, clips) or duration buckets (speech), over the ranks
}


def _run_row(name: str, settings: dict, zero_stage: int, second: bool) -> dict:
    """A 2-rank run's row (case_spec's terms) for `name`: DEEPSPEED_FACTORS' values, less what the model does not
    have (SpeechT5: LoRA, checkpointing, a cache), and its own settings at their first value (the second run: last)."""
    own = factors(name)
    row = {"zero_stage": zero_stage, **{k: v for k, v in settings.items() if k in own}}
    row.update(micro_batch_size=2 // settings["accumulation"], gradient_accumulation_steps=settings["accumulation"])
    if kind(name) == SPEECH_KIND:
        row["durations"] = "bucketed" if settings["grouped"] else "mixed"
    else:
        row["buckets"] = settings["grouped"]
    for setting, values in own.items():
        row.setdefault(setting, values[-1] if second else values[0])
    return row


def deepspeed_runs(models: list[str]) -> list[tuple[str, dict]]:
    """Two 2-rank runs per model: ZeRO 3 with a row of a pairwise design over the other DEEPSPEED_FACTORS (the rows
    handed out in turn), and ZeRO 0 or 2 (by blocks of len(rows) models, so that every row meets both) with that
    row's complement. So each model runs every value of every setting under DeepSpeed, its own options at both ends,
    and the runs as made cover every pair of DEEPSPEED_FACTORS' values (tests/dist/test_settings_matrix_two_ranks.py checks
    both)."""
    from covering_array import pairwise

    binary = {k: v for k, v in DEEPSPEED_FACTORS.items() if k != "zero_stage"}
    rows = pairwise(binary)
    runs = []
    for number, name in enumerate(models):
        row = rows[number % len(rows)]
        other = {k: values[1 - values.index(row[k])] for k, values in binary.items()}
        runs.append((name, _run_row(name, row, 3, second=False)))
        runs.append((name, _run_row(name, other, 0 if number // len(rows) % 2 == 0 else 2, second=True)))
    return runs


def as_deepspeed_row(row: dict) -> dict:
    """A run's row in DEEPSPEED_FACTORS' terms (to check the coverage of the runs as made)."""
    out = {k: row[k] for k in DEEPSPEED_FACTORS if k in row}
    out["accumulation"] = row["gradient_accumulation_steps"]
    out["grouped"] = bool(row.get("buckets")) or row.get("durations") == "bucketed"
    return out
