"""dstune's real training entry point with deliberate bugs injected, to prove the batch checker catches them
(each mode named is injected; several may be given at once).

    train_with_bug.py double-shard SPEC ...   the loader shards already-sharded data again (GPT-SoVITS #1318: on N
                                               ranks each one sees 1/N^2 of the batches)
    train_with_bug.py micro-override SPEC ... the DeepSpeed config handed to the engine has another micro batch
                                               than the plan (an override after compile, e.g. a hand-edited JSON)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import dstune.data.loader as loader_module  # noqa: E402
import dstune.engine as engine_module  # noqa: E402
from dstune.train import main  # noqa: E402

MODES = ("double-shard", "micro-override")
# The launcher puts --local_rank=N before our arguments, so find the modes by name.
modes = [arg for arg in sys.argv[1:] if arg in MODES]
if not modes:
    raise SystemExit(f"usage: train_with_bug.py {{{'|'.join(MODES)}}}... SPEC")
for mode in modes:
    sys.argv.remove(mode)


def replace_everywhere(module, name: str, new) -> None:
    """`module.name = new`, and the same in every dstune module that already imported the original by name (in a
    rank forked from the tests' warm launcher, dstune.startup and dstune.training are imported before this runs)."""
    original = getattr(module, name)
    for other in list(sys.modules.values()):
        if getattr(other, "__name__", "").startswith("dstune") and getattr(other, name, None) is original:
            setattr(other, name, new)


if "double-shard" in modes:
    original_make_loader = loader_module.make_loader

    def make_loader_sharded_twice(dataset, collate_fn, group_keys, data, plan, rank, seed, start_epoch=0,
                                  start_step=0, **options):  # options: speakers, sets, ... as make_loader takes them
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler, Subset

        loader, sampler = original_make_loader(dataset, collate_fn, group_keys, data, plan, rank, seed, start_epoch,
                                               start_step, **options)
        my_share = [index for batch in sampler for index in batch]  # already this rank's 1/N
        again = DistributedSampler(my_share, num_replicas=dist.get_world_size(), rank=rank, shuffle=False)
        buggy = DataLoader(Subset(loader.dataset, my_share), batch_size=plan.micro_batch_size, sampler=again,
                           collate_fn=loader.collate_fn, drop_last=True)
        return buggy, sampler

    replace_everywhere(loader_module, "make_loader", make_loader_sharded_twice)
if "micro-override" in modes:
    original_wrap_model = engine_module.wrap_model

    def wrap_model_overridden(trainable, train, ds_config, plan):
        changed = dict(ds_config)
        changed["train_micro_batch_size_per_gpu"] = ds_config["train_micro_batch_size_per_gpu"] // 2
        changed["gradient_accumulation_steps"] = ds_config["gradient_accumulation_steps"] * 2
        return original_wrap_model(trainable, train, changed, plan)

    replace_everywhere(engine_module, "wrap_model", wrap_model_overridden)

sys.exit(main())
