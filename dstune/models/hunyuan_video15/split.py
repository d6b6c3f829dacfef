"""HunyuanVideo 1.5's sequence split (deepspeed.sequence_parallel_size N > 1; dstune.families.ulysses applies it).
diffusers 0.42 gives HunyuanVideo15Transformer3DModel no context-parallel plan (`_cp_plan`), so dstune writes one
here, for the same hooks and Ulysses attention that diffusers' own plans use:

- the clip's tokens and the context's (the caption's text-encoder states, the glyph tokens and the image tokens,
  joined by the transformer's forward, valid tokens first) are split at the first block's input, the context's mask
  at every block's, the rotary table at its output; the output projection's tokens are gathered back;
- the attention masks the context's padding as keys only. diffusers' processor also masks it as queries, an
  (L x L) mask per sample that a split cannot carry (each rank holds L / N queries, and the Ulysses all-to-all
  gathers a mask along the keys only). The padding's own outputs differ then, but nothing reads them: they are
  masked as keys in every block and the output is the clip's tokens alone, so the prediction is the same;
- the context is padded with masked tokens to a multiple of N (its 1000 + 256 + 729 tokens are odd), the padding
  zeroed as the transformer zeroes the caption's own padding.
"""

from __future__ import annotations

import torch


def context_parallel_plan() -> dict:
    """Where the sequences split and gather (the names are HunyuanVideo15Transformer3DModel's modules and its
    blocks' forward arguments)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)  # (B, tokens, width)
    table = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)  # (tokens, D), an output
    return {
        "transformer_blocks.0": {"hidden_states": tokens, "encoder_hidden_states": tokens},
        # (B, context tokens): every block receives it whole
        "transformer_blocks.*": {
            "attention_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)
        },
        "rope": {0: table, 1: table},  # the cos and sin tables
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


class KeyMaskedAttention:
    """The joint attention of a HunyuanVideo 1.5 block (the clip's tokens with rotary positions, then the context's)
    with the context's padding masked as keys only, so that a split sequence can carry the mask (see the module
    docstring). The Ulysses all-to-all runs in dispatch_attention_fn when `_parallel_config` is set."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        def per_head(projected: torch.Tensor, norm=None) -> torch.Tensor:
            projected = projected.unflatten(2, (attn.heads, -1))
            return norm(projected) if norm is not None else projected

        clip_query = apply_rotary_emb(per_head(attn.to_q(hidden_states), attn.norm_q), image_rotary_emb, sequence_dim=1)
        clip_key = apply_rotary_emb(per_head(attn.to_k(hidden_states), attn.norm_k), image_rotary_emb, sequence_dim=1)
        context_query = per_head(attn.add_q_proj(encoder_hidden_states), attn.norm_added_q)
        context_key = per_head(attn.add_k_proj(encoder_hidden_states), attn.norm_added_k)
        query = torch.cat([clip_query, context_query], dim=1)
        key = torch.cat([clip_key, context_key], dim=1)
        value = torch.cat([per_head(attn.to_v(hidden_states)), per_head(attn.add_v_proj(encoder_hidden_states))], 1)
        clip_tokens = hidden_states.shape[1]
        valid_keys = torch.cat([attention_mask.new_ones(attention_mask.shape[0], clip_tokens), attention_mask], 1)
        attended = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=valid_keys.bool(),
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        attended = attended.flatten(2, 3).to(query.dtype)
        clip, context = attended[:, :clip_tokens], attended[:, clip_tokens:]
        return attn.to_out[1](attn.to_out[0](clip)), attn.to_add_out(context)


def _context_padded_to(size: int):
    """A forward pre-hook on the transformer: the caption's states and mask padded (zeros, masked) so that the
    joined context (caption + glyph + image tokens) splits into `size` equal parts."""

    def pad(module, args, kwargs):
        caption, mask = kwargs.get("encoder_hidden_states"), kwargs.get("encoder_attention_mask")
        if caption is None or mask is None:
            raise ValueError(
                "HunyuanVideo 1.5's split forward takes its context as keyword arguments "
                "(encoder_hidden_states, encoder_attention_mask)"
            )
        context = caption.shape[1] + kwargs["encoder_hidden_states_2"].shape[1] + kwargs["image_embeds"].shape[1]
        extra = -context % size
        if extra:
            kwargs["encoder_hidden_states"] = torch.cat(
                [caption, caption.new_zeros(caption.shape[0], extra, caption.shape[2])], 1
            )
            kwargs["encoder_attention_mask"] = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], 1)
        return args, kwargs

    return pad


def prepare_split(transformer, size: int) -> dict:
    """Make `transformer` (a HunyuanVideo15Transformer3DModel, PEFT-wrapped or not) splittable over `size` ranks:
    its attention processors masked by keys, its context padded; returns the plan to apply."""
    from diffusers.models.attention_processor import Attention

    for module in transformer.modules():
        if isinstance(module, Attention) and type(module.processor).__name__ == "HunyuanVideo15AttnProcessor2_0":
            module.set_processor(KeyMaskedAttention())
    transformer.register_forward_pre_hook(_context_padded_to(size), with_kwargs=True)
    return context_parallel_plan()
