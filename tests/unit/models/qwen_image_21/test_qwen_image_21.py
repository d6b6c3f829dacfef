"""Qwen-Image 2.1 (its card and class, dstune.models.qwen_image_21) on builtin:tiny-qwen-image-21's real components.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_qwenimage21.py
with diffusers' own pieces: the images as RGBA through AutoencoderKLQwenImage21 (a posterior sample), (x -
latents_mean) * (1 / latents_std), QwenImage21Pipeline.encode_prompt for the batch's captions, u from
compute_density_for_timestep_sampling indexing the folder scheduler's timestep table and get_sigmas, x_t,
QwenImage21Pipeline._pack_latents, img_mask [False over the prompt | True per 2x2 slot], timestep / 1000, the
output's tail unpacked with _unpack_latents, the target noise - x0 and compute_loss_weighting_for_sd3. Both sides take
dstune's per-sample draws (the posterior's noise, the noise, each sample's u generator).
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of, get_facts
from dstune.families.base import FamilyError
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.models.qwen_image_21.card import QWEN_IMAGE_21_CARD
from dstune.models.qwen_image_21.model import QwenImage21, load_processor, pipeline_from_parts
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_attributes, with_settings
from tiny_batches import shape_batch

SEED, STEP, INDICES = 5, 3, [4, 11, 2]
SIDE = 64  # 4x4 latents of the 16x VAE: four image slots
NAME = "builtin:tiny-qwen-image-21"
# (dstune settings, the example's flags): its default (weighting_scheme none: uniform u), then others
CASES = {
    "script-defaults": (
        dict(timestep_sampling="uniform"),
        dict(weighting_scheme="none", logit_mean=0.0, logit_std=1.0),
    ),
    "logit-normal": (
        dict(timestep_sampling="logit_normal", logit_mean=0.5, logit_std=1.2),
        dict(weighting_scheme="logit_normal", logit_mean=0.5, logit_std=1.2),
    ),
    "cosmap": (
        dict(timestep_sampling="uniform", loss_weighting="cosmap"),
        dict(weighting_scheme="cosmap", logit_mean=0.0, logit_std=1.0),
    ),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=NAME), CACHE_DIR, "cpu")


def test_builtin_is_a_qwen_image_21_pipeline_folder(built):
    folder = tiny.ensure_builtin_model("tiny-qwen-image-21", CACHE_DIR)
    assert card_of("flow", folder) is QWEN_IMAGE_21_CARD and built.card is QWEN_IMAGE_21_CARD
    assert type(built) is QwenImage21
    assert type(built.text_encoders["text_encoder"]).__name__ == "Qwen3VLForConditionalGeneration"
    assert built.max_sequence_length == 128  # 512, capped by the tiny tokenizer's model_max_length


def _script_loss(built, pixels: torch.Tensor, captions: list[str], flags: dict) -> torch.Tensor:
    """The example's loss lines (train_dreambooth_lora_qwenimage21.py's training step) at dstune's draws."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    vae, vae_scale_factor = built.vae, 2 ** len(built.vae.config.temperal_downsample)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder, subfolder="scheduler")
    z = vae.config.z_dim
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    rgba = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1).unsqueeze(2)  # RGB converted to RGBA
    with torch.no_grad():
        posterior = vae.encode(rgba).latent_dist
    shape = posterior.mean.shape[1:2] + posterior.mean.shape[3:]
    model_input = posterior.mean + posterior.std * per_sample_randn(
        shape, SEED, STEP, INDICES, "vae_posterior"
    ).unsqueeze(2)
    model_input = (model_input - latents_mean) * latents_std
    noise = per_sample_randn(shape, SEED, STEP, INDICES, "noise").unsqueeze(2)
    batch = model_input.shape[0]
    u = torch.cat(
        [
            compute_density_for_timestep_sampling(
                weighting_scheme=flags["weighting_scheme"],
                batch_size=1,
                logit_mean=flags["logit_mean"],
                logit_std=flags["logit_std"],
                mode_scale=1.29,
                generator=sample_generator(SEED, STEP, i, "timestep"),
            )
            for i in INDICES
        ]
    )
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().view(batch, 1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    with torch.no_grad():
        prompt_embeds, prompt_embeds_mask, _ = built.pipeline().encode_prompt(prompt=list(captions), device="cpu")
    height, width = model_input.shape[3], model_input.shape[4]
    packed = QwenImage21Pipeline._pack_latents(
        noisy_model_input, batch_size=batch, num_channels_latents=z, height=height, width=width
    )
    img_mask = torch.cat(
        [
            torch.zeros(batch, prompt_embeds.shape[1], dtype=torch.bool),
            torch.ones(batch, height * width // 4, dtype=torch.bool),
        ],
        dim=1,
    )
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=packed,
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=prompt_embeds_mask,
            timestep=timesteps / 1000,
            img_shapes=[[(1, height, width)]] * batch,
            img_mask=img_mask,
            return_dict=False,
        )[0]
    model_pred = QwenImage21Pipeline._unpack_latents(
        model_pred[:, -packed.shape[1] :], height * vae_scale_factor, width * vae_scale_factor, vae_scale_factor
    )
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(batch, -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_qwen_image_21_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = shape_batch(INDICES, SIDE)
    with torch.no_grad():
        ours = model.loss(model.trainable, model.encode_batch(batch), SEED, STEP)
    reference = _script_loss(model, batch["pixel_values"], batch["caption"], flags)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_cached_text_trains_like_encoded_text(built):
    """Captions cached at max_sequence_length train exactly as the batch's own encoding (cut to its longest)."""
    batch = shape_batch([4, 7], SIDE)
    cached = {**batch, **built.encode_text(batch["caption"])}
    assert cached["encoder_hidden_states"].shape == (2, 128, 16)
    with torch.no_grad():
        encoded = built.loss(built.trainable, built.encode_batch(batch), 0, 1)
        from_cache = built.loss(built.trainable, built.encode_batch(cached), 0, 1)
    assert from_cache.item() == pytest.approx(encoded.item(), rel=1e-6)


def test_sample_and_export_reload_with_qwen_image_21_pipeline(built, tmp_path):
    """Samples render at 64 px (RGBA, as the pipeline returns them); the export loads in QwenImage21Pipeline with
    the trained weights and renders."""
    images = built.sample(built.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=2, guidance=1.0), SIDE)
    assert [image.size for image in images] == [(SIDE, SIDE)] and built.trainable.training
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    export = built.export(state, tmp_path / "export")
    reloaded = pipeline_from_parts(export)
    name = next(iter(state))
    assert torch.equal(reloaded.transformer.state_dict()[name], state[name])
    image = reloaded(prompt="a red circle", height=SIDE, width=SIDE, num_inference_steps=2).images[0]
    assert image.size == (SIDE, SIDE)


def test_lora_export_loads_with_load_lora_weights_and_changes_the_image(tmp_path):
    """train: lora: the LoRA file loads with QwenImage21Pipeline.load_lora_weights, reproduces the trained module's
    loss and changes the rendered image."""
    from dstune.families.lora import apply_train_mode, export_lora

    spec = FlowModelSpec(family="flow", pretrained=NAME, train="lora")
    model = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(model, spec, seed=0)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
    encoded = model.encode_batch(shape_batch([1], SIDE))
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    out = export_lora(model, state, tmp_path / "lora", spec)
    pipe = pipeline_from_parts(model.folder)
    call = dict(prompt="a red circle", height=SIDE, width=SIDE, num_inference_steps=2, output_type="np")
    with torch.no_grad():
        base_image = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
        pipe.load_lora_weights(out)
        trained, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipe.transformer))
        lora_image = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert loaded.item() == pytest.approx(trained.item(), rel=1e-6)
    assert abs(lora_image - base_image).max() > 1e-3


