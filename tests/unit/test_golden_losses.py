"""Golden loss trajectories: 20 optimisation steps of every built-in model, in one process, against pinned losses.

Each built-in model (dstune.builtin.BUILTIN_MODELS) is loaded as training loads it (its card's class, `load` on the
folders dstune.pretrained resolves), fed a fixed sequence of batches of its
built-in data (builtin:shapes, source/target shape pairs, builtin:moving-shapes clips, builtin:tones clips), and its
trainable module is stepped by a plain torch.optim.AdamW on `model.loss` (one CPU thread, fixed seeds). The 20
losses must equal tests/data/golden_losses.json to RELATIVE_TOLERANCE. They are the numerics of the whole training
step (data, frozen encoders, noise and timestep draws, the denoiser or LM, the loss, its gradient), so a change that
moves any of them fails here, naming the model and the first step that moved.

They hold on every x86 CPU (AVX2, AMD AVX-512, Intel AVX-512 with AMX) by construction, not by pinning kernels:
- The built-in models' bytes do not depend on the CPU: what their builds train is stored with dstune
  (dstune.builtin.trained), the rest is ATen's random initialisation under dstune.builtin.PINNED_ISA_ENV.
- The trajectories run in float64 (DTYPE: the model, its frozen parts and the loss), in a child process under the
  same ATen pin. The matrix products that MKL and oneDNN compute, whose summation order (and so last bits) each
  processor chooses, then differ by about 1e-16 relative from one CPU to another instead of 1e-7; what remains in
  float32 is the libraries' own upcasts (RMS norms, a causal LM's log-softmax), ATen code that the pin makes the
  same everywhere.
- Measured on one machine across MKL's code branches (AUTO = AVX-512, AVX2, SSE4.2, COMPATIBLE) and oneDNN's ISA
  caps, the 27 trajectories agree within 2.3e-10 relative (tiny-z-image, where a float32 norm rounds one value the
  other way; most within 1e-15). RELATIVE_TOLERANCE (1e-8) is 40 times that, and still catches a numerics change: a
  one-ulp (float32) change of a constant in a loss moves the trajectories by more than 1e-7
  (test_a_one_ulp_change_of_a_loss_constant_fails). test_the_trajectories_hold_on_other_kernels reruns the most
  sensitive ones on MKL's COMPATIBLE branch and oneDNN's SSE4.1 kernels in every run of the suite.

Regenerate ONLY for an intended numerics change (a new torch, a fixed loss, a changed built-in model), and say so in
the commit, with the models whose losses moved:

    make golden-losses        # = python tests/unit/test_golden_losses.py --regenerate

A refactor that claims "no behaviour change" must pass this file unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dstune.families import card_of, load_model
from dstune.pretrained import resolve_folders
from dstune.spec.models import DataSpec, FlowModelSpec, VideoModelSpec
from dstune.spec.speech_models import CodebooksModelSpec
from dstune.models.sd.spec import SdModelSpec
from dstune.models.sdxl.spec import SdxlModelSpec
from dstune.models.speecht5.spec import SpeechT5ModelSpec
from dstune.models.tts_lm.spec import TtsLmModelSpec

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
GOLDEN = REPO / "tests" / "data" / "golden_losses.json"
STEPS = 20
BATCH = 2
SEED = 0  # the training seed handed to model.loss (noise and timestep draws) and to the datasets
RELATIVE_TOLERANCE = 1e-8
DTYPE = torch.float64  # see the module docstring
# The most CPU-sensitive trajectories (float32 norms inside, or many matrix products), rerun on other kernels
OTHER_KERNELS_ENV = {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
OTHER_KERNELS_CASES = ("tiny-z-image", "tiny-qwen-image-21", "tiny-sd", "tiny-csm", "tiny-hunyuan-video15")
IMAGE_SIDE, EDIT_SIDE, CLIP_FRAMES = 32, 64, 5  # edit pairs: 8 px per latent, 8x8 latents
IMAGE_LR, SPEECH_LR = 1e-3, 1e-2
FLUX2_TEXT_TOKENS = 64  # the chat-templated captions fit; the default 512 makes the text encoder most of the time
HV15_TEXT_TOKENS = 48  # HunyuanVideo 1.5's default 1000 Qwen tokens would make the text side most of the time
LTX2_TEXT_TOKENS = 32  # LTX-2's default 1024 Gemma tokens likewise
K6_TEXT_TOKENS = 560  # Kandinsky 6: the tiny tokenizer's template keeps ~500 tokens after the crop, then the caption
ERNIE_TEXT_TOKENS = 64  # the shapes' captions fit; padding to the default 512 would make attention most of the time


def _model(model_class, family: str, **options):
    return lambda name: model_class(family=family, pretrained=f"builtin:{name}", **options)


# built-in model -> (its model spec section, its data, the AdamW learning rate)
CASES = {
    "tiny-sd": (_model(SdModelSpec, "sd"), "shapes", IMAGE_LR),
    "tiny-sdxl": (_model(SdxlModelSpec, "sdxl"), "shapes", IMAGE_LR),
    "tiny-flow": (_model(FlowModelSpec, "flow"), "shapes", IMAGE_LR),
    "tiny-flux": (_model(FlowModelSpec, "flow"), "shapes", IMAGE_LR),
    "tiny-qwen-image": (_model(FlowModelSpec, "flow"), "shapes", IMAGE_LR),
    "tiny-qwen-image-edit": (_model(FlowModelSpec, "flow"), "edit-pairs", IMAGE_LR),
    "tiny-flux-kontext": (_model(FlowModelSpec, "flow"), "edit-pairs", IMAGE_LR),
    "tiny-qwen-image-edit-plus": (_model(FlowModelSpec, "flow"), "edit-pairs-2", IMAGE_LR),
    "tiny-z-image": (_model(FlowModelSpec, "flow"), "shapes", IMAGE_LR),
    "tiny-flux2": (_model(FlowModelSpec, "flow", max_sequence_length=FLUX2_TEXT_TOKENS), "shapes", IMAGE_LR),
    "tiny-flux2-dev": (_model(FlowModelSpec, "flow", max_sequence_length=FLUX2_TEXT_TOKENS), "shapes", IMAGE_LR),
    "tiny-ideogram4": (_model(FlowModelSpec, "flow"), "shapes", IMAGE_LR),
    "tiny-krea2": (_model(FlowModelSpec, "flow"), "shapes", IMAGE_LR),
    "tiny-krea2-turbo": (_model(FlowModelSpec, "flow"), "shapes", IMAGE_LR),
    "tiny-qwen-image-21": (_model(FlowModelSpec, "flow", timestep_sampling="uniform"), "shapes", IMAGE_LR),
    "tiny-ernie-image": (_model(FlowModelSpec, "flow", max_sequence_length=ERNIE_TEXT_TOKENS), "shapes", IMAGE_LR),
    "tiny-wan": (_model(VideoModelSpec, "video"), "moving-shapes", IMAGE_LR),
    "tiny-wan-a14b": (_model(VideoModelSpec, "video", expert="low_noise"), "moving-shapes", IMAGE_LR),
    "tiny-wan-i2v": (_model(VideoModelSpec, "video"), "moving-shapes", IMAGE_LR),
    "tiny-wan22-ti2v": (_model(VideoModelSpec, "video", image_to_video=True), "moving-shapes", IMAGE_LR),
    "tiny-tts-lm": (_model(TtsLmModelSpec, "tts_lm"), "tones", SPEECH_LR),
    "tiny-orpheus": (_model(TtsLmModelSpec, "tts_lm", codec="snac"), "tones", SPEECH_LR),
    "tiny-speecht5": (_model(SpeechT5ModelSpec, "speecht5"), "tones", SPEECH_LR),
    "tiny-csm": (_model(CodebooksModelSpec, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-dia": (_model(CodebooksModelSpec, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-vibevoice": (_model(CodebooksModelSpec, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-pocket-tts": (_model(CodebooksModelSpec, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-gradium-phonon": (_model(CodebooksModelSpec, "tts_codebooks"), "tones", SPEECH_LR),
    "tiny-hunyuan-video15": (
        _model(VideoModelSpec, "video", max_sequence_length=HV15_TEXT_TOKENS),
        "moving-shapes",
        IMAGE_LR,
    ),
    "tiny-hunyuan-video15-i2v": (
        _model(VideoModelSpec, "video", max_sequence_length=HV15_TEXT_TOKENS),
        "moving-shapes",
        IMAGE_LR,
    ),
    "tiny-ltx2": (
        _model(VideoModelSpec, "video", max_sequence_length=LTX2_TEXT_TOKENS, timestep_sampling="shifted_logit_normal"),
        "moving-shapes",
        IMAGE_LR,
    ),
    "tiny-ltx2-3": (
        _model(VideoModelSpec, "video", max_sequence_length=LTX2_TEXT_TOKENS, timestep_sampling="shifted_logit_normal"),
        "moving-shapes",
        IMAGE_LR,
    ),
    "tiny-ltx2-5": (
        _model(VideoModelSpec, "video", max_sequence_length=LTX2_TEXT_TOKENS, timestep_sampling="shifted_logit_normal"),
        "moving-shapes",
        IMAGE_LR,
    ),
    "tiny-minimax-h3": (
        _model(VideoModelSpec, "video", max_sequence_length=LTX2_TEXT_TOKENS),
        "moving-shapes",
        IMAGE_LR,
    ),
    "tiny-kandinsky6": (
        _model(VideoModelSpec, "video", max_sequence_length=K6_TEXT_TOKENS, timestep_sampling="uniform"),
        "moving-shapes-av",
        IMAGE_LR,
    ),
}


# ------------------------------------------------------------------------------------------------ batches


def _image_samples(kind: str):
    """index -> one sample of the built-in images or clips, as the training datasets produce it."""
    from dstune.data.index import list_samples

    if kind == "moving-shapes":
        from dstune.data.video import VideoCaptionDataset

        data = DataSpec(path="builtin:moving-shapes", resolution=IMAGE_SIDE, video={"frames": CLIP_FRAMES})
        return VideoCaptionDataset(data, list_samples(data, video=True), SEED)
    from dstune.data.images import ImageCaptionDataset

    data = DataSpec(path="builtin:shapes", resolution=IMAGE_SIDE)
    return ImageCaptionDataset(data, list_samples(data), SEED)


def _edit_pair_batch(indices: list[int], references: int = 1) -> dict:
    """Targets are shapes with an instruction; each reference is another shape (as tests/dist's edit pairs):
    reference k of sample i is shape i + 100 k."""
    from dstune.data.images import to_tensor
    from dstune.data.synthetic import render_shape
    from dstune.spec.data_sections import reference_key

    targets = [render_shape(i, EDIT_SIDE) for i in indices]
    return {
        "pixel_values": torch.stack([to_tensor(image) for image, _ in targets]),
        **{
            reference_key("control_values", k): torch.stack(
                [to_tensor(render_shape(i + 100 * (k + 1), EDIT_SIDE)[0]) for i in indices]
            )
            for k in range(references)
        },
        "caption": [f"turn it into {caption}" for _, caption in targets],
        "index": torch.tensor(indices, dtype=torch.long),
    }


def batches(kind: str, model) -> list[dict]:
    """STEPS collated batches of BATCH consecutive samples each (samples 0, 1 | 2, 3 | ...)."""
    steps = [list(range(BATCH * step, BATCH * (step + 1))) for step in range(STEPS)]
    if kind.startswith("edit-pairs"):  # "edit-pairs-N": N references per target
        return [
            _edit_pair_batch(indices, int(kind.rpartition("-")[2]) if kind[-1].isdigit() else 1) for indices in steps
        ]
    if kind == "tones":
        from dstune.data.audio import SpeechDataset, collate_speech, speech_records

        records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.5))
        dataset = SpeechDataset(records, model.sample_rate)
        return [collate_speech([dataset[i % len(dataset)] for i in indices]) for indices in steps]
    if kind == "moving-shapes-av":  # clips with their sound, at the rate the model reads it
        from dstune.data.index import list_samples
        from dstune.data.video import VideoCaptionDataset, collate_video

        data = DataSpec(path="builtin:moving-shapes-av", resolution=IMAGE_SIDE, video={"frames": CLIP_FRAMES})
        dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, model.sound_rate)
        return [collate_video([dataset[i % len(dataset)] for i in indices]) for indices in steps]
    dataset = _image_samples(kind)
    if kind == "moving-shapes":
        from dstune.data.video import collate_video as collate
    else:
        from dstune.data.images import collate
    return [collate([dataset[i % len(dataset)] for i in indices]) for indices in steps]


# ------------------------------------------------------------------------------------------- trajectory


def one_ulp_up(value: float) -> float:
    """The next float32 above `value`: a constant changed by one unit in the last place of training's precision."""
    import numpy as np

    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


def trajectory(name: str, perturbation: str | None = None) -> list[float]:
    """The STEPS losses of `name`: model.loss on its batches, each followed by an AdamW step of the trainable.
    `perturbation` changes one constant of the loss by one float32 ulp (test_a_one_ulp_change_of_a_loss_constant_fails):
    "vae_scaling_factor" (the latents' scale) or "loss_weight" (the weight of the mean)."""
    make_spec, data, lr = CASES[name]
    spec = make_spec(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a reduction's order (and so its last bits) depends on the thread count
    try:
        torch.manual_seed(SEED)  # any draw outside the per-sample generators (dropout) starts the same
        folders = resolve_folders(spec, CACHE_DIR)
        model = load_model(card_of(spec.family, folders["pretrained"]), spec, folders, "cpu", DTYPE)
        if perturbation == "vae_scaling_factor":  # the latents' scale, a constant of the diffusion loss
            model.vae.register_to_config(scaling_factor=one_ulp_up(model.vae.config.scaling_factor))
        weight = one_ulp_up(1.0) if perturbation == "loss_weight" else 1.0  # the mean's weight
        if model.voice_references:  # the voice prompts start-up gives (dstune.startup.give_voices)
            from dstune.data.audio import reference_clips, speech_records

            records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.5))
            model.take_voices(reference_clips(records, model.voice_references, model.sample_rate))
        trainable = model.trainable.to(DTYPE)
        optimizer = torch.optim.AdamW([p for p in trainable.parameters() if p.requires_grad], lr=lr)
        losses = []
        for step, batch in enumerate(batches(data, model)):
            loss = weight * model.loss(trainable, model.encode_batch(batch, DTYPE), SEED, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses
    finally:
        torch.set_num_threads(threads)


def test_every_built_in_model_has_a_case():
    from dstune.builtin import BUILTIN_MODELS

    assert set(CASES) == set(BUILTIN_MODELS), "add the new built-in model to CASES and run `make golden-losses`"


def run_child(cases=None, extra_env: dict | None = None) -> dict[str, list[float]]:
    """Trajectories computed in a child process under dstune.builtin.PINNED_ISA_ENV (and `extra_env`), of `cases`
    ("model" or "model:perturbation"; None: every model): {case: losses}."""
    from dstune.builtin import pinned_child_env

    args = [sys.executable, __file__, "--print"] + ([",".join(cases)] if cases else [])
    done = subprocess.run(args, env={**pinned_child_env(), **(extra_env or {})}, capture_output=True, text=True)
    assert done.returncode == 0, f"the trajectories failed:\n{(done.stderr or done.stdout)[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


_computed: dict[str, list[float]] = {}


def pinned_trajectories() -> dict[str, list[float]]:
    """Every case's trajectory, computed once."""
    if not _computed:
        _computed.update(run_child())
    return _computed


@pytest.mark.parametrize("name", list(CASES))
def test_loss_trajectory_matches_the_pinned_one(name):
    pinned = json.loads(GOLDEN.read_text()).get(name)
    assert pinned is not None, f"{GOLDEN.relative_to(REPO)} has no {name}: run `make golden-losses`"
    losses = pinned_trajectories()[name]
    moved = [
        step for step, (got, want) in enumerate(zip(losses, pinned)) if abs(got - want) > RELATIVE_TOLERANCE * abs(want)
    ]
    assert len(losses) == len(pinned) == STEPS and not moved, (
        f"{name}: the loss moved from step {moved[0] + 1} of {STEPS} (pinned {pinned[moved[0]]!r}, now "
        f"{losses[moved[0]]!r}); all: {losses}. If the numerics change is intended, run `make golden-losses` and "
        "say so in the commit."
        if moved
        else f"{name}: {len(losses)} losses, {len(pinned)} pinned"
    )


def relative_difference(losses: list[float], pinned: list[float]) -> float:
    return max(abs(got - want) / abs(want) for got, want in zip(losses, pinned))


def test_the_trajectories_hold_on_other_kernels():
    """On MKL's COMPATIBLE branch and oneDNN's SSE4.1 kernels (other summation orders than this machine's defaults,
    as another processor's), the most sensitive trajectories still equal the pinned ones within the tolerance."""
    pinned = json.loads(GOLDEN.read_text())
    for name, losses in run_child(OTHER_KERNELS_CASES, OTHER_KERNELS_ENV).items():
        difference = relative_difference(losses, pinned[name])
        assert difference <= RELATIVE_TOLERANCE, f"{name} moves by {difference:.2e} on other kernels"


# a constant of the loss, changed by one float32 ulp: the latents' scale of a diffusion loss (UNet and flow cores),
# the weight of a causal LM's loss (about 1.2e-7 relative each)
ONE_ULP_CASES = ("tiny-sd:vae_scaling_factor", "tiny-flow:vae_scaling_factor", "tiny-tts-lm:loss_weight")


def test_a_one_ulp_change_of_a_loss_constant_fails():
    """The tolerance is tight enough to see a constant of the loss change by one float32 ulp (with a margin of 2)."""
    pinned = json.loads(GOLDEN.read_text())
    for case, losses in run_child(ONE_ULP_CASES).items():
        difference = relative_difference(losses, pinned[case.split(":")[0]])
        assert difference > 2 * RELATIVE_TOLERANCE, f"{case}: one ulp up moves the losses by only {difference:.2e}"


def regenerate() -> None:
    """Rewrite GOLDEN from this code (every model), printing which models moved."""
    import dstune

    if not Path(dstune.__file__).resolve().is_relative_to(REPO):
        sys.exit(
            f"this would pin the losses of {Path(dstune.__file__).parent}, not of {REPO / 'dstune'}: run it as "
            "`make golden-losses` (PYTHONPATH is the repository)"
        )
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    new = pinned_trajectories()
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(new, indent=1) + "\n")
    for name, losses in new.items():
        print(
            f"{name}: {'unchanged' if old.get(name) == losses else 'NEW' if name not in old else 'changed'}; "
            f"loss {losses[0]:.5f} -> {losses[-1]:.5f}"
        )
    print(f"wrote {GOLDEN.relative_to(REPO)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print"]:  # the child process of run_child: one JSON line, last
        cases = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
        print(json.dumps({case: trajectory(*case.split(":")) for case in cases}))
        sys.exit(0)
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(
            f"usage: python {Path(__file__).relative_to(REPO)} --regenerate   (rewrites "
            f"{GOLDEN.relative_to(REPO)}: only for an intended numerics change)"
        )
    regenerate()
