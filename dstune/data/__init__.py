"""Training data: the index (torch-free, used by `dstune validate`), datasets, the global-epoch sampler, the loader.

Importing this package must stay torch-free (importing dstune.data.index runs this file first), so the torch-side
names are loaded on first use.
"""

from dstune.data.index import DataError, IndexResult, SampleRecord, count_samples, index_dataset, list_samples

_LAZY = {
    "BadSampleError": "dstune.data.images",
    "ImageCaptionDataset": "dstune.data.images",
    "collate": "dstune.data.images",
    "find_bad_images": "dstune.data.images",
    "without_samples": "dstune.data.images",
    "GlobalBatchSampler": "dstune.data.sampler",
    "EpochDataLoader": "dstune.data.loader",
    "build_loader": "dstune.data.loader",
}

__all__ = ["DataError", "IndexResult", "SampleRecord", "count_samples", "index_dataset", "list_samples", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dstune.data' has no attribute {name!r}")
