"""Sequence parallelism (deepspeed.sequence_parallel_size) trains the same maths as one rank: builtin:tiny-wan with
size 2 on 2 ranks (one sequence group: each rank holds half of every clip's tokens between the attention
all-to-alls) against 1 rank with size 1 on the same global batch, for

- full fine-tuning under ZeRO 2, from the latent and text caches, rendering samples (split too);
- LoRA under ZeRO 3 with gradient checkpointing (the recomputed forward repeats the all-to-alls);
- the ZeRO 2 run resumed from its step-2 checkpoint on 1 rank with size 1 (the checkpoint re-partitioned for the
  other world) continues the same trajectory;
- builtin:tiny-flux2 (FLUX.2, an image model whose plan splits the image and the text streams) full under ZeRO 2,
  with its held-out loss (data.eval: a sequence group computes each batch together);
- builtin:tiny-flux2 LoRA under ZeRO 3 with gradient checkpointing;
- builtin:tiny-qwen-image (Qwen-Image: its plan splits the packed image, the text and the text mask) full under
  ZeRO 2, rendering a sample whose prompt and negative prompt have odd token counts (padded, masked, to split);
- builtin:tiny-wan-i2v (Wan 2.1 image-to-video: condition latents and CLIP image tokens) full under ZeRO 2;
- builtin:tiny-wan-a14b (Wan 2.2 two-expert layout): its low-noise expert full under ZeRO 2;
- builtin:tiny-wan22-ti2v (Wan 2.2 TI2V: per-token timesteps, the first frame's at 0, split with the tokens) LoRA
  under ZeRO 3 with gradient checkpointing;
- builtin:tiny-flux (Flux.1) and builtin:tiny-qwen-image-edit (its source's tokens beside the target's, an
  instruction of any length padded to split) full under ZeRO 2, rendering samples;
- builtin:tiny-hunyuan-video15 (HunyuanVideo 1.5, split by dstune's plan: dstune.models.hunyuan_video15.split) LoRA
  under ZeRO 3 with gradient checkpointing, rendering samples;
- builtin:tiny-ltx2 (LTX-2 audio+video on builtin:moving-shapes-av, split by dstune's plan: dstune.models.ltx2.split;
  the caption and the sound stream whole on every rank, the sound's attention to the video gathering the video with
  a gradient summed over the group, the sound loss's gradient divided by the split) LoRA under ZeRO 3 with gradient
  checkpointing, rendering samples (the pipeline runs its joint audio and video, split too) whose frames are the
  1-rank run's;
- builtin:tiny-kandinsky6 (Kandinsky 6 image-to-video with sound on builtin:moving-shapes-av, split by dstune's plan:
  dstune.models.kandinsky6.split; the text branches and the sound stream whole on every rank, the sound's attention
  to the video gathering the video with a gradient summed over the group, the outputs' gradients divided by the
  split) LoRA on every attention under ZeRO 3 with gradient checkpointing, 2 steps, rendering a sample with its
  sound from a first frame (the pipeline's joint video and sound, split too) whose frames and sound are the 1-rank
  run's;
- builtin:tiny-minimax-h3 (MiniMax-H3: one packed sequence of text, sound and video rows, split by its class's plan
  after dstune pads it with masked rows to an even length: dstune.models.minimax_h3.split) LoRA under ZeRO 3 with
  gradient checkpointing on builtin:moving-shapes-av's clips with sound, rendering a sample with its sound;
- 4 ranks as 2 data-parallel x 2 sequence-parallel against 2 data-parallel ranks, ZeRO 2 full: two groups that
  receive different samples, each splitting its own.

Per-step losses, gradient norms and the exported weights agree within 1e-5 relative. One table of runs, LAUNCHES, serves every
check: the 2-rank size-2 runs and their 1-rank references, a 4-rank run and its 2-rank reference, and the 1-rank
resume. The runs of one world train one after another in one launch (tests/dist/scripts/train_runs.py): the 2-rank
size-2 runs, then the 1-rank ones with the resume, the 4-rank and the 2-rank size-1 run; a launch starts when a test
first needs one of its runs, with the runs that this session's tests need.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flow_runs import STEPS, TRANSFORMER, flow_spec, write_pairs
import shutil

from harness import CACHE_DIR, base_spec, explain, launch, metrics, write_spec
from video_runs import first_frame

pytestmark = pytest.mark.dist

MODEL = "tiny-wan"  # 2 attention heads; builtin:moving-shapes clips are 5 frames of 32 px: 2 x 2 x 2 = 8 tokens
LORA_FILE = Path("pytorch_lora_weights.safetensors")
TRANSFORMER_2 = Path("transformer_2") / TRANSFORMER.name  # the two-expert export's trained low-noise expert

IMAGE_MODEL = "tiny-flux2"  # 2 heads; 32 px images are 4 tokens, the text 512 (padded to max_sequence_length)
I2V_MODEL = "tiny-wan-i2v"  # Wan 2.1 image-to-video: condition latents beside the clip's, CLIP image tokens
TWO_EXPERTS = "tiny-wan-a14b"  # Wan 2.2 A14B layout: the low-noise expert (transformer_2) trains, below the boundary
HV15_MODEL = "tiny-hunyuan-video15"  # HunyuanVideo 1.5: dstune's plan (hunyuan15_split), its context padded to split
TI2V_MODEL = "tiny-wan22-ti2v"  # Wan 2.2 TI2V: the first frame's tokens at timestep 0, per-token timesteps split
QWEN_MODEL = "tiny-qwen-image"  # 2 heads; its 2x VAE makes a 32 px image 64 tokens, the text 512 (padded, masked)
FLUX1_MODEL = "tiny-flux"  # Flux.1: 2 heads; its 2x VAE makes a 32 px image 64 tokens, the T5 text 512
LTX2_MODEL = "tiny-ltx2"  # 2 video heads; its 8x VAE (4x in time) makes a 5-frame 32 px clip 2 x 4 x 4 = 32 tokens
LTX2_KEYS = {"max_sequence_length": 32, "timestep_sampling": "shifted_logit_normal"}  # as tests/dist/test_wan.py's
EDIT_MODEL = "tiny-qwen-image-edit"  # 8x VAE: a 64 px target 16 tokens and its source 16 more; the text any length
K6_MODEL = "tiny-kandinsky6"  # 2 video heads; a 5-frame 32 px clip 2 x 2 x 2 tokens, with its first frame appended 12
K6_KEYS = {"max_sequence_length": 560, "timestep_sampling": "uniform", "image_to_video": True,  # as test_kandinsky6's
           "lora": {"rank": 4, "target_modules": ["to_query", "to_key", "to_value", "attn.out_layer",
                                                  "self_attention.out_layer", "cross_attention.out_layer",
                                                  "va_cross_attention.out_layer", "av_cross_attention.out_layer"]}}
STEPS_OF = {K6_MODEL: 2}  # a model's steps where not STEPS
H3_MODEL = "tiny-minimax-h3"  # 2 heads; a 22-frame 32 px clip packs 16 text + 74 sound + 7 video rows: 97, padded
H3_KEYS = {"max_sequence_length": 16, "sample_frames": 124}  # as tests/dist/test_minimax_h3.py's
H3_DATA = {"resolution": 32, "video": {"frames": 22}}  # 17k+5 frames at its 24 fps

# SGD (its update is linear in the gradient) for the LoRA runs and these full ones. Adam's first updates normalise
# each element, so an element whose gradient is near zero turns summation-order differences of 1e-7 into a visible
# difference of its weight: a LoRA A element just after B leaves zero, and in these models' full runs 1 weight of
# thousands (the two-expert's cross-attention key: 1 of 576; Flux.1's and Qwen-Image-Edit's timestep embedder: 1 of
# 8192) ended 2e-5 to 4e-5 of its tensor's largest apart, while losses and gradient norms agreed within 1e-6 (Wan 2.1
# I2V's timestep embedder too, 2.4e-5, once its image embedding was read).
SGD = {"type": "sgd", "lr": 0.5, "momentum": 0.9}
RUNS_SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_runs.py"
# the video runs that render samples
SAMPLED = {(MODEL, "full"), (HV15_MODEL, "lora"), (LTX2_MODEL, "lora"), (K6_MODEL, "lora"), (H3_MODEL, "lora")}
SGD_FULL = (TWO_EXPERTS, FLUX1_MODEL, EDIT_MODEL, I2V_MODEL)

# name -> (ranks, sequence_parallel_size, zero stage, train, model); each 2-rank case has its 1-rank reference
LAUNCHES = {
    "zero2-full-sp2": (2, 2, 2, "full", MODEL),
    "zero2-full-ref": (1, 1, 2, "full", MODEL),
    "zero3-lora-sp2": (2, 2, 3, "lora", MODEL),
    "zero3-lora-ref": (1, 1, 3, "lora", MODEL),
    "flux2-zero2-full-sp2": (2, 2, 2, "full", IMAGE_MODEL),
    "flux2-zero2-full-ref": (1, 1, 2, "full", IMAGE_MODEL),
    "flux2-zero3-lora-sp2": (2, 2, 3, "lora", IMAGE_MODEL),  # gradient checkpointing on (flow_spec's LoRA runs)
    "flux2-zero3-lora-ref": (1, 1, 3, "lora", IMAGE_MODEL),
    "qwen-zero2-full-sp2": (2, 2, 2, "full", QWEN_MODEL),
    "qwen-zero2-full-ref": (1, 1, 2, "full", QWEN_MODEL),
    "i2v-zero2-full-sp2": (2, 2, 2, "full", I2V_MODEL),
    "i2v-zero2-full-ref": (1, 1, 2, "full", I2V_MODEL),
    "flux1-zero2-full-sp2": (2, 2, 2, "full", FLUX1_MODEL),
    "flux1-zero2-full-ref": (1, 1, 2, "full", FLUX1_MODEL),
    "edit-zero2-full-sp2": (2, 2, 2, "full", EDIT_MODEL),
    "edit-zero2-full-ref": (1, 1, 2, "full", EDIT_MODEL),
    "a14b-zero2-full-sp2": (2, 2, 2, "full", TWO_EXPERTS),
    "a14b-zero2-full-ref": (1, 1, 2, "full", TWO_EXPERTS),
    "ti2v-zero3-lora-sp2": (2, 2, 3, "lora", TI2V_MODEL),  # gradient checkpointing on (the wan LoRA runs)
    "ti2v-zero3-lora-ref": (1, 1, 3, "lora", TI2V_MODEL),
    "hv15-zero3-lora-sp2": (2, 2, 3, "lora", HV15_MODEL),  # gradient checkpointing on
    "hv15-zero3-lora-ref": (1, 1, 3, "lora", HV15_MODEL),
    "ltx2-zero3-lora-sp2": (2, 2, 3, "lora", LTX2_MODEL),  # gradient checkpointing on
    "ltx2-zero3-lora-ref": (1, 1, 3, "lora", LTX2_MODEL),
    "k6-zero3-lora-sp2": (2, 2, 3, "lora", K6_MODEL),  # gradient checkpointing on, image-to-video
    "k6-zero3-lora-ref": (1, 1, 3, "lora", K6_MODEL),
    "h3-zero3-lora-sp2": (2, 2, 3, "lora", H3_MODEL),  # gradient checkpointing on
    "h3-zero3-lora-ref": (1, 1, 3, "lora", H3_MODEL),
    "4-ranks-2x2": (4, 2, 2, "full", MODEL),  # 2 data-parallel x 2 sequence-parallel, micro 1 per group
    "2-ranks-2x1": (2, 1, 2, "full", MODEL),  # 2 data-parallel ranks, micro 1 each
}
PAIRS = [("zero2-full-sp2", "zero2-full-ref", TRANSFORMER), ("zero3-lora-sp2", "zero3-lora-ref", LORA_FILE),
         ("flux2-zero2-full-sp2", "flux2-zero2-full-ref", TRANSFORMER), ("4-ranks-2x2", "2-ranks-2x1", TRANSFORMER),
         ("qwen-zero2-full-sp2", "qwen-zero2-full-ref", TRANSFORMER),
         ("flux2-zero3-lora-sp2", "flux2-zero3-lora-ref", LORA_FILE),
         ("i2v-zero2-full-sp2", "i2v-zero2-full-ref", TRANSFORMER),
         ("flux1-zero2-full-sp2", "flux1-zero2-full-ref", TRANSFORMER),
         ("edit-zero2-full-sp2", "edit-zero2-full-ref", TRANSFORMER),
         ("a14b-zero2-full-sp2", "a14b-zero2-full-ref", TRANSFORMER_2),
         ("ti2v-zero3-lora-sp2", "ti2v-zero3-lora-ref", LORA_FILE),
         ("hv15-zero3-lora-sp2", "hv15-zero3-lora-ref", LORA_FILE),
         ("ltx2-zero3-lora-sp2", "ltx2-zero3-lora-ref", LORA_FILE),
         ("k6-zero3-lora-sp2", "k6-zero3-lora-ref", LORA_FILE),
         ("h3-zero3-lora-sp2", "h3-zero3-lora-ref", LORA_FILE)]


def _steps(name: str) -> int:
    return STEPS_OF.get(LAUNCHES[name][4], STEPS)


def _spec(run_dir: Path, ranks: int, size: int, stage: int, train: str, model: str = MODEL) -> dict:
    micro = 2 // (ranks // size)  # the same global batch of 2 on every world
    if model in (IMAGE_MODEL, QWEN_MODEL, FLUX1_MODEL, EDIT_MODEL):  # the flow image runs' spec (caches, samples)
        spec = flow_spec(run_dir, model, stage, train)
        spec["train"].update(global_batch_size=2, micro_batch_size=micro)
        spec["deepspeed"]["sequence_parallel_size"] = size
        spec["output"].update(save_every_steps=None)
        if train == "lora" or model in SGD_FULL:
            spec["train"]["optimizer"] = SGD
        if model == IMAGE_MODEL and train == "full":
            spec["data"]["eval"] = {"fraction": 0.2, "every_steps": 2}  # the held-out loss, split too
        elif model == QWEN_MODEL:  # the pipeline's own prompt encoding: 141 tokens, its true-CFG negative 129,
            spec["sample"].update(prompts=["a red circles"], guidance=2.0)  # both split unevenly
        elif model == EDIT_MODEL:  # pairs; the instruction's length depends on the source's vision tokens
            write_pairs(run_dir.parent / "pairs")
            spec["data"].update(path=str(run_dir.parent / "pairs" / "target"), control_dir="../control",
                                resolution=64)
            spec["data"]["cache"]["text_embeddings"] = False  # an edit embedding belongs to a (caption, image) pair
            spec["sample"].update(prompts=["turn it into a red circle"],
                                  control_images=[str(run_dir.parent / "pairs" / "control" / "005.png")])
        return spec
    lora = train == "lora"
    cache = {"latents": not lora, "text_embeddings": True, "dir": str(run_dir.parent / "cache")}
    layout = {TWO_EXPERTS: {"expert": "low_noise"}, TI2V_MODEL: {"image_to_video": True},
              LTX2_MODEL: LTX2_KEYS, K6_MODEL: K6_KEYS, H3_MODEL: H3_KEYS}.get(model, {})
    sampled = (model, train) in SAMPLED
    first_frames = [str(first_frame(run_dir.parent / "images"))] if model == K6_MODEL and sampled else []
    return base_spec(
        run_dir,
        model={"family": "video", "pretrained": f"builtin:{model}", "train": train, "gradient_checkpointing": lora,
               **layout},
        data={"path": "builtin:moving-shapes-av" if model in (LTX2_MODEL, K6_MODEL, H3_MODEL) else "builtin:moving-shapes",
              "cache": cache, **(H3_DATA if model == H3_MODEL else {})},
        train={"global_batch_size": 2, "micro_batch_size": micro, "gradient_accumulation_steps": None,
               "max_steps": STEPS_OF.get(model, STEPS),
               "optimizer": SGD if lora or model in SGD_FULL else {"type": "adamw", "lr": 2e-4}},
        deepspeed={"zero_stage": stage, "sequence_parallel_size": size},
        output={"export": "diffusers", "save_every_steps": 2, "keep_last": 5},
        sample={"prompts": ["a red circle moving left"] if sampled else [], "steps": 2, "guidance": 1.0,
                "control_images": first_frames},
    )


class RunOutput:
    """One run's share of a launch that trained several (tests/dist/scripts/train_runs.py): its exit and what the
    launch printed from its start to the next run's (the run's own lines; rank 1's interleave)."""

    def __init__(self, launched: subprocess.CompletedProcess, spec_path: Path, ran: bool):
        marker = f"=== settings matrix run: {spec_path}"
        text = launched.stdout
        begin = text.find(marker)
        end = text.find("=== settings matrix run: ", begin + len(marker)) if begin >= 0 else -1
        self.stdout = text[begin : end if end >= 0 else len(text)] if begin >= 0 else text
        self.stderr = launched.stderr
        finished = begin >= 0 and "=== settings matrix run took" in self.stdout
        self.returncode = 0 if ran and finished and (end >= 0 or launched.returncode == 0) else launched.returncode or 1


