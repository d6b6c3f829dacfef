"""A JPEG cut short, which PIL's verify() passes, is found on the ranks before step 1 by the check `dstune
validate` makes (dstune.data.image_check): it stops every rank, naming the file and the key that skips it. (With
data.skip_bad_files it is reported and skipped and the run trains on: the zero1 run of tests/dist/test_train.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import base_spec, explain, launch, metrics, write_spec

pytestmark = pytest.mark.dist


def _images_with_a_cut_jpeg(root: Path) -> Path:
    """8 PNG shapes with captions and one JPEG holding the first half of a real JPEG's bytes."""
    import numpy as np
    from PIL import Image

    from dstune.data.synthetic import render_shape

    root.mkdir(parents=True)
    for i in range(8):
        image, caption = render_shape(i, 32)
        image.save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(caption)
    noise = (np.random.default_rng(0).random((96, 128, 3)) * 255).astype("uint8")
    Image.fromarray(noise).save(root / "cut.jpg", quality=90)
    whole = (root / "cut.jpg").read_bytes()
    (root / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    (root / "cut.txt").write_text("a photo cut short")
    return root


def test_a_truncated_jpeg_stops_every_rank_before_step_1(tmp_path):
    data = _images_with_a_cut_jpeg(tmp_path / "images")
    run_dir = tmp_path / "run"
    spec = base_spec(run_dir, data={"path": str(data)}, train={"max_steps": 2})
    proc = launch(write_spec(tmp_path / "spec.yaml", spec), num_ranks=2)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, explain(proc)
    assert proc.returncode == 1, explain(proc)
    assert "data.path: 1 unreadable image(s):" in out and "cut.jpg: image file is truncated" in out
    assert "data.skip_bad_files: true" in out
    assert not (run_dir / "metrics.jsonl").exists() or metrics(run_dir) == []  # stopped before step 1
