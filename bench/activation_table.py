"""Measure the activation bytes of every model dstune trains and regenerate dstune/model_configs/activation_constants.json.

    python3 bench/activation_table.py            # all models, bf16 and fp32 (~20 min on 2 busy CPU cores)
    python3 bench/activation_table.py flux1 sd3  # only these keys (the others stay as stored)
    python3 bench/activation_table.py --lora     # only the LoRA tables (of these keys, or all)

For each model (bench/activation_models.py: the real class, narrow) and precision, bench/activation_measure.py
counts the bytes autograd saves in one training forward at each of the case's sizes, without and with gradient
checkpointing, and a least-squares fit gives per bucket (outside the blocks, one block of each kind, the logits, the
checkpoint inputs, the recomputed module) bytes = width x (a T + c C + b [+ T^2, C^2, T C terms]) [+ ffn x (...)]
[+ LL (T + C)^2, a joint attention mask's bytes, width-free], T the tokens and C the context tokens; and the most
one forward pass without gradients holds at once (`forward`: a sample's denoising step, bench/working_measure.py's
count of the storages alive);
dstune.memory.activations evaluates them for the real model's width, MLP width, vocabulary and block counts. Progress goes to stderr; stdout holds the table and one line of JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activation_measure import count_checkpointed, count_saved, warm_up  # noqa: E402
from working_measure import peak_bytes, step_peak  # noqa: E402
from activation_models import CASES, CASES_BY_KEY  # noqa: E402
from common import print_json, print_table  # noqa: E402
from dstune.memory.activations import CONSTANTS_FILE, LORA_RANK  # noqa: E402
from dstune.spec.section import DEFAULT_LORA_TARGET_MODULES  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WIDTH_FEATURES = ("T", "C", "1")
QUADRATIC_FEATURES = ("TT", "CC", "TC")
FFN_FEATURES = ("fT", "fC", "f")
MASK_FEATURES = ("LL",)  # (T + C)^2 bytes of a joint attention mask (per element, not per width unit)
# per token and per context token, width-free: what a LoRA step keeps of tensors as wide as a head, not as the
# model (rotary tables), fitted where a case's LoRA table is measured at two widths (Case.lora_widths)
WIDTH_FREE_TOKENS = ("t", "c")
WIDTH_FREE = ("f", "L", "V", *WIDTH_FREE_TOKENS)  # the first letters of features not divided by the width


def _enable_checkpointing(model) -> None:
    if hasattr(model, "gradient_checkpointing_enable"):  # transformers, as dstune's speech models enable it
        from dstune.families.speech import checkpoint_activations

        checkpoint_activations(model)
    else:  # diffusers, as dstune enables it
        from dstune.families.diffusion import non_reentrant_checkpoint

        model.enable_gradient_checkpointing(gradient_checkpointing_func=non_reentrant_checkpoint)


def _disable_checkpointing(model) -> None:
    if hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()
    else:
        model.disable_gradient_checkpointing()


def add_lora(model, dtype: torch.dtype, targets: tuple = DEFAULT_LORA_TARGET_MODULES) -> None:
    """The model frozen, with LoRA adapters of LORA_RANK on `targets`, the family's default ones
    (dstune.families.lora, as a `model.train: lora` run adds them): only the adapters train."""
    from peft import LoraConfig

    from dstune.families.lora import add_lora_adapter

    model.requires_grad_(False)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=list(targets))
    add_lora_adapter(model, config)
    model.to(dtype)


def measure(
    case,
    dtype: torch.dtype,
    tokens: int,
    context: int,
    heads: int = 0,
    ffn_mult: int = 1,
    transients: bool = False,
    lora: bool = False,
) -> dict:
    """One size of one case: the buckets' bytes (see the module docstring) and the measured shape; `transients`:
    the training step's peak too (the case's transient sizes); `lora`: the model frozen with LoRA adapters on the
    default targets (add_lora), what a LoRA run's backward needs."""
    torch.manual_seed(0)
    extra = {"vocab": case.transient_vocab} if transients and case.transient_vocab else {}
    model, width, ffn, vocab = case.build(heads or case.heads, ffn_mult, **extra)
    model = model.to(dtype).train()
    if lora:
        add_lora(model, dtype, case.lora_targets)
    blocks = case.block_lists(model)
    run = case.run(model, tokens, context, dtype)
    warm_up(run)
    record = {
        "tokens": case.pad(tokens),
        "context": case.pad(context),
        "width": width,
        "ffn": ffn,
        "vocab": vocab,
        "layers": {kind: len(modules) for kind, modules in blocks.items()},
    }
    checkpointed = []
    if case.checkpointing:
        _enable_checkpointing(model)
        ckpt, checkpointed = count_checkpointed(model, run, blocks, vocab)
        _disable_checkpointing(model)
    full = count_saved(model, run, blocks, vocab, checkpointed)
    record["forward"] = peak_bytes(run)  # one forward without gradients (samples): the most it holds at once
    per_block = {kind: full.block(kind) for kind in blocks}
    record["blocks"] = per_block
    record["outside"] = (
        full.outside
        + sum(full.blocks.values())
        - sum(per_block[kind] * len(modules) for kind, modules in blocks.items())
    )
    record["logits"] = full.logits
    record["total"] = full.total
    if case.checkpointing:
        inputs = {kind: ckpt.block(kind) for kind in blocks}
        record["ckpt_inputs"] = inputs
        record["ckpt_outside"] = (
            ckpt.outside
            + ckpt.checkpoint_inputs
            + sum(ckpt.blocks.values())
            - sum(inputs[kind] * len(modules) for kind, modules in blocks.items())
        )
        record["recompute"] = full.largest_module
        record["ckpt_total"] = (
            ckpt.outside + ckpt.checkpoint_inputs + sum(ckpt.blocks.values()) + full.largest_module + ckpt.logits
        )
    if transients:
        _measure_transients(case, model, run, record, vocab, full.logits)
    return record


