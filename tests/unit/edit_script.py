"""What the edit models' parity tests share (Qwen-Image-Edit, FLUX.1 Kontext, FLUX.2 image-to-image): the pairs
they train on, the lines every diffusers flow-matching script repeats around its model call (the scheduler copy's
timestep table indexed by int(u * num_train_timesteps), get_sigmas, the weighted squared error against
noise - x0), a recorder of what the denoiser is given, and the checks that the source image conditions the loss.
"""

from __future__ import annotations

import torch


def pairs_batch(indices: list[int], side: int) -> dict:
    """Targets are shapes with their instruction; each source is another shape (the edit turns source i into target
    i), as data.control_dir gives them."""
    from dstune.builtin.common import to_tensor
    from dstune.data.synthetic import render_shape

    targets = [render_shape(i, side) for i in indices]
    return {
        "pixel_values": to_tensor([image for image, _ in targets]),
        "control_values": to_tensor([render_shape(i + 100, side)[0] for i in indices]),
        "caption": [f"turn it into {caption}" for _, caption in targets],
        "index": torch.tensor(indices, dtype=torch.long),
    }


def script_timesteps(folder, u: torch.Tensor, n_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, sigmas viewed to `n_dim` dims) of u, as the scripts look them up in a copy of the folder's
    scheduler: timesteps[int(u * num_train_timesteps)], then each timestep's sigma (their get_sigmas)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler")
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    return timesteps, scheduler.sigmas[positions].flatten().view(-1, *[1] * (n_dim - 1))


def script_loss(model_pred, noise, model_input, sigmas, weighting_scheme: str) -> torch.Tensor:
    """The scripts' flow-matching loss: compute_loss_weighting_for_sd3 times the squared error against
    noise - model_input, averaged per sample, then over the batch."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(len(model_pred), -1)
    return torch.mean(loss, 1).mean()


class Recorder:
    """A denoiser that records the keyword inputs of each call, then runs `forward`: pass it where the transformer
    goes (the model's loss, the script's call) to compare what both feed it."""

    def __init__(self, forward):
        self.forward, self.calls = forward, []

    def __call__(self, **inputs):
        self.calls.append(inputs)
        return self.forward(**inputs)

    @property
    def inputs(self) -> dict:
        (only,) = self.calls
        return only


def check_same_denoiser_inputs(ours: dict, script: dict, exact: tuple, close: tuple = ()) -> None:
    """The named inputs of one call each: `exact` equal (position ids, timesteps, guidance), `close` within float32
    rounding of the same sums (the tokens, the text); a missing input is None on both sides."""
    assert set(ours) == set(script), (sorted(ours), sorted(script))
    for name in exact:
        a, b = ours[name], script[name]
        same = torch.equal(a, b) and a.dtype == b.dtype if isinstance(a, torch.Tensor) else a == b
        assert same, f"{name}: {a} != {b}"
    for name in close:
        torch.testing.assert_close(ours[name], script[name], rtol=1e-5, atol=1e-6, msg=name)


def check_source_conditions_the_loss(built, batch_of) -> None:
    """Another source gives another loss; cached source latents (control_latent_mean) give the encoded ones' loss.
    `batch_of(indices)` -> a pairs batch."""
    batch = batch_of([4, 7])
    other = {**batch, "control_values": batch_of([8, 2])["control_values"]}
    cached = {**batch, "control_latent_mean": built.encode_batch(batch)["control_latent"]}
    with torch.no_grad():
        losses = [built.loss(built.trainable, built.encode_batch(b), 0, 1).item() for b in (batch, other, cached)]
    assert losses[0] != losses[1] and losses[2] == losses[0]
