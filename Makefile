# dstune: make install | test | demo | ds-configs | docs
# Python 3.11 is what CI uses. torch is installed first, pinned, so pip never picks a build for you.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install test lint format demo ds-configs validate-json golden-losses docs check-generated

install:
	@$(PYTHON) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
		|| $(PIP) torch==$(TORCH_VERSION)
	@$(PYTHON) -c "import dstune.cli, pytest, xdist, hypothesis, av, snac, peft, ftfy, ruff, schedulefree, prodigyopt" 2>/dev/null && $(PYTHON) -m pip show --quiet dstune >/dev/null 2>&1 \
		|| $(PIP) -e '.[test]'

# Two pytest workers (pytest-xdist), each running whole test modules (--dist loadfile: a module's shared launches
# stay in one process): one 2-rank launch leaves a core idle much of its time (imports, rank 0 saving and exporting
# while rank 1 waits), so two modules overlap well even on 2 cores. TEST_JOBS=1 runs everything in one process.
# pytest exits 5 when a folder holds no tests yet (tests/dist before the training issue); that is not a failure.
TEST_JOBS ?= 2
test: install lint
	@$(PYTHON) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15 tests/unit tests/dist; status=$$?; \
		$(PYTHON) tests/tools/size_report.py; \
		if [ $$status -eq 5 ]; then echo "(no tests collected)"; exit 0; fi; exit $$status

# Lint and formatting (ruff, configured in pyproject.toml): the checks that find real mistakes (unused or undefined
# names, syntax), and `ruff format --check`: one layout for every file, so module sizes follow concepts, not
# hand-wrapping (`make format` rewrites the files; the one formatting commit is in .git-blame-ignore-revs).
lint: install
	@$(PYTHON) -m ruff check dstune tests bench
	@$(PYTHON) -m ruff format --check --quiet dstune tests bench || { echo "run 'make format' (ruff format)"; exit 1; }

format: install
	@$(PYTHON) -m ruff format dstune tests bench

# The demo: validate, then really train the built-in tiny model on the built-in shapes with 2 ranks (on the CPU
# where there is no GPU), export it, and write sample grids before, during and after training. Each run gets a
# fresh folder, so nothing of an earlier demo is overwritten.
DEMO_RANKS ?= 2
DEMO_DIR ?= runs/sd-tiny-demo-$(shell date +%Y%m%d-%H%M%S)
demo: install
	$(PYTHON) -m dstune validate launch/sd-tiny-demo.yaml --num-gpus $(DEMO_RANKS)
	$(PYTHON) -m dstune train launch/sd-tiny-demo.yaml --num-gpus $(DEMO_RANKS) --set output.dir=$(DEMO_DIR)
	@echo "demo finished: samples in $(DEMO_DIR)/samples (step-000000.png is before training), model in $(DEMO_DIR)/export"

# The golden DeepSpeed JSON of every example spec, compiled with the flags on the spec's first line
# ("# validate: dstune validate launch/X.yaml FLAGS"). tests/unit/test_launch_specs.py diffs them.
ds-configs:
	@for spec in $$(find launch -name '*.yaml' | sort); do \
		flags=$$(sed -n '1s/^# validate: dstune validate [^ ]* *//p' $$spec); \
		$(PYTHON) -m dstune compile $$spec $$flags -o ds_configs/$$(basename $$spec .yaml).json 2>/dev/null \
			|| { $(PYTHON) -m dstune validate $$spec $$flags; exit 1; }; \
		echo "ds_configs/$$(basename $$spec .yaml).json  <-  $$spec $$flags"; \
	done

# The golden `dstune validate --json` of every example spec (same flags as ds-configs), which
# tests/unit/test_launch_specs.py diffs. An empty Hugging Face cache: parameter counts always come from the configs
# stored with dstune, never from whatever this machine downloaded.
validate-json:
	@mkdir -p tests/data/validate_json; empty=$$(mktemp -d); \
	for spec in $$(find launch -name '*.yaml' | sort); do \
		flags=$$(sed -n '1s/^# validate: dstune validate [^ ]* *//p' $$spec); \
		HF_HUB_CACHE=$$empty $(PYTHON) -m dstune validate $$spec $$flags --json \
			> tests/data/validate_json/$$(basename $$spec .yaml).json 2>/dev/null \
			|| { rmdir $$empty; $(PYTHON) -m dstune validate $$spec $$flags; exit 1; }; \
		echo "tests/data/validate_json/$$(basename $$spec .yaml).json  <-  $$spec $$flags"; \
	done; rmdir $$empty

# The pinned 20-step float64 loss trajectory of every built-in model (tests/data/golden_losses.json), which
# tests/unit/test_golden_losses.py compares to 1e-8. Only for an intended numerics change: say so in the commit.
golden-losses:
	PYTHONPATH=$(CURDIR) $(PYTHON) tests/unit/test_golden_losses.py --regenerate

docs:
	$(PYTHON) -m dstune.reference > docs/spec-reference.md
	@echo "docs/spec-reference.md regenerated from dstune/spec/models.py"
