"""What the libraries dstune runs on may print: quiet unless the user asks for it with `--verbose`.

Without --verbose, these lines are dropped, each at its source and nothing else:
  - DeepSpeed's INFO records (logger "DeepSpeed"; its configuration dumps, launcher and engine notes): a filter on
    that logger, which survives DeepSpeed setting the logger's level when it is imported. Its warnings and errors
    still print.
  - bitsandbytes' import-time notices (loggers under "bitsandbytes", e.g. that it could not fetch an optional CPU
    gemm_4bit_forward kernel from the hub): below ERROR.
  - FutureWarnings and DeprecationWarnings attributed to the libraries' own modules (torch, DeepSpeed, diffusers,
    transformers, peft, bitsandbytes, ...: one library calling another's deprecated API). The same warnings raised
    from dstune's code, and every other warning, still print.
  - transformers' logged notices that a name it still accepts is deprecated, or that it falls back to an image
    processor without torchvision (below ERROR; a filter on its library logger's handler, set when it is imported).
  - On a training rank, torch's C++ warnings (TORCH_CPP_LOG_LEVEL=ERROR unless set: c10d's "retrying ...
    Interrupted system call" with its stack frames when a stop signal comes while the ranks meet) and DeepSpeed's
    note that it built its CPU communication op, which each rank prints, and the progress bar zero_to_fp32 draws
    over a checkpoint's shards on every export (`without_library_prints`).
With --verbose, DeepSpeed logs at INFO and nothing is filtered. Torch-free: nothing here imports a library.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings

# The third-party packages whose deprecation notices are about their own internals, not about the user's spec.
LIBRARY_PACKAGES = (
    "torch",
    "deepspeed",
    "diffusers",
    "transformers",
    "huggingface_hub",
    "peft",
    "bitsandbytes",
    "accelerate",
    "torchvision",
    "torchaudio",
    "snac",
    "av",
)
LIBRARY_MODULES = re.compile(r"(%s)(\.|$)" % "|".join(re.escape(name) for name in LIBRARY_PACKAGES))
DEEPSPEED_LOGGER = "DeepSpeed"


class _DropBelow(logging.Filter):
    """Drops a logger's records below `level` whatever level the library later sets on it."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


_QUIET_DEEPSPEED = _DropBelow(logging.WARNING)
_verbose = False


def set_library_verbosity(verbose: bool) -> None:
    """Call once at the start of a command, before the libraries are imported (it works after too)."""
    global _verbose
    _verbose = verbose
    deepspeed_logger = logging.getLogger(DEEPSPEED_LOGGER)
    if verbose:
        deepspeed_logger.removeFilter(_QUIET_DEEPSPEED)
        logging.getLogger("bitsandbytes").setLevel(logging.NOTSET)
        for handler in logging.getLogger("transformers").handlers:
            handler.removeFilter(_QUIET_DEPRECATIONS)
        _after_import("deepspeed.utils.logging", _deepspeed_at_info)
        return
    deepspeed_logger.addFilter(_QUIET_DEEPSPEED)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARY_MODULES.pattern)
    _after_import(TRANSFORMERS_LOGGING, _quiet_transformers_deprecations)


# transformers' notices about its own API and its optional backends, below ERROR: "`past_key_values` ... are
# deprecated. Use `cache` instead." (every codec-token LM run), "`CLIPImageProcessor` requires torchvision (not
# installed); falling back to `CLIPImageProcessorPil`" (every rank of an image run, where the fallback is what dstune
# uses anyway). Not about the user's spec.
TRANSFORMERS_NOTICES = re.compile(r"deprecat|requires torchvision \(not installed\); falling back", re.I)


class _DropDeprecationNotices(logging.Filter):
    """transformers' TRANSFORMERS_NOTICES (a filter on its library logger's handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not TRANSFORMERS_NOTICES.search(record.getMessage())


_QUIET_DEPRECATIONS = _DropDeprecationNotices()
TRANSFORMERS_LOGGING = "transformers.utils.logging"


def _quiet_transformers_deprecations() -> None:
    """transformers' modules log through its library logger's own handler (made by its first get_logger): the
    filter goes on that handler."""
    if _verbose:
        return
    sys.modules[TRANSFORMERS_LOGGING].get_logger()
    for handler in logging.getLogger("transformers").handlers:
        if _QUIET_DEPRECATIONS not in handler.filters:
            handler.addFilter(_QUIET_DEPRECATIONS)


def quiet_native_warnings(verbose: bool) -> None:
    """On a training rank, before torch is imported: torch's C++ warnings at ERROR (its own variable, read when its
    library loads; a value the user set is kept)."""
    if not verbose:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


# Lines a library prints (not logs) that say nothing a user acts on, dropped by `without_library_prints`: DeepSpeed's
# note on loading its CPU comm op (each rank), and zero_to_fp32's progress bars over the shards (each export; ZeRO-3
# checkpoints gather their partitions with a second bar).
LIBRARY_PRINTS = re.compile(
    r"^DeepSpeed \S+ built successfully$|Loading checkpoint shards: |Gathering sharded weights: "
)


@contextlib.contextmanager
def without_library_prints(stream: str = "stdout"):
    """Around a library call that prints notes or progress bars to `stream` ("stdout" or "stderr"): what it prints
    there is held and given back without the LIBRARY_PRINTS lines (all of it with --verbose, or when the call
    fails)."""
    if _verbose:
        yield
        return
    held = io.StringIO()
    redirect = contextlib.redirect_stdout if stream == "stdout" else contextlib.redirect_stderr
    target = sys.stdout if stream == "stdout" else sys.stderr
    try:
        with redirect(held):
            yield
    except BaseException:
        target.write(held.getvalue())
        raise
    lines = held.getvalue().splitlines(keepends=True)
    kept = [line for line in lines if not LIBRARY_PRINTS.search(line.strip())]
    if len(kept) < len(lines):  # the bars' own line ends go with them
        kept = [line for line in kept if line.strip()]
    target.write("".join(kept))


def library_logs_verbose() -> bool:
    """Whether --verbose was given: dstune's own silencing of DeepSpeed (while it parses a config) then stays off."""
    return _verbose


def _deepspeed_at_info() -> None:
    """DeepSpeed sets its logger to WARNING when it is first imported; --verbose wants its INFO lines."""
    module = sys.modules["deepspeed.utils.logging"]
    module.logger.setLevel(logging.INFO)
    for handler in module.logger.handlers:
        handler.setLevel(logging.INFO)


def _after_import(name: str, then) -> None:
    """Run `then()` now if module `name` is loaded, else right after it first executes (importing it here would
    load torch)."""
    if name in sys.modules:
        then()
        return
    if not any(isinstance(finder, _AfterImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport:
    """An import hook for one module: runs `then()` once the module has executed."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            self.then()

        spec.loader.exec_module = exec_then
        return spec
