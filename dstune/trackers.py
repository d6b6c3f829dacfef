"""Where rank 0's metrics go besides metrics.jsonl: TensorBoard event files (output.tensorboard, on by default) and an
offline Weights & Biases run (output.wandb, when the `wandb` package is installed).

    trackers = open_trackers(run_dir, tensorboard=True, wandb=False, config=spec_as_dict)
    trackers.scalars(record)                 # every number of a metrics.jsonl record, at record["step"]
    trackers.samples(step, path)             # a sample grid PNG, or a folder of sample WAVs
    trackers.close()

TensorBoard tags group the record's keys (`scalar_tag`): train/loss (and its parts: train/loss_video, ...),
train/lr, train/grad_norm, eval/loss, memory/..., progress/epoch and progress/samples, and perf/... for the rest (samples/s, data wait). W&B gets the same
tags. W&B runs offline only (nothing leaves the machine); `wandb sync <run_dir>/wandb/offline-run-*` uploads later.
"""

from __future__ import annotations

import importlib.util
import numbers
from pathlib import Path
from typing import Optional

TENSORBOARD_FOLDER = "tensorboard"  # under the run folder
TRAIN_KEYS = ("loss", "lr", "grad_norm")
PROGRESS_KEYS = ("epoch", "samples")


def scalar_tag(key: str) -> str:
    """The TensorBoard / W&B tag of a metrics.jsonl key."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_") :]
    if key in TRAIN_KEYS or key.startswith("loss_"):  # loss_<part>: a loss's named parts (a video's and its sound's)
        return "train/" + key
    if key in PROGRESS_KEYS:
        return "progress/" + key
    if key.startswith("memory_"):
        return "memory/" + key[len("memory_") :]
    return "perf/" + key


def scalar_items(record: dict) -> list[tuple[str, float]]:
    """(tag, value) for every finite-or-not number of the record except its step (bools and None are left out)."""
    return [
        (scalar_tag(key), float(value))
        for key, value in record.items()
        if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)
    ]


def wandb_missing() -> Optional[str]:
    """Why output.wandb cannot work on this machine, or None."""
    if importlib.util.find_spec("wandb") is None:
        return (
            "the `wandb` package is not installed here. Install it (`pip install wandb`; dstune runs it offline "
            "and never uploads) or set output.wandb: false (TensorBoard, output.tensorboard, needs nothing extra)"
        )
    return None


class Trackers:
    """TensorBoard and/or W&B for one run; every method is a no-op for a tracker that is off."""

    def __init__(self, tensorboard_writer=None, wandb_run=None):
        self.tensorboard = tensorboard_writer
        self.wandb = wandb_run

    def scalars(self, record: dict) -> None:
        step = int(record["step"])
        items = scalar_items(record)
        if self.tensorboard is not None:
            for tag, value in items:
                self.tensorboard.add_scalar(tag, value, step)
            self.tensorboard.flush()  # a crash, or a TensorBoard reading the folder now, sees every logged step
        if self.wandb is not None and items:
            self.wandb.log(dict(items), step=step)

    def samples(self, step: int, path: Path) -> None:
        """Rank 0's sample output of `step`: a grid PNG (one image), an animated WebP grid of clips (its first frame
        to TensorBoard; its MP4 to W&B) or a folder of WAVs (one audio clip each)."""
        path = Path(path)
        if path.is_dir():
            self._audio(step, sorted(path.glob("*.wav")))
        elif path.suffix in (".png", ".webp"):
            self._image(step, path)

    def _image(self, step: int, path: Path) -> None:
        import numpy as np
        from PIL import Image

        if self.tensorboard is not None:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.tensorboard.add_image("samples", pixels, step, dataformats="HWC")
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            mp4 = path.with_suffix(".mp4")
            media = wandb.Video(str(mp4)) if path.suffix == ".webp" and mp4.is_file() else wandb.Image(str(path))
            self.wandb.log({"samples": media}, step=step)

    def _audio(self, step: int, wavs: list[Path]) -> None:
        import soundfile
        import torch

        for wav in wavs:
            wave, rate = soundfile.read(str(wav), dtype="float32", always_2d=True)
            if not len(wave):  # a model that ended at once (its EOS first) said nothing: TensorBoard cannot take it
                continue
            if self.tensorboard is not None:
                clip = torch.from_numpy(wave.mean(axis=1)).clamp(-1, 1).unsqueeze(0)
                self.tensorboard.add_audio(f"samples/{wav.stem}", clip, step, sample_rate=rate)
            if self.wandb is not None:
                import wandb

                self.wandb.log({f"samples/{wav.stem}": wandb.Audio(str(wav))}, step=step)
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def open_trackers(run_dir: Path, tensorboard: bool, wandb: bool, config: Optional[dict] = None) -> Trackers:
    """The trackers the spec asks for, writing under `run_dir` (rank 0 only calls this). A resumed run appends new
    event files to the same folder; TensorBoard shows them as one run."""
    writer = run = None
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_FOLDER))
    if wandb:
        problem = wandb_missing()
        if problem:  # validate refuses this before training; a run reaching here lost the package since
            raise RuntimeError(f"output.wandb: {problem}")
        import wandb as wandb_module

        run = wandb_module.init(
            mode="offline", dir=str(run_dir), project="dstune", name=Path(run_dir).name, config=config or {}
        )
    return Trackers(writer, run)
