# `make demo` and `make test` each set up .venv by themselves (quick when it is up to date).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-block demo-routing test test-all parity models mutants lint bench bench-quick bench-train bench-capacity bench-packed gpu-check clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 -m examples.train --cp 4 --reference

demo-block: $(STAMP)
	$(PY) -m examples.demo

demo-routing: $(STAMP)
	$(PY) -m examples.routing_table

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# the suite with its long cases (compiled training, a second main job per layout, ...)
test-all: $(STAMP)
	$(PY) -m pytest -q

parity: $(STAMP)
	$(PY) -m pytest -q parity_tests/test_parity.py parity_tests/test_parity_layouts.py

# every causal-LM family of the pinned transformers against one process; writes docs/models.md
models: $(STAMP)
	$(PY) -m parity_tests.model_sweep

mutants: $(STAMP)
	$(PY) -m parity_tests.mutations

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) -m benchmarks.cp_bench

bench-quick: $(STAMP)
	$(PY) -m benchmarks.cp_bench --quick

bench-train: $(STAMP)
	$(PY) -m benchmarks.train_bench

bench-capacity: $(STAMP)
	$(PY) -m benchmarks.rank_capacity
	$(PY) -m benchmarks.rank_capacity --model deepseek_v32 --variants alone,torch_impl \
		--json out/rank_capacity_dsa.json --plot out/rank_capacity_dsa.png
	$(PY) -m benchmarks.rank_capacity --model qwen3_5 --lens 1024,4096 --reps 2 --layers 3 --hidden 1024 \
		--json out/rank_capacity_qwen3_5.json --plot out/rank_capacity_qwen3_5.png
	$(PY) -m benchmarks.rank_capacity --model mamba2 --lens 1024,4096 --reps 2 --layers 3 --hidden 1024 \
		--json out/rank_capacity_mamba2.json --plot out/rank_capacity_mamba2.png
	for model in gemma2 gpt_oss; do \
		$(PY) -m benchmarks.rank_capacity --model $$model --lens 4096 --reps 2 --variants alone,torch_impl \
			--json out/rank_capacity_$$model.json --plot out/rank_capacity_$$model.png || exit 1; \
	done

bench-packed: $(STAMP)
	$(PY) -m benchmarks.packed_rows
	$(PY) -m benchmarks.packed_rows --mixes short --ranks all --variants torch_impl --json out/packed_ranks.json

# on a GPU node, with its own python and torch (no .venv: such nodes may reach no package registry)
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) out
