"""Qwen-Image-Edit-2509 / 2511 (its card QWEN_IMAGE_EDIT_PLUS_CARD and class QwenImageEditPlus,
dstune.models.qwen_image) on builtin:tiny-qwen-image-edit-plus's real components: several references per sample.

The reference is DiffSynth-Studio's Qwen-Image-Edit-2509 training path (github.com/modelscope/DiffSynth-Studio,
commit fed7b18f): diffsynth/diffusion/loss.py FlowMatchSFTLoss (noisy = (1 - sigma) x + sigma noise, target =
noise - x, mse of the prediction), diffsynth/pipelines/qwen_image.py model_fn_qwen_image (the target's packed tokens
then each edit image's, img_shapes [(1, h/2, w/2)] + one per edit image, timestep / 1000, the output cut to the
target's tokens) and QwenImageUnit_PromptEmbedder.encode_prompt_edit_multi (each instruction after "Picture k:
<vision tokens>" per edit image, the images resized to 384 x 384 px of area at their aspect ratio, sides multiples of
32, the template's first 64 tokens dropped). Retyped below; the transformer is diffusers' QwenImageTransformer2DModel
on both sides (DiffSynth's own DiT class has the same blocks). Two deliberate differences, both dstune options:
the draws (timestep, noise, posterior) are dstune's per-sample ones, taken by both sides; DiffSynth multiplies by its
scheduler's training_weight, which is dstune's model.loss_weighting (none here). The condition resize uses the
diffusers pipeline's filter (what QwenImageEditPlusPipeline renders with), where DiffSynth calls PIL's default.
"""

from __future__ import annotations

import math

import pytest
import torch

from dstune import builtin as tiny
from dstune.builtin.common import to_tensor
from dstune.data.synthetic import render_shape
from dstune.families import card_of
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.qwen_image.card import QWEN_IMAGE_EDIT_PLUS_CARD
from dstune.models.qwen_image.model import QwenImageEditPlus, control_images, load_processor
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_settings

MODEL = "builtin:tiny-qwen-image-edit-plus"
SEED, STEP, INDICES = 3, 4, [5, 0]
SIDE = 64  # 8 px per latent: 8x8 latents, 16 target tokens, 16 per reference


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=MODEL), CACHE_DIR, "cpu")


def _batch(indices=INDICES, second=50) -> dict:
    """Targets are shapes; reference 1 and reference 2 are two other shapes."""
    targets = [render_shape(i, SIDE) for i in indices]
    return {
        "pixel_values": to_tensor([image for image, _ in targets]),
        "control_values": to_tensor([render_shape(i + 100, SIDE)[0] for i in indices]),
        "control_values_2": to_tensor([render_shape(i + second, SIDE)[0] for i in indices]),
        "caption": [f"put picture 2 into {caption}" for _, caption in targets],
        "index": torch.tensor(indices, dtype=torch.long),
    }


def test_builtin_is_a_qwen_image_edit_plus_pipeline_folder(built):
    from diffusers import QwenImageEditPlusPipeline

    folder = tiny.ensure_builtin_model("tiny-qwen-image-edit-plus", CACHE_DIR)
    assert card_of("flow", folder) is QWEN_IMAGE_EDIT_PLUS_CARD and type(built) is QwenImageEditPlus
    pipeline = QwenImageEditPlusPipeline.from_pretrained(folder, processor=load_processor(folder))
    assert pipeline.vae_scale_factor == 8 and not pipeline.transformer.config.zero_cond_t  # 2509's layout