def test_caption_longer_than_max_sequence_length_is_refused_naming_it(built):
    short = with_attributes(built, max_sequence_length=12)
    with pytest.raises(FamilyError, match=r"the caption 'a red circle' is \d+ tokens .* model.max_sequence_length 12"):
        short.encode_text(["a red circle"])


def test_turbo_folder_samples_on_its_own_sigmas(built, tmp_path):
    """A Turbo folder (sample_sigmas in model_index.json) renders on that grid; sample.steps of another length is
    refused naming both, rather than silently ignored by the pipeline."""
    import json
    import shutil

    folder = tmp_path / "turbo"
    shutil.copytree(built.folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["sample_sigmas"] = [1.0, 0.6]
    (folder / "model_index.json").write_text(json.dumps(index))
    turbo = build_model(FlowModelSpec(family="flow", pretrained=str(folder)), CACHE_DIR, "cpu")
    assert turbo.pipeline().config.sample_sigmas == [1.0, 0.6]
    images = turbo.sample(turbo.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=2), SIDE)
    assert [image.size for image in images] == [(SIDE, SIDE)]
    with pytest.raises(FamilyError, match=r"sample.steps 5: .* own 2 sigmas .* set sample.steps: 2"):
        turbo.sample(turbo.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=5), SIDE)


