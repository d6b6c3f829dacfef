"""model.vae_tiling: the VAE encodes and decodes through its own tiles (diffusers' enable_tiling) where a clip does not
fit it whole (HunyuanVideo 1.5 at 720p). Tiled latents are not the untiled ones past one tile, so dstune never tiles
unless the spec says so, caches them apart, and refuses the key for a VAE whose tiles' memory it does not know."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from dstune import builtin as tiny

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
HV15 = "tiny-hunyuan-video15"


def _vae():
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15.from_pretrained(tiny.ensure_builtin_model(HV15, CACHE_DIR) / "vae").eval()


def _clip(side: int) -> torch.Tensor:
    return torch.randn(1, 3, 5, side, side, generator=torch.Generator().manual_seed(0))


def test_a_clip_within_one_tile_encodes_bit_for_bit_and_a_wider_one_does_not():
    """Within a tile nothing is tiled (the cache of a run that sets the key for small clips holds the same latents);
    past one the tiles' borders are blended and the VAE's attention sees one tile: other latents (on the built-in
    model, whose weights are random, far from them; dstune cannot bound it for the real weights)."""
    vae = _vae()
    with torch.no_grad():
        small, wide = _clip(32), _clip(96)
        plain = vae.encode(small).latent_dist.mean, vae.encode(wide).latent_dist.mean
        # the tiny VAE's scale of the real 256 px tiles (8x in space: 4 latent rows a tile)
        vae.enable_tiling(32, 32, 4, 4)
        tiled = vae.encode(small).latent_dist.mean, vae.encode(wide).latent_dist.mean
    assert torch.equal(plain[0], tiled[0])
    assert plain[1].shape == tiled[1].shape and not torch.allclose(plain[1], tiled[1], atol=1e-3)


def _spec(tmp_path: Path, vae_tiling: bool, pretrained: str = f"builtin:{HV15}") -> dict:
    return {
        "model": {"family": "video", "pretrained": pretrained, "vae_tiling": vae_tiling, "max_sequence_length": 32},
        "data": {
            "path": "builtin:moving-shapes",
            "resolution": 32,
            "cache": {"latents": True, "text_embeddings": False, "dir": str(tmp_path / "cache")},
        },
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 1},
        "output": {"dir": str(tmp_path / "run")},
    }


def test_tiled_latents_are_cached_apart_and_the_vae_tiles_for_the_whole_run(tmp_path, capsys):
    """One process builds the latent cache without the key, then with it: the tiled run's entries are its own
    (built now, none reused), and its VAE tiles from the cache on (the step's encode and the samples' decode). Each
    build encodes as many clips a VAE pass as the plan's cache_encoding says (2, then 1)."""
    from dstune.distributed import Run
    from dstune.spec.models import Spec
    from dstune.startup import checked_records, load_trained_model, prepare_caches
    from dstune.world import World

    world = World(world_size=1, num_nodes=1, ranks_per_node=(1,), hosts=("localhost",), source="test")
    run = Run(rank=0, local_rank=0, world=world, device="cpu", accelerator="cpu", node_rank=0, launched=False)
    built_now = []
    for vae_tiling, per_pass in ((False, 2), (True, 1)):
        spec = Spec.model_validate(_spec(tmp_path, vae_tiling))
        built = load_trained_model(run, spec, train_mode=False)
        records = checked_records(run, spec, built.modality)[:2]
        batches, encode = [], built.vae.encode
        built.vae.encode = lambda pixels, *args, **kwargs: (
            batches.append(len(pixels)) or encode(pixels, *args, **kwargs)
        )
        caches, code = prepare_caches(run, spec, built, records, encoding={"entries_per_pass": per_pass})
        assert code == 0 and built.vae.use_tiling is vae_tiling and batches == [per_pass] * (2 // per_pass)
        built_now.append(capsys.readouterr().out)
    assert "built now 2, already cached 0" in built_now[0] and "built now 2, already cached 0" in built_now[1]


@pytest.mark.parametrize("pretrained", ["builtin:tiny-wan"])
def test_vae_tiling_is_refused_for_a_vae_whose_tiles_dstune_does_not_know(pretrained, tmp_path, capsys):
    from dstune.cli import main

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, True, pretrained)))
    assert main(["validate", str(path), "--num-gpus", "2"]) == 1
    err = capsys.readouterr()
    assert "model.vae_tiling" in err.out + err.err and "AutoencoderKLHunyuanVideo15" in err.out + err.err
