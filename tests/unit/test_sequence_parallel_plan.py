"""deepspeed.sequence_parallel_size as `dstune validate` plans it: the world as data-parallel x sequence-parallel,
the batch numbers per data-parallel rank, the refusals (each naming the key and sizes that work), the DeepSpeed JSON,
and the memory plan (activations divided by N, the all-to-all buffers added), on Wan 2.1 T2V 14B from the configs
stored with dstune, on 8 GPUs, planned offline; then the loader keyed by the data-parallel rank and the batch check
of sequence groups. The training itself is tests/dist/test_sequence_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstune.cli import main

REPO = Path(__file__).resolve().parents[2]
WAN14B = str(REPO / "launch" / "wan21-t2v-14b-lora-zero3-8gpu.yaml")  # 81 frames of 480 x 480: 18,900 tokens


def validate_json(capsys, size: int, *sets: str, spec: str = WAN14B, gpus: int = 8) -> tuple[int, dict]:
    code = main(
        [
            "validate",
            spec,
            "--num-gpus",
            str(gpus),
            "--num-samples",
            "2000",
            "--json",
            "--set",
            f"deepspeed.sequence_parallel_size={size}",
            *[a for s in sets for a in ("--set", s)],
        ]
    )
    return code, json.loads(capsys.readouterr().out)


def test_the_batch_counts_data_parallel_ranks_and_deepspeed_agrees(capsys):
    code, out = validate_json(capsys, 4)
    assert code == 0, out["errors"]
    plan = out["plan"]
    assert (plan["world_size"], plan["sequence_parallel_size"], plan["data_parallel_size"]) == (8, 4, 2)
    assert plan["global_batch_size"] == 1 * 1 * 2  # micro x accumulation x data-parallel ranks
    assert plan["steps_per_epoch"] == 2000 // 2
    ds = out["ds_config"]  # DeepSpeed's own config code agreed on these for 8 ranks (validate's cross-check)
    assert (ds["sequence_parallel_size"], ds["train_batch_size"]) == (4, 2)


def test_memory_divides_activations_by_n_and_adds_the_all_to_all_buffers(capsys):
    _, one = validate_json(capsys, 1)
    _, four = validate_json(capsys, 4)
    acts_one, acts_four = (m["memory"]["per_gpu"]["activations_bytes"] for m in (one, four))
    assert acts_four == pytest.approx(acts_one / 4, rel=1e-6)
    assert "sequence_parallel" not in one["memory"] and "sequence_parallel_size" not in one["plan"]  # N = 1: as before
    # 40 heads x 128 wide, 18,900 tokens / 4 per rank, bf16: q, k, v and the output, each sent and received
    assert four["memory"]["sequence_parallel"]["all_to_all_bytes"] == 2 * 4 * (18900 // 4) * 40 * 128 * 2
    buffers_one, buffers_four = (m["memory"]["per_gpu"]["buffers_bytes"] for m in (one, four))
    assert buffers_four - buffers_one == four["memory"]["sequence_parallel"]["all_to_all_bytes"]
    assert "ds_config" not in one or "sequence_parallel_size" not in one["ds_config"]  # N = 1: the JSON unchanged


def test_validate_prints_both_degrees_and_the_tokens_per_rank(capsys):
    assert (
        main(
            [
                "validate",
                WAN14B,
                "--num-gpus",
                "8",
                "--num-samples",
                "2000",
                "--set",
                "deepspeed.sequence_parallel_size=2",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "8 = 4 data-parallel x 2 sequence-parallel" in text
    assert "4 data-parallel x 2 sequence-parallel (8 ranks)" in text
    assert "18900 tokens per sample -> 9450 per rank" in text
    assert "valid: 4 ranks (data-parallel; x 2 sequence-parallel)" in text


REFUSALS = [
    # (N, GPUs, --set, what the one error says)
    (3, 8, (), ["does not divide the 8 ranks", "use one of 1, 2, 4, 8"]),
    (16, 16, (), ["does not divide the transformer's 40 attention heads", "use one of 1, 2, 4, 5, 8, 10, 20, 40"]),
    (
        8,
        8,
        (),
        [
            "does not divide the tokens per sample of 2 bucket(s) (81f 480x480: 18900, samples (81f 480x480): 18900",
            "Sizes that keep every rule on 8 rank(s): 1, 2, 4.",
        ],
    ),
    (
        2,
        8,
        ("deepspeed.zero_stage=0",),
        ["it needs ZeRO (deepspeed.zero_stage 1, 2 or 3)", "Sizes that keep every rule on 8 rank(s): 1."],
    ),
]


@pytest.mark.parametrize("size, gpus, sets, says", REFUSALS, ids=["world", "heads", "tokens", "zero0"])
def test_a_size_that_does_not_divide_is_refused_naming_the_key_and_sizes_that_work(capsys, size, gpus, sets, says):
    code, out = validate_json(capsys, size, *sets, gpus=gpus)
    assert code == 1
    errors = [e for e in out["errors"] if "sequence_parallel_size" in e]
    assert len(errors) == 1 and all(part in errors[0] for part in says), out["errors"]


def test_a_family_without_the_split_is_refused_with_the_reason(capsys):
    code, out = validate_json(capsys, 2, spec=str(REPO / "launch" / "sd15-zero2.yaml"))
    assert code == 1
    assert any(
        "deepspeed.sequence_parallel_size" in e and "model.family sd has no sequence-parallel attention" in e
        for e in out["errors"]
    ), out["errors"]


def test_the_users_deepspeed_file_cannot_set_another_size(tmp_path, capsys):
    (tmp_path / "ds.json").write_text(json.dumps({"sequence_parallel_size": 4}))
    code, out = validate_json(capsys, 2, f"deepspeed.config={tmp_path / 'ds.json'}")
    assert code == 1
    assert any("sequence_parallel_size" in e and "deepspeed.sequence_parallel_size 2" in e for e in out["errors"])


# ---------------------------------------------------------------------------- the loader and the batch check


class _World:
    world_size, num_nodes, ranks_per_node = 4, 1, (4,)


def _plan(size: int):
    from dstune.plan import make_plan
    from dstune.spec.load import SpecSource
    from dstune.spec.models import TrainSpec

    return make_plan(TrainSpec(micro_batch_size=2, max_steps=3), _World(), 24, SpecSource("spec.yaml"), None, size)


def _reports(plan, rank_of_loader):
    """Every rank's RankReport as training builds it, its loader keyed by rank_of_loader(global rank)."""
    from dstune.batch_check import RankReport, sample_report
    from dstune.data.sampler import GlobalBatchSampler
    from dstune.distributed import Run
    from dstune.world import World

    world = World(4, 1, (4,), ("h",), "test")
    reports = []
    for rank in range(4):
        run = Run(rank, rank, world, "cpu", "cpu", 0, True, sequence_parallel_size=plan.sequence_parallel_size)
        sampler = GlobalBatchSampler(24, plan, rank_of_loader(run), seed=0)
        reports.append(
            RankReport(
                rank=rank,
                host="h",
                ds_micro_batch=2,
                ds_accumulation=1,
                ds_global_batch=4,
                ds_data_parallel=2,
                ds_sequence_parallel=2,
                loader_micro_batches=6,
                first_batch_size=2,
                num_samples=24,
                **sample_report(run, sampler),
            )
        )
    return reports


