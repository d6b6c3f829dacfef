"""model.text_encoder_offload (dstune.families.text_offload): through every flow and video model's own text path (its
encode_text, on its built-in model's real encoder classes), the text tensors with the encoders' weights in host memory
equal the encoders placed whole on the device bit for bit; no operation of the pass reads a host weight (each layer
runs on its own copies, also where the device is the host), and every weight is back in its host tensor afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from dstune.families.text_offload import OFFLOADED, offload_text_encoder
from dstune.pretrained import build_model
from dstune.spec.model_sections import FlowModelSpec
from dstune.spec.video_models import VideoModelSpec

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
CAPTIONS = ["a red circle", 'a sign that reads "OPEN" on a grey wall, two words long']
FLOW = ("tiny-qwen-image", "tiny-krea2", "tiny-z-image", "tiny-flux2", "tiny-flux2-dev", "tiny-qwen-image-21")
MODELS = [("flow", name) for name in FLOW + ("tiny-ernie-image", "tiny-flux")] + [
    ("video", name) for name in ("tiny-hunyuan-video15", "tiny-ltx2", "tiny-wan")
]


def _built(family: str, name: str, offload: str):
    section = FlowModelSpec if family == "flow" else VideoModelSpec
    spec = section(family=family, pretrained=f"builtin:{name}", text_encoder_offload=offload)
    return build_model(spec, CACHE_DIR, "cpu")


# what reads a host weight without computing with it: the hooks' own moves (p.data read and set, the copy into a
# device tensor like it) and metadata (transformers asks a parameter's dtype kind)
NOT_COMPUTING = {"__get__", "__set__", "empty_like", "copy_", "is_floating_point"}


class _HostWeightReads(TorchFunctionMode):
    """The operations (but NOT_COMPUTING) given a tensor whose storage is one of `host` (the loaded weights')."""

    def __init__(self, host: set):
        super().__init__()
        self.host, self.reads, self.calls = host, [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        for leaf in tree_leaves((args, kwargs or {})):
            name = getattr(func, "__name__", str(func))
            if isinstance(leaf, torch.Tensor) and name not in NOT_COMPUTING and leaf.data_ptr() in self.host:
                self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _encode(model) -> dict:
    with torch.no_grad():
        return model.encode_text(CAPTIONS)


@pytest.mark.parametrize("family,name", MODELS, ids=[name for _, name in MODELS])
def test_offloaded_text_encoders_give_the_same_tensors_and_read_no_host_weight(family, name):
    whole, offloaded = _built(family, name, "none"), _built(family, name, "cpu")
    encoders = [encoder for encoder in offloaded.text_encoders.values() if encoder is not None]
    assert encoders and all(getattr(encoder, OFFLOADED, None) for encoder in encoders)
    assert not any(getattr(e, OFFLOADED, None) for e in whole.text_encoders.values() if e is not None)
    host = {p.data_ptr() for encoder in encoders for p in encoder.parameters()}
    watch = _HostWeightReads(host)
    with watch:
        got = _encode(offloaded)
    assert watch.calls > 0 and watch.reads == [], (name, sorted(set(watch.reads))[:5])
    assert {p.data_ptr() for encoder in encoders for p in encoder.parameters()} == host  # the host tensors back
    expected = _encode(whole)
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), (name, key)


def test_without_the_hooks_the_check_sees_host_reads():
    """The check above can fail: an encoder run on its loaded weights reads them in its operations."""
    layer = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    host = {p.data_ptr() for p in layer.parameters()}
    watch = _HostWeightReads(host)
    with watch, torch.no_grad():
        plain = layer(torch.tensor([[1, 2, 3]]))
    assert "embedding" in watch.reads and "linear" in watch.reads
    offload_text_encoder(layer, "cpu")
    watch = _HostWeightReads(host)
    with watch, torch.no_grad():
        assert torch.equal(layer(torch.tensor([[1, 2, 3]])), plain)
    assert watch.reads == []


def test_tied_weights_move_with_the_module_that_runs():
    """An LM head sharing the embedding table (one Parameter): each module's forward gets it on the device."""
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    host = {p.data_ptr() for p in model.parameters()}
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        plain = model["head"](model["embed"](ids))
        offload_text_encoder(model, "cpu")
        watch = _HostWeightReads(host)
        with watch:
            offloaded = model["head"](model["embed"](ids))
    assert watch.reads == [] and torch.equal(offloaded, plain)
    assert model["head"].weight is model["embed"].weight and model["embed"].weight.data_ptr() in host


def _planned(tmp_path, preset: str, sets: list):
    from dstune.reference import model_spec
    from dstune.validate import load_and_validate, plan_memory
    from dstune.world import world_from_flags

    path = tmp_path / f"{preset}.yaml"
    path.write_text(model_spec(preset, path.name))
    resolved = load_and_validate(
        path, sets, world=world_from_flags(num_gpus=8), num_samples=1000, accelerator="cuda", check_files=False
    )
    return plan_memory(resolved.spec, resolved.plan, resolved.ds_config, 24e9, "cuda", resolved.clips)


def test_the_plan_holds_one_layer_of_the_text_encoders_in_the_cache_phase(tmp_path, monkeypatch):
    """LTX-2 with the text cache: Gemma 3 12B and the connectors leave the GPU's load and cache phases, the largest
    module's own weights (the embedding table, 262,208 x 3840) join the text pass; the node's host figure is the same."""
    from dstune.memory.phases import TEXT_CHUNK, TEXT_LAYER

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    whole = _planned(tmp_path, "ltx2", ["data.cache.text_embeddings=true"])
    offloaded = _planned(tmp_path, "ltx2", ["data.cache.text_embeddings=true", "model.text_encoder_offload=cpu"])
    companions = whole["parameters"]["companions"]
    text = 2 * (companions["text_encoder"] + companions["connectors"])  # bf16
    frozen = "frozen parts (every encoder)"
    for phase in ("load", "cache"):
        before, after = whole["phases"][phase]["parts"], offloaded["phases"][phase]["parts"]
        assert before[frozen] - after[frozen] == pytest.approx(text)
    layer = offloaded["phases"]["cache"]["parts"][TEXT_LAYER]
    assert layer == 2 * 262_208 * 3840 and TEXT_LAYER not in whole["phases"]["cache"]["parts"]
    cache_before, cache_after = whole["phases"]["cache"], offloaded["phases"]["cache"]
    assert cache_after["parts"][TEXT_CHUNK] == cache_before["parts"][TEXT_CHUNK]  # the latents are not cached here
    assert cache_after["per_gpu_bytes"] == pytest.approx(cache_before["per_gpu_bytes"] - text + layer)
    assert whole["host_per_node_bytes"] == offloaded["host_per_node_bytes"]


@pytest.mark.parametrize(
    "sets,why",
    [
        ([], "data.cache.text_embeddings is off"),
        (["data.cache.text_embeddings=true", "data.cache.dir=/tmp/c-{rank}"], "data.cache.dir has {rank}"),
    ],
)
def test_validate_refuses_it_where_the_encoders_run_beyond_the_text_cache(tmp_path, monkeypatch, sets, why):
    from dstune.validate import ResolveError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ResolveError) as raised:
        _planned(tmp_path, "ltx2", [*sets, "model.text_encoder_offload=cpu"])
    text = str(raised.value)
    assert "model.text_encoder_offload" in text and why in text and "docs/caching.md" in text
