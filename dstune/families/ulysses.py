"""The attention split of sequence parallelism (deepspeed.sequence_parallel_size = N > 1), on a diffusers
transformer, through the transformer's own context-parallel plan (`_cp_plan`: where its token sequence is split,
which of its attention calls trade the sequence split for a head split by an all-to-all, and where the output is
gathered back). docs/sequence-parallel.md says why this and not DeepSpeed's DistributedAttention.

    split_sequences(transformer, rank, world_size, size)          # the class's own plan (_cp_plan)
    split_sequences(transformer, rank, world_size, size, plan)    # a plan dstune gives the model (Family.split_plan)

Afterwards every forward of `transformer` on the N ranks of a sequence group (ranks dp * N .. dp * N + N - 1, the
layout of DeepSpeed's sequence-parallel groups that dstune.distributed sets up) must get the same inputs: each rank
then holds 1/N of the tokens between the all-to-alls and returns the whole output. In backward, each rank's
parameter gradients are its tokens' share; DeepSpeed's ZeRO (given the sequence-parallel groups as its mpu) sums
them over the group and averages over the data-parallel groups, so a step is the step of one rank on the same
global batch.
"""

from __future__ import annotations

from typing import Optional

import torch

MESH_NAMES = ("data_parallel", "ring", "ulysses")  # diffusers' context-parallel mesh needs "ring" and "ulysses"


def context_parallel_plan(transformer) -> Optional[dict]:
    """The transformer's context-parallel plan, None when its class has none (it cannot be split)."""
    return getattr(type(transformer), "_cp_plan", None)


def split_sequences(transformer, rank: int, world_size: int, size: int, plan: Optional[dict] = None) -> None:
    """Collective (every rank; it makes the device mesh's process groups): split `transformer`'s sequences over
    groups of `size` consecutive ranks by `plan`, or by its class's plan when None. The transformer may be wrapped
    by PEFT (LoRA): the plan names its modules."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers import ContextParallelConfig, ParallelConfig

    plan = plan if plan is not None else context_parallel_plan(transformer)
    if plan is None:
        raise ValueError(
            f"{type(transformer).__name__} has no context-parallel plan (_cp_plan): its sequences cannot "
            "be split; train it with deepspeed.sequence_parallel_size: 1"
        )
    device = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda", torch.cuda.current_device())
    mesh = torch.distributed.device_mesh.init_device_mesh(
        device.type, (world_size // size, 1, size), mesh_dim_names=MESH_NAMES
    )
    group_mesh = mesh["ring", "ulysses"]  # this rank's sequence group, as diffusers' attention dispatch reads it
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=size, mesh=group_mesh))
    # diffusers' own enable_parallelism would build a mesh over every rank and pick the device by
    # torch.accelerator.device_count(), which is 0 on the CPU: the same configuration is set up here instead.
    config.setup(rank, world_size, device, mesh=group_mesh)
    transformer._parallel_config = config
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config  # the processors pass it to self-attention only
    if _masks_its_text(plan):
        transformer.register_forward_pre_hook(_text_padded_to(size), with_kwargs=True)  # before the plan's hooks
    apply_context_parallel(transformer, config.context_parallel_config, plan)


def _masks_its_text(plan: dict) -> bool:
    """Whether the plan splits the text stream together with a text mask: then a text of any length
    can be padded with masked tokens to split evenly."""
    return any("encoder_hidden_states_mask" in (inputs or {}) for inputs in plan.values() if isinstance(inputs, dict))


def _text_padded_to(size: int):
    """A forward pre-hook padding encoder_hidden_states (and its mask, zeros over the padding) to a multiple of
    `size` tokens: the split needs equal parts, and the samples' prompts (the pipeline's own encoding, not padded to
    max_sequence_length as the training text is) have any length. The padding is masked out of every attention
    (its keys), and the text stream never reaches the output, so the image's prediction is unchanged."""

    def pad(module, args, kwargs):
        text = kwargs.get("encoder_hidden_states")
        if text is None or text.shape[1] % size == 0:
            return None
        extra = size - text.shape[1] % size
        mask = kwargs.get("encoder_hidden_states_mask")
        if mask is None:  # the pipeline drops a mask of all ones
            mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
        kwargs["encoder_hidden_states"] = torch.cat([text, text.new_zeros(text.shape[0], extra, text.shape[2])], 1)
        kwargs["encoder_hidden_states_mask"] = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], 1)
        return args, kwargs

    return pad


class _GatheredOverGroup(torch.autograd.Function):
    """The sequence group's shares of a split sequence, gathered along `dim` (this rank's share is its place in the
    group), for a model whose plan reads them whole on every rank beside a split stream (an audio stream's
    attention to the video). Each rank's gradient of the gathered tokens is then its own part of the whole, so
    backward sums it over the group before keeping this rank's share (the gather's adjoint). diffusers' own gather
    keeps this rank's share of its own gradient, which is right only where every rank's gradient of the gathered
    tokens is the same whole (a loss every rank computes from them alone)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, dim: int, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.dim, ctx.group, ctx.size, ctx.rank = dim, group, dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(tokens) for _ in range(ctx.size)]
        dist.all_gather(parts, tokens.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def gathered_over_group(tokens: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's share of a split sequence (B, T / N, D along dim 1) -> the group's whole (B, T, D), whose backward
    sums the gradient over the group."""
    return _GatheredOverGroup.apply(tokens, dim, group)