class Runs:
    """name -> (run folder, its output) of LAUNCHES (and "resumed"). The runs of one world (ranks, sequence-parallel
    size) train in one launch of tests/dist/scripts/train_runs.py, launched when a test first asks for one of them;
    only the runs this session's tests ask for (`-k`) are in it. The 1-rank launch, which holds "resumed", follows
    the 2-rank size-2 one whose checkpoint it resumes."""

    def __init__(self, tmp_path_factory, needed: set[str]):
        self.tmp_path_factory, self.needed, self.done = tmp_path_factory, needed, {}

    def __getitem__(self, name: str):
        if name not in self.done:
            self._launch_world(LAUNCHES[name][:2] if name != "resumed" else (1, 1))
        return self.done[name]

    def _launch_world(self, world: tuple[int, int]):
        names = [n for n, case in LAUNCHES.items() if case[:2] == world and n in self.needed]
        lines = []
        for name in names:
            ranks, size, stage, train, model = LAUNCHES[name]
            run_dir = self.tmp_path_factory.mktemp(name) / "run"
            spec_path = write_spec(run_dir.parent / "spec.yaml", _spec(run_dir, ranks, size, stage, train, model))
            lines.append((name, run_dir, spec_path, str(spec_path)))
        if world == (1, 1) and "resumed" in self.needed:
            lines.append(self._resume_line())
        runs_file = self.tmp_path_factory.mktemp("runs") / "runs.txt"
        runs_file.write_text("\n".join(line for *_, line in lines) + "\n")
        launched = launch(runs_file, num_ranks=world[0], script=RUNS_SCRIPT)
        for name, run_dir, spec_path, _ in lines:
            self.done[name] = (run_dir, RunOutput(launched, spec_path, ran=True))

    def _resume_line(self):
        """The ZeRO 2 wan run's step-2 checkpoint, resumed on 1 rank at size 1."""
        run_dir, proc = self["zero2-full-sp2"]
        assert proc.returncode == 0, explain(proc)
        resumed = run_dir.parent / "resumed"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
        (resumed / "checkpoints" / "latest").write_text("step-00000002")
        spec_path = run_dir.parent / "spec.yaml"
        flags = f"--resume latest --set output.dir={resumed} --set deepspeed.sequence_parallel_size=1"
        return "resumed", resumed, spec_path, f"{spec_path} {flags}"