def _measure_transients(case, model, run, record: dict, vocab: int, saved_logits: int) -> None:
    """The backward's transients: a training step's peak (step_peak: forward and backward, each weight's gradient
    dropped once accumulated) less the saved activations, at the moments the logits' gradients (an LM's) or the
    boolean attention masks (a block's) are alive and at the others (the step's peak is the larger), without and
    with checkpointing."""
    for prefix, total in (("", "total"), ("ckpt_", "ckpt_total")):
        if prefix and not case.checkpointing:
            continue
        if prefix:
            _enable_checkpointing(model)
        logits_moment, other_moment = step_peak(model, run, vocab, saved_logits)
        if prefix:
            _disable_checkpointing(model)
        record[f"{prefix}step_peak"] = max(logits_moment, other_moment)
        record[f"{prefix}transient_tagged"] = logits_moment - record[total]
        record[f"{prefix}transient"] = other_moment - record[total]


def _features(case, records, with_ffn: bool, with_mask: bool = False) -> list[str]:
    names = list(WIDTH_FEATURES) + (list(QUADRATIC_FEATURES) if case.quadratic else [])
    names += list(MASK_FEATURES) if with_mask and case.joint_mask else []
    if len({r["context"] for r in records}) == 1:  # a fixed context (a UNet's 77 CLIP tokens, an LM's none)
        names = [n for n in names if "C" not in n]
    if len({r["width"] for r in records}) > 1:  # measured at two widths: what does not grow with it, apart
        names += [n for n in WIDTH_FREE_TOKENS if n.upper() in names]
    if with_ffn:
        names += [n for n in FFN_FEATURES if not ("C" in n and "C" not in names)]
    return names


def _logit_features(case, plain: list) -> list[str]:
    """The logits' features: per token (and per context token where the context varies: a backbone's head over
    the transcript too), and a constant, or with `head_copy` the copied head's width x vocabulary."""
    return [n for n in ("T", "C") if n in plain] + ["head" if case.head_copy else "1"]


def _value(name: str, record: dict) -> float:
    t, c, f = record["tokens"], record["context"], record["ffn"]
    return {
        "T": t,
        "C": c,
        "t": t,
        "c": c,
        "1": 1,
        "TT": t * t,
        "CC": c * c,
        "TC": t * c,
        "fT": f * t,
        "fC": f * c,
        "f": f,
        "LL": (t + c) ** 2,
        "head": record["width"],
        "VT": record["vocab"] * t,
        "Vw": record["vocab"] * record["width"],
    }[name]


