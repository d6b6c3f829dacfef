"""Diffusers modular pipelines (a folder with modular_model_index.json, no model_index.json): the pipeline a model's
loaded parts render samples through, and the index an export writes.

A modular pipeline is its blocks (`_blocks_class_name` in the index) run over a components object: diffusers'
`ModularPipeline.from_pretrained(folder)` makes it from the folder's index without loading a weight, and
`update_components(...)` hands it the parts dstune already holds (the trained transformer, the frozen VAE and text
encoders), so rendering never loads a second copy. Each component entry of the index records where it loads from
(`pretrained_model_name_or_path`: after `save_pretrained`, the absolute path of the folder written; for a downloaded
folder, its hub id), so an exported folder's index must point its components at the export itself: copied as it
stands, it would load the untrained transformer from the source.
"""

from __future__ import annotations

import json
from pathlib import Path

from dstune.families.base import FamilyError
from dstune.families.folders import MODULAR_INDEX, modular_entries
from dstune.hf import quiet_hf_libraries


def modular_pipeline(folder: Path, components: dict, without: tuple[str, ...] = ()):
    """The folder's modular pipeline (its blocks and configs from modular_model_index.json; no weight loaded) around
    `components` (name -> a loaded part; None entries are left unset). The caller owns the parts: these are
    references, not copies. `without`: top-level blocks left out, whose outputs the caller passes in (a model that
    encodes its prompts itself, the text block's outputs)."""
    with quiet_hf_libraries():
        from diffusers import ModularPipeline

        try:
            pipeline = ModularPipeline.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise FamilyError(f"{folder / MODULAR_INDEX}: diffusers cannot make its modular pipeline ({first_line})")
        if without:  # the same blocks less these, over the same folder's configs
            blocks = pipeline.blocks  # a copy
            for name in without:
                blocks.sub_blocks.pop(name)
            pipeline = blocks.init_pipeline(str(folder))
        pipeline.update_components(**{name: part for name, part in components.items() if part is not None})
    quiet_blocks(pipeline._blocks)  # the blocks it runs (its `blocks` property is a copy)
    return pipeline


def quiet_blocks(block) -> None:
    """No progress bar from any block, however deep (the pipeline's own setting reaches its top-level blocks only,
    and a denoising loop sits inside a workflow's block)."""
    for sub in getattr(block, "sub_blocks", {}).values():
        if hasattr(sub, "set_progress_bar_config"):
            sub.set_progress_bar_config(disable=True)
        quiet_blocks(sub)


def exported_modular_index(source: Path, target: Path, written: set[str]) -> dict:
    """`source`'s modular_model_index.json with the entries of the components `written` into the export (their
    subfolders) loading from `target`, the export's final path: subfolder = the component's name, no revision, no
    variant (the export holds the default weights only). Other entries (a component the folder never held, as a
    processor that loads from elsewhere) and the pipeline's configs are kept as they are."""
    index = json.loads((source / MODULAR_INDEX).read_text())
    for name in modular_entries(source):
        if name in written:
            spec = dict(index[name][2])
            spec.update(pretrained_model_name_or_path=str(target), subfolder=name, revision=None, variant=None)
            index[name] = [index[name][0], index[name][1], spec]
    return index


def write_modular_index(source: Path, work: Path, final: Path) -> None:
    """Write the export's modular_model_index.json into `work` (published as `final`): every component present in
    `work` loads from `final` (exported_modular_index)."""
    written = {path.name for path in work.iterdir() if path.is_dir()}
    index = exported_modular_index(source, Path(final).resolve(), written)
    (work / MODULAR_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