def _needed(session) -> set[str]:
    """The LAUNCHES names (and "resumed") this session's tests of this module ask for."""
    needed = set()
    for item in session.items:
        if getattr(item, "module", None) is None or item.module.__name__ != __name__:
            continue
        if hasattr(item, "callspec"):
            needed |= {value for value in item.callspec.params.values() if isinstance(value, str) and value in LAUNCHES}
        needed |= set(NAMED_RUNS.get(item.originalname, ()))
    return needed


# the runs of the tests without parameters
NAMED_RUNS = {
    "test_ltx2_samples_rendered_split_are_the_unsplit_ones": ("ltx2-zero3-lora-sp2", "ltx2-zero3-lora-ref"),
    "test_a_size_2_checkpoint_resumed_at_size_1_on_one_rank_continues_the_trajectory": ("zero2-full-sp2", "resumed"),
    "test_the_held_out_loss_of_a_sequence_group_is_one_ranks": ("flux2-zero2-full-sp2", "flux2-zero2-full-ref"),
    "test_kandinsky6_samples_rendered_split_are_the_unsplit_ones_with_their_sound": (
        "k6-zero3-lora-sp2",
        "k6-zero3-lora-ref",
    ),
    "test_h3_samples_rendered_split_have_sound_and_are_the_unsplit_ones": ("h3-zero3-lora-sp2", "h3-zero3-lora-ref"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Runs:
    from dstune.builtin import ensure_builtin_model

    for model in (MODEL, IMAGE_MODEL, QWEN_MODEL, I2V_MODEL, TWO_EXPERTS, TI2V_MODEL, FLUX1_MODEL, EDIT_MODEL,
                  HV15_MODEL, LTX2_MODEL, K6_MODEL, H3_MODEL):
        ensure_builtin_model(model, CACHE_DIR)  # built once here, not by the launches' rank 0
    return Runs(tmp_path_factory, _needed(request.session))


@pytest.mark.parametrize("name", [name for name, case in LAUNCHES.items() if case[1] > 1])
def test_the_batch_check_sees_the_sequence_groups(runs, name):
    ranks, size = LAUNCHES[name][:2]
    run_dir, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout
    table = proc.stdout[proc.stdout.index("batch check passed"):]
    assert f"sequence-parallel     {size}" in table and f"data-parallel         {ranks // size}" in table
    assert f"{ranks // size} data-parallel x {size} sequence-parallel" in proc.stdout  # validate's plan (rank 0)


@pytest.mark.parametrize("split, whole, exported", PAIRS, ids=[pair[0] for pair in PAIRS])
def test_two_ranks_of_one_sequence_group_train_what_one_rank_trains(runs, split, whole, exported):
    (split_dir, split_proc), (whole_dir, whole_proc) = runs[split], runs[whole]
    assert split_proc.returncode == 0, explain(split_proc)
    assert whole_proc.returncode == 0, explain(whole_proc)
    split_losses, whole_losses = ([m["loss"] for m in metrics(d)] for d in (split_dir, whole_dir))
    steps = _steps(split)
    assert len(split_losses) == steps
    assert split_losses == pytest.approx(whole_losses, rel=1e-5)
    # the gradient itself (Adam's update hides its scale; a group that averaged instead of summing would halve it)
    assert [m["grad_norm"] for m in metrics(split_dir)] == pytest.approx([m["grad_norm"] for m in metrics(whole_dir)],
                                                                         rel=1e-5)
    a = load_file(split_dir / "export" / f"step-{steps:08d}" / exported)
    b = load_file(whole_dir / "export" / f"step-{steps:08d}" / exported)
    assert set(a) == set(b)
    for key in b:
        scale = b[key].abs().max().item() or 1.0
        assert (a[key] - b[key]).abs().max().item() <= 1e-5 * scale, key


@pytest.mark.parametrize("name", ["zero2-full-sp2", "qwen-zero2-full-sp2", "flux1-zero2-full-sp2",
                                  "edit-zero2-full-sp2", "hv15-zero3-lora-sp2", "ltx2-zero3-lora-sp2",
                                  "k6-zero3-lora-sp2"])
def test_samples_render_split(runs, name):
    """Wan's clip; Qwen-Image's prompt and negative prompt, whose odd token counts are padded (masked) to split;
    Flux.1's; Qwen-Image-Edit's from a source image (its tokens beside the target's, the instruction padded);
    HunyuanVideo 1.5's clip (its context padded to split) with the LoRA; LTX-2's clip, with the audio the pipeline
    runs beside it (whole on every rank, its attention to the video gathering the video's keys); Kandinsky 6's from a
    first frame, saved with the sound its pipeline rendered beside the clip."""
    run_dir, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    steps = _steps(name)
    assert list((run_dir / "samples").glob(f"step-{steps:06d}.*"))  # an animated image of the frames, or a grid
    assert torch.isfinite(torch.tensor([m["loss"] for m in metrics(run_dir)])).all()
    if LAUNCHES[name][4] == K6_MODEL:
        import av

        with av.open(str(run_dir / "samples" / f"step-{steps:06d}" / "0.mp4")) as sample:
            assert sample.streams.video and sample.streams.audio and sample.streams.audio[0].frames > 0


def test_ltx2_samples_rendered_split_are_the_unsplit_ones(runs):
    """LTX-2's samples run the pipeline's joint audio and video (its audio attends to every video token, the video
    to the audio), split: the frames of the 2-rank run are the 1-rank run's (the same step, seeds and weights)."""
    import numpy as np
    from PIL import Image, ImageSequence

    def frames(run_dir):
        with Image.open(run_dir / "samples" / f"step-{STEPS:06d}.webp") as image:
            return torch.stack([torch.from_numpy(np.array(f.convert("RGB"))).float()
                                for f in ImageSequence.Iterator(image)])

    (split_dir, split_proc), (whole_dir, whole_proc) = runs["ltx2-zero3-lora-sp2"], runs["ltx2-zero3-lora-ref"]
    assert split_proc.returncode == 0 and whole_proc.returncode == 0, explain(split_proc) + explain(whole_proc)
    split, whole = frames(split_dir), frames(whole_dir)
    assert split.shape == whole.shape and len(split) > 1 and whole.std() > 1  # frames with something in them
    assert (split - whole).abs().max().item() <= 2  # of 255: the weights agree within 1e-5, not bit for bit


def test_kandinsky6_samples_rendered_split_are_the_unsplit_ones_with_their_sound(runs):
    """Kandinsky 6's sample (image-to-video from a first frame) runs the pipeline's fused video and sound, split: the
    2-rank run's frames and sound are the 1-rank run's (the same step, seeds and weights)."""
    import av
    import numpy as np
    from PIL import Image, ImageSequence

    def rendered(run_dir):
        step = run_dir / "samples" / f"step-{_steps('k6-zero3-lora-sp2'):06d}"
        with Image.open(step.with_suffix(".webp")) as image:
            frames = torch.stack([torch.from_numpy(np.array(f.convert("RGB"))).float()
                                  for f in ImageSequence.Iterator(image)])
        with av.open(str(step / "0.mp4")) as clip:
            sound = np.concatenate([f.to_ndarray().reshape(-1) for f in clip.decode(audio=0)])
        return frames, torch.from_numpy(sound).float()

    (split_dir, split_proc), (whole_dir, whole_proc) = runs["k6-zero3-lora-sp2"], runs["k6-zero3-lora-ref"]
    assert split_proc.returncode == 0 and whole_proc.returncode == 0, explain(split_proc) + explain(whole_proc)
    (split, split_sound), (whole, whole_sound) = rendered(split_dir), rendered(whole_dir)
    assert split.shape == whole.shape and len(split) > 1 and whole.std() > 1  # frames with something in them
    assert (split - whole).abs().max().item() <= 2  # of 255: the weights agree within 1e-5, not bit for bit
    assert split_sound.shape == whole_sound.shape and whole_sound.abs().max() > 0
    assert (split_sound - whole_sound).abs().max().item() <= 1e-2 * whole_sound.abs().max().item()


def test_h3_samples_rendered_split_have_sound_and_are_the_unsplit_ones(runs):
    """MiniMax-H3's sample (124 frames with stereo sound, its packed sequence of 16 text + 414 sound + 37 video rows
    padded to split) renders through its modular pipeline on both ranks of the group: its frames (the lossless
    WebP) are the 1-rank run's, and its MP4 carries the same stereo sound. The sound is compared through the MP4's
    AAC track, the only place it is written: a lossy codec whose rate control carries a difference of 1e-6 in its
    input into the quantisation of every later frame (as libx264 does to the MP4's frames), so the sound is held to
    the codec's noise (a 2-rank split that broke the sound rows gives another sound altogether)."""
    import av
    import numpy as np
    from PIL import Image, ImageSequence

    def decoded(run_dir):
        with Image.open(run_dir / "samples" / f"step-{STEPS:06d}.webp") as image:
            frames = np.stack([np.array(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)])
        with av.open(str(run_dir / "samples" / f"step-{STEPS:06d}" / "0.mp4")) as sample:
            assert sample.streams.video[0].frames == H3_KEYS["sample_frames"]
            sound = np.concatenate([frame.to_ndarray() for frame in sample.decode(audio=0)], axis=-1)
        return torch.from_numpy(frames).float(), torch.from_numpy(sound).double()

    (split_dir, split_proc), (whole_dir, whole_proc) = runs["h3-zero3-lora-sp2"], runs["h3-zero3-lora-ref"]
    assert split_proc.returncode == 0 and whole_proc.returncode == 0, explain(split_proc) + explain(whole_proc)
    (split, split_sound), (whole, whole_sound) = decoded(split_dir), decoded(whole_dir)
    assert split.shape == whole.shape and len(split) == H3_KEYS["sample_frames"] and whole.std() > 1
    assert (split - whole).abs().max().item() <= 2  # of 255: the weights agree within 1e-5, not bit for bit
    assert split_sound.shape == whole_sound.shape and split_sound.shape[0] == 2 and whole_sound.abs().max() > 0
    difference = (split_sound - whole_sound).pow(2).mean().sqrt() / whole_sound.pow(2).mean().sqrt()
    assert difference <= 0.1, difference  # seen: 0.045
    assert torch.corrcoef(torch.stack([split_sound.flatten(), whole_sound.flatten()]))[0, 1] > 0.99  # seen: 0.998


def test_a_size_2_checkpoint_resumed_at_size_1_on_one_rank_continues_the_trajectory(runs):
    (run_dir, proc), (resumed, again) = runs["zero2-full-sp2"], runs["resumed"]
    assert proc.returncode == 0, explain(proc)
    assert again.returncode == 0, explain(again)
    assert "deepspeed.sequence_parallel_size: 2 -> 1" in again.stdout  # an allowed change, said
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
    a = load_file(run_dir / "export" / f"step-{STEPS:08d}" / TRANSFORMER)
    b = load_file(resumed / "export" / f"step-{STEPS:08d}" / TRANSFORMER)
    assert max(((a[k] - b[k]).abs().max() / (a[k].abs().max() + 1e-12)).item() for k in a) <= 1e-5


def test_the_held_out_loss_of_a_sequence_group_is_one_ranks(runs):
    (split_dir, split_proc), (whole_dir, whole_proc) = runs["flux2-zero2-full-sp2"], runs["flux2-zero2-full-ref"]
    assert split_proc.returncode == 0, explain(split_proc)
    assert whole_proc.returncode == 0, explain(whole_proc)
    split, whole = ([(m["step"], m["eval_loss"], m["eval_samples"]) for m in metrics(d) if "eval_loss" in m]
                    for d in (split_dir, whole_dir))
    assert [step for step, *_ in split] == [2, 4] and [n for *_, n in split] == [n for *_, n in whole]
    assert [loss for _, loss, _ in split] == pytest.approx([loss for _, loss, _ in whole], rel=1e-5)
