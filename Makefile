# The two commands of README.md, and the pieces they are made of.
#   make run    set up, build, run fsdpd in the foreground on its embedded defaults
#   make test   set up, build, pass every test
BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc)
# Warnings are errors in CI (CI=true) and wherever FSDP_WERROR=ON is asked for.
FSDP_WERROR ?= $(if $(CI),ON,OFF)
CMAKE_ARGS ?=

CTEST = ctest --output-on-failure --no-tests=error -j$(JOBS)

.PHONY: all setup setup-test build run test test-asan test-faults bench clean

all: build

setup:
	@scripts/setup.sh

# What the tests need beyond the build: systemd's tools and python3-venv from Debian, then
# .venv/ with python/requirements-test.txt (grpcio, protobuf, pytest, PyTorch 2.13).
PYTHON = .venv/bin/python
setup-test:
	@scripts/setup.sh --test
	@scripts/venv.sh

build: setup
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFSDP_WERROR=$(FSDP_WERROR) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

run: build
	$(BUILD)/bin/fsdpd

test: setup-test build
	cd $(BUILD) && $(CTEST)

# The same suite built with AddressSanitizer and UndefinedBehaviorSanitizer.
test-asan: setup-test
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DFSDP_SANITIZE=ON -DFSDP_WERROR=$(FSDP_WERROR) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(ASAN_BUILD) -j$(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitizers/lsan.supp \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(CTEST)

# The fault matrix (tests/faults/, docs/RELIABILITY.md): each row FAULT_RUNS times in a row,
# each under an external deadline. Longer than the default suite, so apart from it.
FAULT_RUNS ?= 10
test-faults: setup-test build
	FSDP_BUILD_DIR=$(CURDIR)/$(BUILD) tests/faults/run.sh $(FAULT_RUNS)

bench: build
	$(BUILD)/bin/fsdp-rpc-bench

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)

# Train a small transformer with 2 trainer processes through a fresh fsdpd (examples/):
# the loss per step, then fsdpctl status and units.
.PHONY: demo
demo: setup-test build
	$(PYTHON) examples/demo.py --build $(BUILD)

# A training step and the bytes each system holds for the model: fsdpd (with the trainers'
# torch AdamW, and with the daemon's, fsdpd+opt) against FSDP2 and DDP over gloo, interleaved
# in the same runs, medians of 3, at L = 2, 4 and 8 (bench/train_bench.py; results in
# docs/PERFORMANCE.md). The matrix is four commands, one per model and param dtype, each a
# target of its own, since the whole takes more than an hour on 2 cores; bench-train runs
# the four one after the other. Each writes its JSON to $(BUILD)/train_bench/MODEL-DTYPE.json
# besides the text report. `make bench` covers the daemon alone.
TRAIN_BENCH_MATRIX = bench-fp32 bench-bf16 blocks24-fp32 blocks24-bf16
TRAIN_BENCH_STEPS_bench = --steps 20 --warmup 3
TRAIN_BENCH_STEPS_blocks24 = --steps 10 --warmup 2
.PHONY: bench-train $(addprefix bench-train-,$(TRAIN_BENCH_MATRIX))
bench-train:
	@$(foreach m,$(TRAIN_BENCH_MATRIX),$(MAKE) --no-print-directory bench-train-$(m) &&) true

$(addprefix bench-train-,$(TRAIN_BENCH_MATRIX)): bench-train-%: setup-test build
	$(PYTHON) bench/train_bench.py --build $(BUILD) --ranks 2 4 8 --repeat 3 \
	  --model $(word 1,$(subst -, ,$*)) --param-dtype $(word 2,$(subst -, ,$*)) \
	  $(TRAIN_BENCH_STEPS_$(word 1,$(subst -, ,$*))) --json-out $(BUILD)/train_bench/$*.json

# The bytes alone, against the FSDP memory model: the 24-block model at L = 2, 4 and 8, fp32
# and bf16, fsdpd, fsdpd+opt, FSDP2 and DDP, one run of 3 steps each (the accounted bytes
# are exact and repeat from run to run; the step times of this target mean nothing; results
# in docs/PERFORMANCE.md).
.PHONY: bench-train-memory
bench-train-memory: setup-test build
	$(foreach d,fp32 bf16,$(PYTHON) bench/train_bench.py --build $(BUILD) --model blocks24 \
	  --ranks 2 4 8 --systems fsdpd fsdpd+opt FSDP2 DDP --steps 3 --warmup 1 \
	  --param-dtype $(d) &&) true

# The daemon's AdamW step against its memory-traffic bound and torch.optim.AdamW (foreach off
# and on) on shards of 1, 16 and 256 MiB (bench/optim_torch.py; results in docs/PERFORMANCE.md).
.PHONY: bench-optim
bench-optim: setup-test build
	$(PYTHON) bench/optim_torch.py --build $(BUILD)

# Status, a health Check and a trainer's Unshard under each flood a local user can send, against
# the same calls without it in the same run (bench/flood_bench.py; results in docs/PERFORMANCE.md).
.PHONY: bench-floods
bench-floods: setup-test build
	$(PYTHON) bench/flood_bench.py --build $(BUILD)

# The ring collectives between hosts, timed between member processes on this machine over
# UCX tcp and shared memory, against ucx_perftest and OpenMPI (bench/ucx_bench.c; results in
# docs/PERFORMANCE.md). Setup comes first so that CMake finds MPI when it configures.
.PHONY: bench-collectives
bench-collectives:
	@scripts/setup.sh --bench
	@$(MAKE) --no-print-directory build
	$(BUILD)/bin/fsdp-ucx-bench --members 2 --pin
	$(BUILD)/bin/fsdp-ucx-bench --members 3
