"""Built-in tiny FLUX.2 [klein]: `builtin:tiny-flux2`, a real Flux2KleinPipeline folder with tiny components.

Flux2Transformer2DModel (one double-stream and one single-stream block, 32 wide, 4-axis RoPE), AutoencoderKLFlux2
(8 latent channels, spatial factor 2, its batch-norm statistics at their initial values: the VAE is random, so
renders are noise-like images, which is all the tests need), a Qwen3 causal LM of 27 layers 32 wide (the pipeline
reads the hidden states of layers 9, 18 and 27) and the byte-level tokenizer of builtin:tiny-qwen-image with a
Qwen3-style chat template, built offline from fixed configs and a fixed seed. The klein class is the one offered:
its Qwen3 tokenizer can be built offline; FLUX.2 [dev]'s PixtralProcessor needs torchvision, which the
tested environment cannot have (docs/family-flow.md).
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu
from dstune.builtin.qwen_image import tiny_qwen_tokenizer
from dstune.builtin.zimage import QWEN3_CHAT_TEMPLATE
from dstune.hf import quiet_hf_libraries

_SEED = 40
TEXT_WIDTH = 32
# in_channels == 4 x latent_channels (the VAE patchifies 2x2); joint_attention_dim == 3 text layers x TEXT_WIDTH;
# sum(axes_dims_rope) == attention_head_dim
TINY_FLUX2_TRANSFORMER = dict(patch_size=1, in_channels=32, num_layers=1, num_single_layers=1, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32,
                              axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
TINY_FLUX2_VAE = dict(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                      up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=8,
                      norm_num_groups=4, sample_size=32, mid_block_add_attention=False)
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                       max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def build_tiny_flux2(out: Path, needs: dict) -> dict:
    """builtin:tiny-flux2: a Flux2KleinPipeline folder."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with quiet_hf_libraries():
        from diffusers import Flux2KleinPipeline
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=27,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
            bos_token_id=end_of_text, eos_token_id=end_of_text, pad_token_id=end_of_text))
        vae = AutoencoderKLFlux2(**TINY_FLUX2_VAE)
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER)
    pipeline = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=vae,
                                  text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    with quiet_hf_libraries():
        pipeline.save_pretrained(out, safe_serialization=True)
    return {"transformer_parameters": sum(p.numel() for p in transformer.parameters())}


TINY_FLUX2 = BuiltinModel(
    name="tiny-flux2", folder_name="tiny-flux2-v1", family="flow",
    description="FLUX.2 [klein] pipeline: one double- and one single-stream Flux2 block, Qwen3 causal LM (27 layers "
                "32 wide), random 8-channel FLUX.2 VAE",
    build=build_tiny_flux2)