def test_the_ranks_of_a_sequence_group_share_samples_and_the_groups_do_not():
    """4 ranks as 2 data-parallel x 2 sequence-parallel: the loader keyed by the data-parallel rank gives ranks 0, 1
    one half of each global batch and ranks 2, 3 the other; the checker passes that, and names a loader keyed by the
    global rank (each rank its own samples) and one that gives every group the same samples."""
    from dstune.batch_check import expected_from_plan, find_mismatches

    plan = _plan(2)
    assert (plan.data_parallel_size, plan.global_batch_size, plan.steps_per_epoch) == (2, 4, 6)
    expected = expected_from_plan(plan)
    good = _reports(plan, lambda run: run.data_parallel_rank)
    assert [r.data_parallel_rank for r in good] == [0, 0, 1, 1]
    assert good[0].first_step_ids == good[1].first_step_ids and not set(good[0].first_step_ids) & set(
        good[2].first_step_ids
    )
    assert find_mismatches(good, expected) == []
    by_sequence_rank = "\n".join(find_mismatches(_reports(plan, lambda run: run.rank % 2), expected))
    assert "sequence group 0 (ranks 0, 1): its ranks receive different samples" in by_sequence_rank
    same_everywhere = "\n".join(find_mismatches(_reports(plan, lambda run: 0), expected))
    assert "sequence groups 0 and 1 both receive samples" in same_everywhere
    wrong_degree = [r.__class__(**{**r.__dict__, "ds_sequence_parallel": 1}) for r in good]
    assert "DeepSpeed sequence-parallel size is 1, the plan says 2" in "\n".join(
        find_mismatches(wrong_degree, expected)
    )


