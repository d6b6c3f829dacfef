"""No code runs from untrusted files: a malicious pickle in a checkpoint and a YAML python tag in a spec are refused.

Each malicious file, if it were unpickled / constructed, would create a marker file; the tests show the marker is
never created and the user gets a clear error instead.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from dstune.checkpoints.layout import CheckpointError
from dstune.checkpoints.store import only_tensors_unpickled
from dstune.export import ExportError, consolidated_state_dict
from dstune.spec.load import SpecError, load_spec


class _RunsCode:
    """Unpickling this calls exec(): what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def _malicious_checkpoint(root: Path, tag: str, marker: Path) -> Path:
    folder = root / tag
    folder.mkdir(parents=True)
    payload = {"module": {"weight": torch.zeros(2)}, "extra": _RunsCode(marker)}
    torch.save(payload, folder / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": _RunsCode(marker)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (root / "latest").write_text(tag)
    return folder


def test_the_payload_really_runs_code_when_unpickled_unsafely(tmp_path):
    """The control: without the guard, the same file runs its code (so the refusals below mean something)."""
    marker = tmp_path / "marker"
    folder = _malicious_checkpoint(tmp_path / "checkpoints", "step-00000001", marker)
    torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    assert marker.read_text() == "code ran"


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_export_refuses_a_malicious_checkpoint(tmp_path, zero_stage):
    marker = tmp_path / "marker"
    _malicious_checkpoint(tmp_path / "checkpoints", "step-00000001", marker)
    with pytest.raises(ExportError, match="refused to load a file that is not plain weights"):
        consolidated_state_dict(tmp_path / "checkpoints", "step-00000001", zero_stage)
    assert not marker.exists()


def test_deepspeed_style_loads_are_made_weights_only(tmp_path):
    """DeepSpeed's load_checkpoint and zero_to_fp32 call torch.load(..., weights_only=False): inside the guard
    (which load_checkpoint and export use) that call is weights-only too."""
    marker = tmp_path / "marker"
    folder = _malicious_checkpoint(tmp_path / "checkpoints", "step-00000001", marker)
    with pytest.raises(CheckpointError, match=r"checkpoint X: refused .*exec"):
        with only_tensors_unpickled("checkpoint X"):
            torch.load(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert not marker.exists()


def test_plain_weights_and_deepspeed_types_still_load(tmp_path):
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(3), "stage": ZeroStageEnum.gradients, "step": 5}, path)
    with only_tensors_unpickled("checkpoint ok"):
        loaded = torch.load(path, weights_only=False)
    assert loaded["stage"] == ZeroStageEnum.gradients and loaded["w"].sum().item() == 3


def test_the_guard_does_not_leak(tmp_path):
    """After the guard, other code's torch.load behaves as it asked (the environment switch is restored)."""
    import os

    with only_tensors_unpickled("x"):
        pass
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_yaml_python_tag_is_refused(tmp_path):
    marker = tmp_path / "marker"
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\ndata: {{path: 'builtin:shapes'}}\n")
    with pytest.raises(SpecError) as caught:
        load_spec(str(spec), [])
    assert not marker.exists()
    assert "python/object/apply" in str(caught.value)


def test_override_cannot_smuggle_a_python_tag(tmp_path):
    marker = tmp_path / "marker"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {family: sd, pretrained: 'builtin:tiny-sd'}\ndata: {path: 'builtin:shapes'}\n"
        "train: {micro_batch_size: 1}\n"
    )
    try:
        load_spec(str(spec), [f"train.seed=!!python/object/apply:os.system ['touch {marker}']"])
    except SpecError:
        pass
    assert not marker.exists()


def test_pickle_module_is_not_what_torch_uses_for_the_guard():
    """The guard relies on torch's weights-only unpickler; an explicit pickle_module would bypass it, and torch
    refuses that combination, so nothing can sneak a permissive unpickler in."""
    with only_tensors_unpickled("x"):
        with pytest.raises(RuntimeError, match="pickle_module"):
            torch.load(__file__, pickle_module=pickle)