def _diffsynth_text(pipeline, prompt: str, edit_image: list):
    """encode_prompt_edit_multi's lines (one prompt, as DiffSynth encodes it)."""
    template = pipeline.prompt_template_encode
    drop_idx = 64
    base_img_prompt = "".join(
        f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(edit_image))
    )
    txt = [template.format(base_img_prompt + prompt)]
    resized = []
    for image in edit_image:
        ratio = image.size[0] / image.size[1]
        width = math.sqrt(384 * 384 * ratio)
        height = width / ratio
        width, height = round(width / 32) * 32, round(height / 32) * 32
        resized.append(pipeline.image_processor.resize(image, height, width))  # the pipeline's filter (docstring)
    model_inputs = pipeline.processor(text=txt, images=resized, padding=True, return_tensors="pt")
    hidden_states = pipeline.text_encoder(
        input_ids=model_inputs.input_ids,
        attention_mask=model_inputs.attention_mask,
        pixel_values=model_inputs.pixel_values,
        image_grid_thw=model_inputs.image_grid_thw,
        output_hidden_states=True,
    ).hidden_states[-1]
    return hidden_states[0][model_inputs.attention_mask[0].bool()][drop_idx:]


def _diffsynth_loss(model, batch: dict, timesteps: torch.Tensor, seen: list) -> torch.Tensor:
    """FlowMatchSFTLoss with model_fn_qwen_image, per sample (DiffSynth trains one sample per step), averaged."""
    from diffusers import QwenImageEditPlusPipeline
    from einops import rearrange

    pipeline = QwenImageEditPlusPipeline(
        scheduler=model.scheduler,
        vae=model.vae,
        transformer=model.trainable,
        **model.text_encoders,
        **model.tokenizers,
        **model.parts,
    )
    vae = model.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1)
    scale = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1)
    with torch.no_grad():
        posterior = vae.encode(batch["pixel_values"].unsqueeze(2)).latent_dist
        draw = lambda purpose: per_sample_randn(posterior.mean.shape[1:], SEED, STEP, INDICES, purpose)  # noqa: E731
        input_latents = ((posterior.mean + posterior.std * draw("vae_posterior"))[:, :, 0] - mean) * scale
        all_noise = draw("noise")[:, :, 0]
        references = [control_images(batch[key]) for key in ("control_values", "control_values_2")]
        edit_latents = [
            (vae.encode(one.unsqueeze(2)).latent_dist.mode()[:, :, 0] - mean) * scale
            for one in (batch["control_values"], batch["control_values_2"])
        ]
    losses = []
    for i in range(len(INDICES)):
        latents_clean, noise, timestep = input_latents[i : i + 1], all_noise[i : i + 1], timesteps[i : i + 1]
        sigma = timestep / 1000
        latents = (1 - sigma) * latents_clean + sigma * noise  # scheduler.add_noise
        training_target = noise - latents_clean  # scheduler.training_target
        with torch.no_grad():
            prompt_emb = _diffsynth_text(pipeline, batch["caption"][i], [ref[i] for ref in references]).unsqueeze(0)
        prompt_emb_mask = torch.ones(prompt_emb.shape[:2], dtype=torch.long)
        # model_fn_qwen_image
        img_shapes = [(1, latents.shape[2] // 2, latents.shape[3] // 2)]
        image = rearrange(latents, "B C (H P) (W Q) -> B (H W) (C P Q)", P=2, Q=2)
        image_seq_len = image.shape[1]
        edits = [e[i : i + 1] for e in edit_latents]
        img_shapes += [(e.shape[0], e.shape[2] // 2, e.shape[3] // 2) for e in edits]
        edit_image = [rearrange(e, "B C (H P) (W Q) -> B (H W) (C P Q)", P=2, Q=2) for e in edits]
        image = torch.cat([image] + edit_image, dim=1)
        seen.append({"img_shapes": [img_shapes], "timestep": timestep / 1000, "hidden_states": image})
        with torch.no_grad():
            out = model.trainable(
                hidden_states=image,
                encoder_hidden_states=prompt_emb,
                encoder_hidden_states_mask=prompt_emb_mask,
                timestep=timestep / 1000,
                img_shapes=[img_shapes],
                return_dict=False,
            )[0]
        out = out[:, :image_seq_len]
        noise_pred = rearrange(out, "B (H W) (C P Q) -> B C (H P) (W Q)", H=SIDE // 16, W=SIDE // 16, P=2, Q=2)
        losses.append(torch.nn.functional.mse_loss(noise_pred.float(), training_target.float()))
    return torch.stack(losses).mean()


def test_loss_and_denoiser_inputs_equal_diffsynth_studios_edit_2509_training(built):
    model = with_settings(built, timestep_sampling="uniform")
    batch = _batch()
    seen_ours = []

    def forward(**kwargs):
        seen_ours.append(kwargs)
        return model.trainable(**kwargs)

    encoded = model.encode_batch(batch)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(forward, encoded, SEED, STEP)
    timesteps = seen_ours[0]["timestep"] * 1000
    assert torch.allclose(timesteps, model.scheduler.timesteps[(u * 1000).long()], atol=1e-3)
    seen_reference = []
    reference = _diffsynth_loss(model, batch, timesteps, seen_reference)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    ours_inputs = seen_ours[0]
    for i, theirs in enumerate(seen_reference):  # the denoiser's inputs: positions, timestep, the token sequence
        assert ours_inputs["img_shapes"][i] == theirs["img_shapes"][0] == [(1, 4, 4), (1, 4, 4), (1, 4, 4)]
        assert torch.allclose(ours_inputs["timestep"][i : i + 1], theirs["timestep"])
        assert torch.allclose(ours_inputs["hidden_states"][i : i + 1], theirs["hidden_states"], atol=1e-6)


def test_each_reference_conditions_the_loss_and_cached_reference_latents_train_alike(built):
    batch = _batch([4, 7])
    encoded = built.encode_batch(batch)
    other_second = {**batch, "control_values_2": _batch([4, 7], second=150)["control_values_2"]}
    cached = {
        **batch,
        "control_latent_mean": encoded["control_latent"],
        "control_latent_mean_2": encoded["control_latent_2"],
    }
    with torch.no_grad():
        losses = [
            built.loss(built.trainable, built.encode_batch(b), 0, 1).item() for b in (batch, other_second, cached)
        ]
    assert losses[0] != losses[1] and losses[2] == losses[0]


def test_samples_render_from_the_references_and_each_one_changes_the_output(built, tmp_path):
    paths = []
    for number in (3, 4, 60):
        paths.append(str(tmp_path / f"{number}.png"))
        render_shape(number, SIDE)[0].save(paths[-1])
    rendered = []
    for second in (paths[1], paths[2]):  # one prompt, seed and first reference; another second reference
        spec = SampleSpec(prompts=["x"], control_images=[[paths[0], second]], steps=1, guidance=1.0, seed=1)
        rendered.append(built.sample(built.trainable, spec.prompts, spec, SIDE)[0])
    assert [image.size for image in rendered] == [(SIDE, SIDE)] * 2
    assert rendered[0].tobytes() != rendered[1].tobytes()  # the second reference changes the output


@pytest.mark.parametrize("model", ["Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"])
def test_validate_plans_each_reference_as_a_picture_and_its_vision_tokens(model, tmp_path, capsys):
    """A folder refused before validates; at real size (configs stored with dstune) two references per sample hold
    more latent tokens, cache more latents and split more tokens over the ranks than one."""
    import re

    import yaml

    from dstune.cli import main

    found = {}
    for folders in (["../person"], ["../person", "../scene"]):
        spec = {
            "model": {"family": "flow", "pretrained": model, "train": "lora", "gradient_checkpointing": True},
            "data": {"path": "/data/not-here", "resolution": 1024, "control_dir": folders, "cache": {"latents": True}},
            "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1, "precision": "bf16"},
            "deepspeed": {"zero_stage": 3},
        }
        path = tmp_path / f"{len(folders)}.yaml"
        path.write_text(yaml.safe_dump(spec))
        assert main(["validate", str(path), "--num-gpus", "8", "--num-samples", "1000"]) == 0
        out = capsys.readouterr().out
        found[len(folders)] = {
            key: float(re.search(rf"{key}\s+([\d.]+) GB", out).group(1)) for key in ("activations", "cache on disk")
        }
    assert found[2]["cache on disk"] == pytest.approx(1.5 * found[1]["cache on disk"], rel=0.02)  # 3 latents vs 2
    assert found[2]["activations"] > 1.2 * found[1]["activations"]