def test_turbo_sample_steps_of_another_length_are_refused_by_validate(built, tmp_path):
    """dstune validate names sample.steps for a Turbo folder before any GPU time (the folder's sample_sigmas)."""
    import json
    import shutil

    from dstune.spec.load import load_spec

    folder = tmp_path / "turbo"
    shutil.copytree(built.folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": [1.0, 0.75, 0.4, 0.1]}))
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        f"model: {{family: flow, pretrained: '{folder}'}}\n"
        "data: {path: 'builtin:shapes', resolution: 64}\n"
        "train: {micro_batch_size: 1, max_steps: 1}\n"
        "sample: {prompts: ['a red circle'], steps: 30}\n"
        f"output: {{dir: '{tmp_path / 'run'}'}}\n"
    )
    issues = get_facts("flow").spec_issues(load_spec(spec_path)[0])
    assert [key for key, _ in issues] == ["sample.steps"] and "set sample.steps: 4" in issues[0][1]


def test_a_real_processor_that_cannot_load_is_refused_naming_torchvision(built, tmp_path):
    """A folder listing a Qwen3VLProcessor, on a machine without torchvision, stops with the folder, the class and
    what to install rather than transformers' ImportError traceback."""
    import json
    import shutil

    try:
        import torchvision  # noqa: F401

        pytest.skip("torchvision is installed here: the processor loads")
    except ImportError:
        pass
    folder = tmp_path / "real-processor"
    shutil.copytree(built.folder / "processor", folder / "processor")
    (folder / "model_index.json").write_text(json.dumps({"processor": ["transformers", "Qwen3VLProcessor"]}))
    configs = {
        "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
        },
        "video_preprocessor_config.json": {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "processor_class": "Qwen3VLProcessor",
        },
    }
    for name, config in configs.items():
        (folder / "processor" / name).write_text(json.dumps(config))
    with pytest.raises(FamilyError, match=r"processor: cannot load its Qwen3VLProcessor .* torchvision"):
        load_processor(folder)


@pytest.mark.parametrize(
    "data, key",
    [
        ("resolution: 48", "data.resolution"),
        ("resolution: 64, buckets: {enabled: true, sizes: [[64, 48]]}", "data.buckets.sizes"),
    ],
)
def test_sides_off_the_32_px_grid_are_refused_by_validate(tmp_path, data, key):
    """16 px latents in 2x2 slots: validate names the setting instead of the first batch failing on every rank."""
    from dstune.spec.load import load_spec

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        f"model: {{family: flow, pretrained: '{NAME}'}}\n"
        f"data: {{path: 'builtin:shapes', {data}}}\n"
        "train: {micro_batch_size: 1, max_steps: 1}\n"
        f"output: {{dir: '{tmp_path / 'run'}'}}\n"
    )
    issues = get_facts("flow").spec_issues(load_spec(spec_path)[0])
    assert [k for k, _ in issues] == [key] and "multiples of 32 px" in issues[0][1]