def test_zero3_reduces_over_the_data_parallel_groups_with_a_bucket_for_the_largest_parameter(capsys):
    """DeepSpeed's ZeRO-3 reduce-scatter path averages gradients over every rank; its all-reduce path divides by the
    data-parallel ranks only, as sequence parallelism needs: the JSON turns reduce_scatter off, and the engine's
    bucket holds the largest trainable parameter (a bucket past its size takes the reduce-scatter path)."""
    import torch

    from dstune.engine import sequence_parallel_bucket

    _, out = validate_json(capsys, 2)
    zero = out["ds_config"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_scatter"] is False
    _, data_parallel = validate_json(capsys, 1)
    assert "reduce_scatter" not in data_parallel["ds_config"]["zero_optimization"]
    params = [torch.nn.Parameter(torch.zeros(30, 40)), torch.nn.Parameter(torch.zeros(5))]
    small = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}
    assert sequence_parallel_bucket(small, params)["zero_optimization"]["reduce_bucket_size"] == 1200
    assert sequence_parallel_bucket({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5000}}, params) == {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5000}
    }
    assert sequence_parallel_bucket({"zero_optimization": {"stage": 2, "reduce_bucket_size": 10}}, params) == {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 10}
    }


def test_flux2_and_flux1_split_their_image_and_text(capsys):
    """FLUX.2's and Flux.1's context-parallel plans split the image and the text streams: validate lists both token
    counts per rank, and a text length N does not divide is refused."""
    assert (
        main(
            [
                "validate",
                str(REPO / "launch" / "flux2-klein-lora-zero2-8gpu.yaml"),
                "--num-gpus",
                "8",
                "--num-samples",
                "1000",
                "--set",
                "deepspeed.sequence_parallel_size=4",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "1024x1024             4096 tokens per sample -> 1024 per rank" in text
    assert "text                  512 tokens per sample -> 128 per rank" in text
    code, out = validate_json(
        capsys, 2, "model.max_sequence_length=511", spec=str(REPO / "launch" / "flux2-klein-lora-zero2-8gpu.yaml")
    )
    assert code == 1 and any("text: 511" in e for e in out["errors"]), out["errors"]
    flux = str(REPO / "launch" / "flux-lora-zero3-8gpu.yaml")
    assert (
        main(
            [
                "validate",
                flux,
                "--num-gpus",
                "8",
                "--num-samples",
                "1000",
                "--set",
                "deepspeed.sequence_parallel_size=8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "1024x1024             4096 tokens per sample -> 512 per rank" in text
    assert "text                  512 tokens per sample -> 64 per rank" in text
    code, out = validate_json(capsys, 2, "model.max_sequence_length=255", spec=flux)
    assert code == 1 and any("text: 255" in e for e in out["errors"]), out["errors"]


def test_qwen_image_splits_its_packed_image_and_its_text_and_refuses_a_size_that_breaks_either(capsys):
    """Qwen-Image's plan splits the packed image tokens (2x2 patches of the 8x latent) and the text (padded to
    model.max_sequence_length): N must divide both. The edit model's sequence is its target's and its source's
    tokens; its instruction (with the source's vision tokens) has no fixed length and is padded with masked tokens
    to split, so it sets no rule."""
    qwen = str(REPO / "launch" / "qwen-image-lora-zero3-8gpu.yaml")
    code, out = validate_json(capsys, 4, spec=qwen)
    assert code == 0, out["errors"]
    code, out = validate_json(capsys, 4, "model.max_sequence_length=510", spec=qwen)
    assert code == 1 and any(
        "text: 510" in e
        and "model.max_sequence_length for the text" in e
        and "Sizes that keep every rule on 8 rank(s): 1, 2." in e
        for e in out["errors"]
    )
    code, out = validate_json(capsys, 2, "data.resolution=1008", spec=qwen)  # 63 x 63 patches: 3969 tokens
    assert code == 1 and any("1008x1008: 3969" in e for e in out["errors"]), out["errors"]
    edit = str(REPO / "launch" / "qwen-image-edit-lora-zero3-8gpu.yaml")
    assert (
        main(
            [
                "validate",
                edit,
                "--num-gpus",
                "8",
                "--num-samples",
                "1000",
                "--set",
                "deepspeed.sequence_parallel_size=8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert any(
        line.split()
        == ["1024x1024", "(target", "and", "source)", "8192", "tokens", "per", "sample", "->", "1024", "per", "rank"]
        for line in text.splitlines()
    ), text
    assert "text " not in text[text.index("per data-parallel rank") : text.index("Memory")]
    code, out = validate_json(capsys, 2, "data.resolution=1008", spec=edit)  # 2 x 3969: divides 2, not 4
    assert code == 0, out["errors"]
    code, out = validate_json(capsys, 4, "data.resolution=1008", spec=edit)
    assert code == 1 and any("1008x1008 (target and source): 7938" in e for e in out["errors"]), out["errors"]


# (the model, its family, its transformer class): the classes without a context-parallel plan in diffusers 0.42.1
# (HunyuanVideo 1.5 has none either: dstune gives it one, below)
NO_PLAN = [
    ("builtin:tiny-z-image", "flow", "ZImageTransformer2DModel"),
    ("builtin:tiny-flow", "flow", "SD3Transformer2DModel"),
    ("builtin:tiny-krea2", "flow", "Krea2Transformer2DModel"),
    ("builtin:tiny-ideogram4", "flow", "Ideogram4Transformer2DModel"),
    ("builtin:tiny-qwen-image-21", "flow", "QwenImage21Transformer2DModel"),
    ("Tongyi-MAI/Z-Image", "flow", "ZImageTransformer2DModel"),
]


def _no_plan_spec(tmp_path, pretrained: str, family: str) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model:\n  family: {family}\n  pretrained: {pretrained}\n  train: lora\n"
        f"data:\n  path: builtin:{'moving-shapes' if family == 'wan' else 'shapes'}\n"
        "train:\n  micro_batch_size: 1\n  max_steps: 2\n"
        "deepspeed:\n  zero_stage: 2\n  sequence_parallel_size: 2\noutput:\n  dir: out\n"
    )
    return spec


def _says_no_plan(errors: list[str], transformer_class: str) -> None:
    split = [e for e in errors if "sequence_parallel_size" in e]
    assert len(split) == 1, errors
    assert (
        f"deepspeed.sequence_parallel_size: 2: its transformer class {transformer_class} has no "
        "context-parallel plan (_cp_plan) in the installed diffusers, so its sequence cannot be split. Remove "
        "the key (sequence_parallel_size: 1)"
    ) in split[0]


@pytest.mark.parametrize("pretrained, family, transformer_class", NO_PLAN, ids=[row[0] for row in NO_PLAN])
def test_a_transformer_without_a_context_parallel_plan_is_refused_with_the_reason(
    tmp_path, capsys, pretrained, family, transformer_class
):
    """Offline, from the configs stored with dstune: one error naming the key, the class and the fix."""
    code = main(["validate", str(_no_plan_spec(tmp_path, pretrained, family)), "--num-gpus", "2", "--json"])
    assert code == 1
    _says_no_plan(json.loads(capsys.readouterr().out)["errors"], transformer_class)


def test_the_no_plan_refusal_imports_no_torch(tmp_path):
    """validate's spec errors are torch-free: Z-Image's refusal in a fresh interpreter."""
    import os
    import subprocess
    import sys

    pretrained, family, transformer_class = NO_PLAN[-1]
    probe = (
        "import sys; from dstune.cli import main; code = main(['validate', sys.argv[1], '--num-gpus', '2', "
        "'--json']); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's dstune, whatever the interpreter has installed
    done = subprocess.run(
        [sys.executable, "-c", probe, str(_no_plan_spec(tmp_path, pretrained, family))],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 1, done.stderr
    _says_no_plan(json.loads(done.stdout)["errors"], transformer_class)


def test_the_table_of_context_parallel_classes_is_the_installed_diffusers():
    """validate decides torch-free from a table; the installed diffusers' classes are what the split reads."""
    import diffusers

    from dstune.families.facts import CONTEXT_PARALLEL_CLASSES

    names = {row[2] for row in NO_PLAN} | set(CONTEXT_PARALLEL_CLASSES)
    with_plan = {name for name in names if getattr(getattr(diffusers, name), "_cp_plan", None)}
    assert with_plan == set(CONTEXT_PARALLEL_CLASSES)


def test_hunyuan_video15_splits_by_dstunes_plan_its_clip_tokens_listed(capsys, monkeypatch):
    """HunyuanVideo 1.5's class has no diffusers plan; dstune's (dstune.models.hunyuan_video15.split) splits the clip and
    the context, which it pads to split: validate plans it from the stored 720p configs, lists the clip's tokens per
    rank and checks its 16 heads and the clip's tokens (the context, 1000 + 256 + 729 tokens, sets no rule)."""
    monkeypatch.delenv("COLUMNS", raising=False)  # validate's lines whole, as when it is piped (pytest may set it)
    spec = str(REPO / "launch" / "hunyuan-video15-720p-lora-zero3-8gpu.yaml")
    assert (
        main(
            [
                "validate",
                spec,
                "--num-gpus",
                "8",
                "--num-samples",
                "2000",
                "--set",
                "data.resolution=768",
                "--set",
                "deepspeed.sequence_parallel_size=8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out  # 31 latent frames x 48 x 48 (16x VAE, 1x1 patches)
    assert "121f 768x768            71424 tokens per sample -> 8928 per rank" in text
    assert "attention all-to-all buffers" in text
    code, out = validate_json(capsys, 2, spec=spec)  # the launch spec's 720 x 720: 31 x 45 x 45 = 62775, odd
    assert code == 1 and any("121f 720x720: 62775" in e for e in out["errors"]), out["errors"]
    code, out = validate_json(capsys, 32, "data.resolution=768", spec=spec, gpus=32)
    assert code == 1 and any("does not divide the transformer's 16 attention heads" in e for e in out["errors"])


def test_zero3_memory_counts_the_reduce_bucket_raised_to_the_largest_trainable_parameter(capsys, monkeypatch):
    """Under ZeRO-3 with sequence parallelism the engine raises reduce_bucket_size to the largest trainable parameter
    (test_zero3_reduces_over_the_data_parallel_groups_...): the memory plan counts that bucket, in the module's
    precision (bf16: 2 bytes, fp32: 4). Wan 2.2 A14B's low-noise expert in full: its time projection (5120 x 30720
    and its bias) is 3.1 x the JSON's 5e7 elements. Not raised at N = 1, under ZeRO 2, nor for LoRA's adapters."""
    monkeypatch.delenv("COLUMNS", raising=False)  # validate's lines whole, as when it is piped (pytest may set it)
    a14b = str(REPO / "launch" / "wan22-a14b-low-noise-full-zero3-2x8gpu.yaml")

    def memory(size: int, *sets: str) -> dict:
        code, out = validate_json(capsys, size, *sets, spec=a14b, gpus=16)
        assert code == 0, out["errors"]
        assert out["ds_config"]["zero_optimization"]["reduce_bucket_size"] == 50_000_000  # the JSON's, unraised
        return out["memory"]

    largest = 5120 * 30720 + 30720
    for precision, element_bytes in (("bf16", 2), ("fp32", 4)):
        one, two = memory(1, f"train.precision={precision}"), memory(2, f"train.precision={precision}")
        assert two["parameters"]["largest_layer_params"] == largest
        split = two["sequence_parallel"]
        assert (split["reduce_bucket_elements"], split["reduce_bucket_raised"]) == (largest, True)
        # no overlap_comm: one bucket, and the copy of its contents the reduce-scatter makes (dstune.memory.plan)
        raised = 2 * (largest - 50_000_000) * element_bytes
        buffers = [m["per_gpu"]["buffers_bytes"] for m in (one, two)]
        assert buffers[1] - split["all_to_all_bytes"] - buffers[0] == raised
    zero2 = memory(2, "deepspeed.zero_stage=2")["sequence_parallel"]
    lora = memory(2, "model.train=lora")["sequence_parallel"]
    assert not zero2["reduce_bucket_raised"] and not lora["reduce_bucket_raised"]
    assert (
        main(
            [
                "validate",
                a14b,
                "--num-gpus",
                "16",
                "--num-samples",
                "2000",
                "--set",
                "deepspeed.sequence_parallel_size=2",
            ]
        )
        == 0
    )
    assert (
        f"the reduce bucket raised to the largest trainable parameter, {largest:,} elements" in capsys.readouterr().out
    )
