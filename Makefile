# `make demo` and `make test` each set up .venv by themselves (quick when it is up to date).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-block demo-routing test test-all parity models mutants lint bench bench-quick bench-train bench-capacity bench-packed bench-other bench-report gpu-check clean

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
	$(PY) -m pytest -q -m "not slow" --durations=30

# the suite with its long cases (compiled training, a second main job per layout, ...)
test-all: $(STAMP)
	$(PY) -m pytest -q

parity: $(STAMP)
	$(PY) -m pytest -q parity_tests/transport/test_parity.py parity_tests/transport/test_parity_layouts.py

# every causal-LM family of the pinned transformers against one process; writes docs/models.md
models: $(STAMP)
	$(PY) -m tools.model_sweep

mutants: $(STAMP)
	$(PY) -m tools.mutations

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# every bench target writes its JSON (stamped with the commit and the machine) to docs/results/ and its
# plot to docs/, then `make bench-report` rewrites docs/benchmarks.md's figures from those files
RESULTS := docs/results
REPORT := $(PY) -m benchmarks.report

bench: $(STAMP)
	$(PY) -m benchmarks.cp_bench --json $(RESULTS)/bench.json --plot docs/bench.png
	$(REPORT)

bench-quick: $(STAMP)
	$(PY) -m benchmarks.cp_bench --quick

bench-train: $(STAMP)
	$(PY) -m benchmarks.train_bench --json $(RESULTS)/bench_train.json --plot docs/bench_train.png
	$(REPORT)

bench-capacity: $(STAMP)
	$(PY) -m benchmarks.rank_capacity --json $(RESULTS)/rank_capacity.json --plot docs/rank_capacity.png
	$(PY) -m benchmarks.rank_capacity --model deepseek_v32 --variants alone,torch_impl \
		--json $(RESULTS)/rank_capacity_dsa.json --plot docs/rank_capacity_dsa.png
	for model in qwen3_5 mamba2 minimax; do \
		$(PY) -m benchmarks.rank_capacity --model $$model --lens 1024,4096 --reps 2 --layers 3 --hidden 1024 \
			--json $(RESULTS)/rank_capacity_$$model.json --plot docs/rank_capacity_$$model.png || exit 1; \
	done
	$(PY) -m benchmarks.rank_capacity --model deepseek_v4 --lens 1024,4096 --reps 2 --topk 512 \
		--json $(RESULTS)/rank_capacity_deepseek_v4.json --plot docs/rank_capacity_deepseek_v4.png
	for model in gemma2 gpt_oss; do \
		$(PY) -m benchmarks.rank_capacity --model $$model --lens 4096 --reps 2 --variants alone,torch_impl \
			--json $(RESULTS)/rank_capacity_$$model.json --plot out/rank_capacity_$$model.png || exit 1; \
	done
	$(REPORT)

bench-packed: $(STAMP)
	$(PY) -m benchmarks.packed_rows --json $(RESULTS)/packed_rows.json
	$(PY) -m benchmarks.packed_rows --mixes short --ranks all --variants torch_impl --json $(RESULTS)/packed_ranks.json
	$(REPORT)

# the Trainer / SFTTrainer with the mixin against without; per-rank work under both layouts; the main
# job's figures (make demo, writing its metrics); DeepSeek Sparse Attention's bytes; the inputs check
bench-other: $(STAMP)
	$(PY) -m benchmarks.trainer_cost --json $(RESULTS)/trainer_cost.json
	$(PY) -m benchmarks.dpo_cost --json $(RESULTS)/dpo_cost.json
	$(PY) -m benchmarks.grpo_cost --json $(RESULTS)/grpo_cost.json
	$(PY) -m benchmarks.layout_balance --json $(RESULTS)/layout_balance.json --plot docs/layout_balance.png
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 -m examples.train --cp 4 --reference \
		--metrics $(RESULTS)/demo.json --figure docs/loss_curves.png
	$(PY) -m benchmarks.dsa_bytes --json $(RESULTS)/dsa_bytes.json
	$(PY) -m benchmarks.dsa_bytes --coverage --json $(RESULTS)/dsa_coverage.json
	$(PY) -m benchmarks.inputs_check --json $(RESULTS)/inputs_check.json
	$(PY) -m benchmarks.media_cost --json $(RESULTS)/media_cost.json
	$(PY) -m benchmarks.media_memory --json $(RESULTS)/media_memory.json
	$(REPORT)

bench-report: $(STAMP)
	$(REPORT)

# on a GPU node, with its own python and torch (no .venv: such nodes may reach no package registry)
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) out