def fit(records: list, features: list, target) -> dict:
    """Least squares of target(record) on the features; width features per width unit (each record's width)."""

    def per_unit(name: str, record: dict) -> float:
        return 1 if name.startswith(WIDTH_FREE) else record["width"]

    matrix = torch.tensor([[_value(n, r) * per_unit(n, r) for n in features] for r in records], dtype=torch.float64)
    values = torch.tensor([[float(target(r))] for r in records], dtype=torch.float64)
    scale = matrix.abs().amax(dim=0).clamp(min=1.0)  # columns of one magnitude (a (T + C)^2 beside a constant)
    solution = (torch.linalg.lstsq(matrix / scale, values, driver="gelsd").solution[:, 0] / scale).tolist()
    return {n: round(v, 6) for n, v in zip(features, solution)}


def constants_for(case, dtype: torch.dtype) -> tuple[dict, list]:
    records = [measure(case, dtype, t, c) for t, c in case.sizes]
    if case.ffn:
        records += [measure(case, dtype, t, c, ffn_mult=2) for t, c in case.sizes]
    plain, with_ffn = _features(case, records, False), _features(case, records, case.ffn, with_mask=True)
    kinds = list(records[0]["blocks"])
    table = {
        "outside": fit(records, plain, lambda r: r["outside"]),
        "blocks": {k: fit(records, with_ffn, lambda r, k=k: r["blocks"][k]) for k in kinds},
        "forward": fit(records, with_ffn, lambda r: r["forward"]),
    }
    if records[0]["vocab"]:
        table["logits"] = {
            n: v * records[0]["width"] / records[0]["vocab"]
            for n, v in fit(records, _logit_features(case, plain), lambda r: r["logits"]).items()
        }
    if case.transients:
        table.update(transient_constants(case, dtype))
    if case.checkpointing:
        table["ckpt_outside"] = fit(records, plain, lambda r: r["ckpt_outside"])
        table["ckpt_inputs"] = {k: fit(records, plain, lambda r, k=k: r["ckpt_inputs"][k]) for k in kinds}
        table["recompute"] = fit(records, with_ffn, lambda r: r["recompute"])
    return table, records


def lora_constants(case) -> Optional[dict]:
    """Under LoRA: the saved activations' buckets (outside, per block, with checkpointing the inputs and the
    recomputed module) fitted as the full fine-tuning ones, with the model frozen and adapted (add_lora) on the
    case's targets (the family's defaults: the diffusers attention's, a causal LM's attention projections; or the
    model's own), at the case's LoRA widths (Case.lora_widths), in bf16 and, for a case the unit test checks in fp32
    (the UNets), in fp32 too; None for a model without those targets (its LoRA runs are planned with the full
    figures)."""
    model = case.build(case.heads, 1)[0]
    names = [name for name, _ in model.named_modules()]
    if not any(name.endswith("." + target) for name in names for target in case.lora_targets):
        return None
    tables = {name: _lora_table(case, DTYPES[name]) for name in dict.fromkeys(("bf16", case.check_precision))}
    return {"rank": LORA_RANK, "targets": list(case.lora_targets), **tables}


def _lora_table(case, dtype: torch.dtype) -> dict:
    records = [
        measure(case, dtype, t, c, heads=times * case.heads, lora=True)
        for times in case.lora_widths
        for t, c in case.sizes
    ]
    if case.ffn:
        records += [measure(case, dtype, t, c, ffn_mult=2, lora=True) for t, c in case.sizes]
    plain, with_ffn = _features(case, records, False), _features(case, records, case.ffn, with_mask=True)
    kinds = list(records[0]["blocks"])
    table = {
        "outside": fit(records, plain, lambda r: r["outside"]),
        "blocks": {k: fit(records, with_ffn, lambda r, k=k: r["blocks"][k]) for k in kinds},
    }
    if records[0]["vocab"]:
        table["logits"] = {
            n: v * records[0]["width"] / records[0]["vocab"]
            for n, v in fit(records, _logit_features(case, plain), lambda r: r["logits"]).items()
        }
    if case.checkpointing:
        table["ckpt_outside"] = fit(records, plain, lambda r: r["ckpt_outside"])
        table["ckpt_inputs"] = {k: fit(records, plain, lambda r, k=k: r["ckpt_inputs"][k]) for k in kinds}
        table["recompute"] = fit(records, with_ffn, lambda r: r["recompute"])
    return table


