"""Export: consolidate a checkpoint's ZeRO shards into full weights and write a folder the ecosystem loads.

One path for both the end of training and `dstune export RUN_DIR`: read the checkpoint DeepSpeed wrote (stages 1-3
through DeepSpeed's own zero_to_fp32, which recovers the fp32 master weights even from bf16 runs; stage 0 from the
model-states file), then hand the state dict to the model's class, which writes a diffusers / transformers folder.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Optional

import torch

from dstune.checkpoints.layout import STATE_FILE, CheckpointError, checkpoint_root, list_complete, read_latest, tag_for
from dstune.checkpoints.store import only_tensors_unpickled
from dstune.ema import consolidated_ema, overlay_ema
from dstune import registry
from dstune.card import load
from dstune.families import get_facts
from dstune.families.base import FamilyError
from dstune.families.lora import export_lora
from dstune.families.speakers import Voices, synthesis_speaker
from dstune.pretrained import build_model
from dstune.spec.load import SpecSource, validate_data
from dstune.spec.models import lora_format_problem


class ExportError(RuntimeError):
    pass


def find_checkpoint(run_dir: Path, step: Optional[int]) -> tuple[Path, str]:
    root = checkpoint_root(run_dir)
    if step is None:
        tag = read_latest(root)
        if tag is None:
            raise ExportError(f"{run_dir}: no complete checkpoint under {root} (is this a dstune run folder?)")
        return root, tag
    tag = tag_for(step)
    if not (root / tag / STATE_FILE).is_file():
        have = ", ".join(t.removeprefix("step-").lstrip("0") or "0" for t in list_complete(root)) or "none"
        raise ExportError(f"{run_dir}: no complete checkpoint for step {step} (steps available: {have})")
    return root, tag


def consolidated_state_dict(root: Path, tag: str, zero_stage: int, scalar_params: list[str] = ()) -> dict:
    """Full fp32 weights of the trainable module, with diffusers/transformers key names (no `module.` prefix)."""
    try:
        state = _load_weights(root, tag, zero_stage)
    except CheckpointError as err:  # a file that is not plain weights: the CLI reports it like any export error
        raise ExportError(str(err)) from None
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    for name in scalar_params:  # promoted to shape (1,) for DeepSpeed; the model expects a 0-dim tensor
        if name in state:
            state[name] = state[name].reshape(())
    return state


def _load_weights(root: Path, tag: str, zero_stage: int) -> dict:
    folder = root / tag
    if zero_stage == 0:
        files = sorted(folder.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ExportError(f"{folder}: no mp_rank_*_model_states.pt (incomplete checkpoint?)")
        with only_tensors_unpickled(f"checkpoint {folder}"):
            state = torch.load(files[0], map_location="cpu", weights_only=True)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # zero_to_fp32 calls torch.load(weights_only=False); the guard makes those loads weights-only too.
        with only_tensors_unpickled(f"checkpoint {folder}"), contextlib.redirect_stdout(io.StringIO()):
            state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    return state


def export_checkpoint(
    run_dir: Path,
    step: Optional[int] = None,
    out_dir: Optional[Path] = None,
    model=None,
    lora_format: Optional[str] = None,
) -> Path:
    """Write the export of one checkpoint; returns the folder. `model` (the run's, loaded) may be passed to skip
    loading it again;
    `lora_format` (dstune export --lora-format) replaces the run's output.lora_format."""
    root, tag = find_checkpoint(Path(run_dir), step)
    saved = json.loads((root / tag / STATE_FILE).read_text())
    spec = validate_data(saved["spec"], SpecSource(str(root / tag / STATE_FILE)))
    lora_format = lora_format or spec.output.lora_format
    problem = lora_format_problem(spec.model.family, getattr(spec.model, "train", "full"), lora_format)
    if problem:
        raise ExportError(f"--lora-format {lora_format}: {problem}")
    if model is None:
        model = build_model(spec.model, spec.output.cache_dir, "cpu", torch.float32)
    if saved.get("speakers"):  # a speech run's speaker map: speakers.json beside the model
        model.voices = Voices.from_json(saved["speakers"])
    state = consolidated_state_dict(
        root,
        tag,
        saved["ds_config"]["zero_optimization"]["stage"] if "zero_optimization" in saved["ds_config"] else 0,
        saved.get("scalar_params", []),
    )
    out = Path(out_dir) if out_dir else Path(run_dir) / "export" / tag
    try:
        state, weights = _chosen_weights(root / tag, state, spec.train.ema)
        if getattr(spec.model, "train", "full") == "lora":
            export_lora(model, state, out, spec.model, weights, lora_format)
        else:
            model.export(state, out)
    except CheckpointError:
        raise
    except (ValueError, RuntimeError, OSError) as err:
        raise ExportError(f"export of {root / tag} failed: {err}") from err
    return out


def _chosen_weights(folder: Path, state: dict, ema_settings) -> tuple[dict, str]:
    """The weights train.ema.export asks for: the EMA (from every rank's ema_rank*.pt) in place of the trained
    weights, or the trained weights as they are. Returns (state dict, "ema" | "raw")."""
    if ema_settings is None or ema_settings.export != "ema":
        return state, "raw"
    with only_tensors_unpickled(f"checkpoint {folder}"):
        ema = consolidated_ema(folder)
    return overlay_ema(state, ema), "ema"


def speak(
    folder: Path, text: str, out_wav: Path, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
):
    """`dstune synthesize`: speech for `text` from a speech model's export (the first speech model whose class says
    the folder is its own), written to `out_wav`; returns the clip. FamilyError naming the speech models otherwise.
    `speaker`: a speaker of the training data, by its name (the export's speakers.json says what the model is given
    for it); LookupError naming the known ones for another name (UnknownSpeaker)."""
    import soundfile

    voice = synthesis_speaker(folder, speaker)

    cards = [card for card in registry.cards() if get_facts(card.family).modality == "audio"]  # no image class imported
    speaking = next((card for card in cards if load(card.model_class).speaks_from(card, folder)), None)
    if speaking is None:
        names = ", ".join(card.name for card in cards)
        raise FamilyError(
            f"{folder} is not an export dstune can speak from: it holds none of the speech models ({names}). Point "
            "it at the export/ folder of a speech run."
        )
    clip = load(speaking.model_class).synthesize(folder, text, seconds, temperature, seed, voice)
    out_wav.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(out_wav), clip.wave, clip.sample_rate, subtype="FLOAT")
    return clip
