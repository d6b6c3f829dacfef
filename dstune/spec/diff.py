"""What changed between the spec a run was started with (saved in every checkpoint) and the spec it resumes with.

A resumed run continues exactly (same samples, noise, weights, schedule) only if nothing that decides those
changed. Changes to where and how often the run writes, to what the samples show, or to how long it runs are safe
and listed; every other change breaks exact continuation and is refused unless the user asks for it explicitly.
Pure: dictionaries in, changes out (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MISSING = object()

# Dotted key (or prefix ending in ".") -> why changing it keeps the run's trajectory.
SAFE_CHANGES = {
    "output.": "where and how often the run writes checkpoints, metrics and the export",
    "sample.": "only what the sample grids show",
    "deepspeed.timeout_minutes": "only how long ranks wait for each other",
    "deepspeed.sequence_parallel_size": "how many ranks share each sample (the same maths; a changed global batch is "
    "decided on its own)",
    "data.num_workers": "only how many processes load the same batches",
    "data.video.require_sound": "only whether clips without a sound track are refused",
    "data.allow_upscaling": "only whether images smaller than data.resolution are warned about",
    "data.cache.": "only where encodings come from (cached and on-the-fly batches agree to float rounding)",
    "data.eval.every_steps": "only how often the held-out loss is measured (the held-out images stay the same)",
    "data.eval.batch_size": "only how the held-out loss is batched (the held-out images stay the same)",
    "train.micro_batch_size": "how the global batch is split (a changed global batch is decided on its own)",
    "train.gradient_accumulation_steps": "how the global batch is split (a changed global batch is decided on its own)",
    "train.global_batch_size": "a changed global batch is decided on its own (--allow-batch-change)",
    "model.activation_offload": "only where checkpointed blocks' inputs wait (the same values, bitwise)",
    "model.text_encoder_offload": "only where the text encoders' weights wait while they build the text cache (the "
    "same embeddings, bitwise)",
    "train.compile": "only how the blocks run (compiled and plain blocks agree to float rounding)",
    "train.max_steps": "the run's length: the steps already taken stay as they were",
    "train.epochs": "the run's length: the steps already taken stay as they were",
}
LENGTH_KEYS = ("train.max_steps", "train.epochs")

# Dotted key (or prefix ending in ".") -> why a checkpoint cannot be continued with it changed. Refused even with
# --allow-spec-changes: what the checkpoint holds (its weights, its optimizer state) has no meaning under the new
# value. Every other change takes effect from the resumed step (docs/training.md, "Resume").
NOT_RESUMABLE = {
    "model.family": "the checkpoint's weights belong to another model",
    "model.train": "a full fine-tune saves every weight and a LoRA run only its adapters; one cannot continue the other",
    "model.lora.rank": "the saved adapters have the old rank's shapes",
    "model.lora.target_modules": "the saved adapters sit on the old modules",
    "model.expert": "the checkpoint trained the other expert's weights",
    "model.codec": "the checkpoint's audio-token embeddings belong to the old codec",
    "model.num_codebooks": "the checkpoint's audio-token embeddings were sized for the old codebooks",
    "model.token_layout": "the checkpoint's embeddings were trained on the old token layout",
    "model.added_tokens": "the checkpoint's embeddings were sized for the old vocabulary",
    "train.optimizer.type": "the saved optimizer state (its moments) belongs to the old optimizer",
    "train.precision": "DeepSpeed saves the optimizer's master weights and state in the layout of the precision it "
    "trained in",
    "deepspeed.zero_stage": "each ZeRO stage saves its optimizer state (stage 3 also its weights) in its own layout",
    "deepspeed.offload_optimizer.device": "with optimizer offload DeepSpeed runs its own CPU Adam, another optimizer "
    "than the one whose state the checkpoint holds",
}
NEW_RUN = (
    "Or start a new run in another output.dir, from this run's weights if you like (`dstune export RUN` "
    "writes them; use that folder as model.pretrained)."
)


def _matching(table: dict[str, str], key: str) -> str | None:
    for known, why in table.items():
        if key == known or (known.endswith(".") and key.startswith(known)):
            return why
    return None


def why_safe(key: str) -> str | None:
    """Why changing `key` keeps the trajectory, or None when it does not."""
    return _matching(SAFE_CHANGES, key)


def why_not_resumable(key: str) -> str | None:
    """Why a checkpoint cannot continue with `key` changed, or None when the change can take effect."""
    return _matching(NOT_RESUMABLE, key)


@dataclass(frozen=True)
class SpecChange:
    key: str  # dotted, e.g. "train.seed"
    before: Any
    after: Any

    @property
    def safe(self) -> bool:
        return why_safe(self.key) is not None

    def text(self) -> str:
        def show(value):
            return "(unset)" if value is _MISSING else repr(value)

        return f"{self.key}: {show(self.before)} -> {show(self.after)}"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): value}


# Keys added later whose unset value (None: the model's own choice, filled in before training) was, before they
# existed, one fixed behaviour: a checkpoint's spec that lacks them, or leaves them unset, trained that way.
BEHAVED_AS = {
    "data.reference_size": "target",  # before data.reference_size every reference was sized with its target
}


def spec_changes(saved: dict, current: dict) -> list[SpecChange]:
    """Every leaf key whose value differs (lists compare whole), in the order the current spec lists them."""
    before, after = _flatten(saved), _flatten(current)
    keys = list(after) + [k for k in before if k not in after]
    return [
        SpecChange(k, before.get(k, _MISSING), after.get(k, _MISSING))
        for k in keys
        if _unset_as_none(k, before.get(k, _MISSING)) != _unset_as_none(k, after.get(k, _MISSING))
    ]


def _unset_as_none(key: str, value: Any) -> Any:
    """A key that a checkpoint's spec lacks (saved by a dstune without it) and one left unset (None) are the same
    setting: an optional section added later must not make every older checkpoint look changed. Where an unset key
    stands for one behaviour (BEHAVED_AS), it is that value."""
    value = None if value is _MISSING else value
    return BEHAVED_AS.get(key, value) if value is None else value


def describe_changes(changes: list[SpecChange], schedule: str) -> tuple[str, str]:
    """(text listing the safe changes, text listing the breaking ones); either may be "". `schedule` is the spec's
    train.scheduler.type: a decaying schedule is restored with the checkpoint, so a new length does not stretch it."""
    safe = [c for c in changes if c.safe]
    breaking = [c for c in changes if not c.safe]
    safe_lines = [f"  {c.text()}  ({why_safe(c.key)})" for c in safe]
    if schedule in ("linear", "cosine") and any(c.key in LENGTH_KEYS for c in safe):
        safe_lines.append(
            f"  note: the {schedule} LR schedule resumes with the length the run started with; "
            "steps past it train at the schedule's final LR"
        )
    safe_text = "spec changes since the checkpoint (allowed):\n" + "\n".join(safe_lines) if safe else ""
    breaking_text = ""
    if breaking:
        breaking_text = (
            "spec changes since the checkpoint that break exact continuation (the data, seed, model, "
            "precision, optimizer or schedule the checkpoint was trained with):\n"
            + "\n".join(f"  {c.text()}" for c in breaking)
            + "\nRevert them to continue the run exactly, start a new run (another output.dir), or "
            "pass --allow-spec-changes to continue with them anyway: each then takes effect from the "
            "resumed step (a new LR, schedule or optimizer setting replaces the checkpoint's)."
        )
    return safe_text, breaking_text


def refused_changes_text(changes: list[SpecChange], saved: dict, current: dict) -> str:
    """The changes no resume can take (even with --allow-spec-changes), each with why, and the way on; "" if none.
    `saved` and `current` are the two specs (dicts): an EMA switched on has no saved EMA to continue from."""
    lines = [f"  {c.text()}: {why_not_resumable(c.key)}" for c in changes if why_not_resumable(c.key)]
    ema_before = (saved.get("train") or {}).get("ema")
    if ema_before is None and (current.get("train") or {}).get("ema") is not None:
        lines.append(
            "  train.ema: (unset) -> set: the checkpoint holds no EMA to continue (train.ema was off when it "
            "was written); remove train.ema to continue without one"
        )
    if not lines:
        return ""
    return (
        "spec changes since the checkpoint that no resume can take, even with --allow-spec-changes:\n"
        + "\n".join(lines)
        + "\nRevert them to continue this run. "
        + NEW_RUN
    )
