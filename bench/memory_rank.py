"""One rank of bench/memory_bench.py: model-state memory of the benchmark UNet under one DeepSpeed JSON.

    deepspeed --num_gpus 2 bench/memory_rank.py --ds-config ds.json --out DIR

Builds the UNet (bench/common.py BENCH_UNET), wraps it with deepspeed.initialize (AdamW, as dstune does), runs
one optimizer step on a tiny input (so optimizer states exist), then a second backward, and counts the memory held
after it, the batch freed: parameters, gradients and optimizer states together, the model-state peak of a step
(and again after the second step, where ZeRO may have freed gradients). On CUDA: torch.cuda.memory_allocated();
on the CPU: the bytes of every distinct tensor storage alive in the process, found through the garbage collector
(tensors only C++ holds are missed). Both minus the same count taken before the model was built.
Writes DIR/rank<R>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_UNET  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402


def live_tensor_bytes() -> int:
    """Bytes of all distinct storages of live tensors (parameters, their .grad, optimizer and ZeRO buffers)."""
    gc.collect()
    warnings.simplefilter("ignore")  # touching every object wakes deprecation warnings of unrelated libraries
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            tensors = [obj] if torch.is_tensor(obj) else []
        except ReferenceError:  # a dead weak proxy
            continue
        if tensors and isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
            tensors.append(obj.grad)
        for tensor in tensors:
            if tensor.device.type == "meta" or tensor.is_sparse:
                continue
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(size for ptr, size in storages.items() if ptr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.distributed.barrier()  # every rank has mapped every shm segment: the names can go
    from dstune.distributed import release_shm_allreduce_name

    release_shm_allreduce_name(torch.distributed.get_rank())  # as dstune does: no 69 MB leak per rank
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from diffusers import UNet2DConditionModel

    from dstune.memory.record import peak_rss_bytes, rss_bytes

    before = live_tensor_bytes()
    baseline_rss = rss_bytes()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**BENCH_UNET).to(device)
    num_params = sum(p.numel() for p in unet.parameters())
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in unet.modules())
    config = json.loads(Path(args.ds_config).read_text())
    optimizer = (
        torch.optim.AdamW(unet.parameters(), lr=1e-4)
        if args.optimizer == "adamw"
        else torch.optim.SGD(unet.parameters(), lr=1e-4, momentum=0.9)
    )
    engine, _, _, _ = deepspeed.initialize(
        model=unet, model_parameters=unet.parameters(), optimizer=optimizer, config=config, dist_init_required=False
    )
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    micro = config["train_micro_batch_size_per_gpu"]
    after_backward = after_step = 0
    engine_rss = peak_rss_bytes() - baseline_rss
    for _ in range(2):
        noisy = torch.randn(micro, 4, 8, 8, device=device, dtype=dtype)
        text = torch.randn(micro, 77, BENCH_UNET["cross_attention_dim"], device=device, dtype=dtype)
        timesteps = torch.randint(0, 1000, (micro,), device=device)
        loss = engine(noisy, timesteps, text, return_dict=False)[0].float().pow(2).mean()
        engine.backward(loss)
        del noisy, text, timesteps, loss  # activations go; what stays is model state
        after_backward = live_tensor_bytes()
        engine.step()
        after_step = live_tensor_bytes()
    out = Path(args.out) / f"rank{rank}.json"
    out.write_text(
        json.dumps(
            {
                "rank": rank,
                "after_backward_bytes": after_backward - before,
                "after_step_bytes": after_step - before,
                "num_params": num_params,
                "engine_start_rss_growth_bytes": engine_rss,
                "peak_rss_growth_bytes": peak_rss_bytes() - baseline_rss,
                "cuda_peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
                "largest_layer_params": largest_layer,
                "device": device.type,
            }
        )
    )


if __name__ == "__main__":
    main()