def transient_constants(case, dtype: torch.dtype) -> dict:
    """The backward's transients, fitted at the case's transient sizes: per bucket as the blocks' (a mask's
    (T + C)^2 bytes where the case has one), and per vocabulary entry per token and per width (the logits'
    gradients, the head's and embedding's gradient parts); and, where it has masks, its forward there."""
    heads = case.transient_heads or case.heads
    widths = (1, 2) if case.transient_vocab else (1,)  # an LM's: what grows with the width apart from the vocabulary
    records = [
        measure(case, dtype, t, c, heads=width * heads, transients=True)
        for width in widths
        for t, c in case.transient_sizes
    ]
    features = _features(case, records, False, with_mask=True)
    # a forward pass without gradients, at these long sequences too: where the masks dominate it (an LM's logits,
    # which these features do not have, keep the regular sizes' fit)
    table = {} if records[0]["vocab"] else {"forward": fit(records, features, lambda r: r["forward"])}
    for prefix in ("", "ckpt_") if case.checkpointing else ("",):
        table[f"{prefix}transients"] = fit(records, features, lambda r: r[f"{prefix}transient"])
        tagged = lambda r: r[f"{prefix}transient_tagged"]  # noqa: E731
        if records[0]["vocab"]:  # per token and width, per token and vocabulary entry, per vocabulary and width
            table[f"{prefix}logit_transients"] = fit(records, ["T", "1", "VT", "Vw"], tagged)
        else:  # the moments a block's boolean masks are alive
            table[f"{prefix}mask_transients"] = fit(records, features, tagged)
    return table


def _write(models: dict) -> None:
    document = {
        "about": "bytes autograd keeps for backward per training sample, measured by "
        "bench/activation_table.py (docs/memory.md); do not edit by hand",
        "versions": {
            "torch": torch.__version__.split("+")[0],
            "diffusers": _version("diffusers"),
            "transformers": _version("transformers"),
        },
        "models": dict(sorted(models.items())),
    }
    CONSTANTS_FILE.write_text(json.dumps(document, indent=1) + "\n")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main(keys: list[str]) -> None:
    """`--lora`: only the LoRA tables (the full fine-tuning ones stay as stored)."""
    lora_only = "--lora" in keys
    keys = [key for key in keys if key != "--lora"]
    stored = json.loads(CONSTANTS_FILE.read_text()) if CONSTANTS_FILE.exists() else {}
    models = stored.get("models", {})
    rows = []
    for case in [CASES_BY_KEY[k] for k in keys] if keys else CASES:
        started = time.monotonic()
        entry = (
            models[case.key] if lora_only else {"title": case.title, "checkpointing": case.checkpointing, **case.extra}
        )
        lora = lora_constants(case)
        entry.pop("lora", None)
        if lora is not None:
            entry["lora"] = lora
        for name, dtype in () if lora_only else DTYPES.items():
            table, records = constants_for(case, dtype)
            entry[name] = table
            first = records[0]
            entry["measured"] = {
                "heads": case.heads,
                "width": first["width"],
                "ffn": first["ffn"],
                "vocab": first["vocab"],
                "layers": first["layers"],
                "sizes": [list(s) for s in case.sizes],
            }
            rows.append([case.key, name, first["total"], first.get("ckpt_total", "-")])
        models[case.key] = entry
        _write(models)  # after each model: a long run that stops keeps what it measured
        print(f"{case.key}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    print_table(
        "activation bytes at each model's first measured size", ["model", "dtype", "bytes", "checkpointed"], rows
    )
    print_json("activation_table", {"models": sorted(models)})


if __name__ == "__main__":
    main(sys.argv[1:])
