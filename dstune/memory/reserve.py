"""The runtime reserve: what a rank holds beyond the tensors the memory plan counts, on a GPU (the CUDA context)
and on DeepSpeed's CPU accelerator (--accelerator cpu: the host is the device; the rank's RSS holds the libraries,
the kept heap and the kernels its step compiles). Pure functions of the plan's ModelCounts and Setup
(dstune.memory.plan)."""

from __future__ import annotations

RUNTIME_RESERVE_BYTES = 1 << 30  # CUDA context, NCCL and allocator slack per GPU
# DeepSpeed's CPU accelerator (--accelerator cpu: the host is the device), per rank: what a rank's resident memory
# holds beyond the tensors the plan counts, measured on 2-rank runs at 0.8 M and 17.6 M parameters
# (docs/performance.md section 5). From the first training step on (step and sample phases): library pages and
# Python code loaded lazily by the first backward, optimizer step and samples (about 25-30 MB of file pages, 40-60 MB
# anonymous), and the heap glibc keeps after a step's transients are freed, which grows with the module (about 4
# bytes per module parameter between the two sizes; the RSS a phase starts from carries it). Before it (load and
# cache build): the module objects and the loading and encoding code, 15-35 MB, up to 57 MB on a rank running a text
# encoder for the cache (its code, tokenizer and template files: 34 MB of file pages). DeepSpeed's shm all-reduce
# workspace (66 MiB a rank) is mapped but never touched in training (its kernel serves only inference_all_reduce):
# 0 bytes of RssShmem in every run measured. A GPU's allocator peak holds none of this.
CPU_RUNTIME_RESERVE_BYTES = 96 << 20
CPU_RESERVE_PER_MODULE_PARAM = 4.0
CPU_STARTUP_RESERVE_BYTES = 64 << 20
# train.compile blocks on the CPU accelerator: torch.compile's own objects and the generated kernels' modules in the
# rank's memory from the first step on (measured: 55 MB over the plain run at SD's tiny UNet, 1 rank)
CPU_COMPILE_RESERVE_BYTES = 96 << 20
# bf16 on the CPU accelerator: torch runs a bf16 linear layer through oneDNN's matmul, which JIT-compiles a brgemm
# kernel for each problem shape (forward, and both products of backward) and keeps it for the process (its primitive
# cache and kernel cache); fp32 takes a precompiled path. Measured from the first step on, over the same fp32 run:
# +31 to +33 MB of RSS (anonymous) on 2-rank LoRA runs of a tiny flow transformer under ZeRO 2 and 3 (a step's dozens of shapes).
CPU_BF16_KERNELS_BYTES = 32 << 20


def runtime_reserve(counts, setup) -> float:
    """The step and sample phases' reserve per rank (the load and cache phases: CPU_STARTUP_RESERVE_BYTES on the
    CPU accelerator, this on a GPU)."""
    if setup.accelerator == "cuda":
        return RUNTIME_RESERVE_BYTES
    return (
        CPU_RUNTIME_RESERVE_BYTES
        + CPU_RESERVE_PER_MODULE_PARAM * counts.module_params
        + (CPU_COMPILE_RESERVE_BYTES if setup.compiled_blocks else 0)
        + (CPU_BF16_KERNELS_BYTES if setup.precision == "bf16" else 0)
    )
