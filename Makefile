# make tour:           run every notebook on this machine (the CPU stands in for a TPU slice)
# make test:           pytest + nbval over the committed notebooks (8 devices). Its twelve parts run two
#                      at a time (TEST_PARTS below). On a TPU VM: the TPU plan (below).
# make check-variants: what CI leaves out: nbval on another instruction set with one thread,
#                      the device-count tests at 1, 4 and 16 devices, every notebook on 1 and 16 devices
#                      and on 4 in bf16 (what a v4-8 / v5e-4 TPU VM runs by default), the tests in bf16
#                      (those the default dtype reaches), and the tests marked `variants` (make test
#                      deselects them)
# All create .venv from pyproject.toml on first use.
PY := .venv/bin/python
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
EXECUTE := $(PY) -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=1800
NBVAL := $(PY) -m pytest -q --durations=15 --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg \
	--nbval-cell-timeout=1800
export TF_CPP_MIN_LOG_LEVEL := 2
comma := ,

# The interpreter that creates .venv: PYTHON=..., else the first of these that runs and is 3.11 or newer
# (Transformers 5 and FastAPI need it). Each is run, not just looked up: a pyenv shim can exist and fail.
PYTHON_CANDIDATES := python3 python3.13 python3.12 python3.11
PYTHON ?= $(firstword $(foreach p,$(PYTHON_CANDIDATES),\
	$(shell $(p) -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && echo $(p))))
NO_PYTHON := no Python 3.11 or newer here (tried $(PYTHON_CANDIDATES)). On a TPU VM (Ubuntu 22.04): \
	sudo apt-get install -y python3.11 python3.11-venv, then make again; or PYTHON=/path/to/python3.11 make; \
	or conda env create -f environment.yml
# A TPU VM (chips at /dev/accel* on v2-v4, /dev/vfio/N from v5e on), or TPU=1 to force it: .venv gets the
# 'tpu' extra (libtpu), and make test runs the TPU plan.
TPU ?= $(if $(wildcard /dev/accel* /dev/vfio/[0-9]*),1)
EXTRAS := dev,scan,log$(if $(TPU),$(comma)tpu)
# pytest on the CPU stand-in compiles XLA:CPU programs without LLVM's optimizations: a test compiles many
# programs and runs each a few times (measured: a training test 49 -> 31 s). Not the notebooks, which run
# theirs many times (measured, one at a time: the eleven took 890 s at level 0, 814 s at XLA's default; a
# training step 0.41 s against 0.28 s), nor on a TPU, nor over an XLA_FLAGS you set.
PYTEST := $(if $(TPU)$(XLA_FLAGS),,XLA_FLAGS=--xla_backend_optimization_level=0 )$(PY) -m pytest
# make test, check-variants and the tour run two parts at a time on two cores: PyTorch's CPU ops get one
# thread in each (its threads waiting on a core the other part holds made a 2 s test take 82 s in CI).
# ($(MAKE) stays in the recipes: make -n runs only lines that name it.)
ONE_THREAD := OMP_NUM_THREADS=1

.PHONY: test tour notebooks check-variants clean

.venv/installed: pyproject.toml
	$(if $(wildcard $(PY)),,$(or $(PYTHON),$(error $(NO_PYTHON))) -m venv .venv)
	$(PY) -m pip install -e '.[$(EXTRAS)]'
	# torch_xla 2.9's wheel carries an older torchax (it imports flax) that replaces the scan extra's
	# whenever pip installs torch_xla after it; put torchax 0.0.7 back.
	$(PY) -m pip install --no-deps --force-reinstall torchax==0.0.7
	touch $@

# The variables a notebook run gets, beside the exported TF_CPP_MIN_LOG_LEVEL: where it writes its
# checkpoints (LLAMA_XLA_OUTPUTS: folder $(1)) and figures (LLAMA_XLA_FIGURES: $(2), else $(1)/figures). The
# tour and every run in make test use this and nothing else, so they run the notebooks as a reader does (a
# plain Jupyter sets neither: the notebooks then write under outputs/ and save no figures);
# tests/test_makefile.py checks it.
notebook_env = LLAMA_XLA_OUTPUTS=$(CURDIR)/$(1) LLAMA_XLA_FIGURES=$(CURDIR)/$(or $(2),$(1)/figures)

# Execute notebooks $(3) (default: all) into folder $(1) (asserts must hold; outputs are not compared),
# the notebooks' checkpoints and figures there too. $(2): variables added to the tour's, only what the run
# varies: the device count (CPU_NUM_DEVICES), and for the bf16 run its count and dtype.
define execute_all
	$(TIMED) mkdir -p $(1) && for nb in $(or $(3),$(NOTEBOOKS)); do echo "$$nb $(2)"; \
		$(2) $(call notebook_env,$(1)) $(EXECUTE) --log-level=ERROR --output-dir $(1) $$nb || exit 1; done
endef
# Put in front of a part's one command line: prints the part's wall time when it ends, whatever its status.
TIMED = @start=$$(date +%s); trap 'echo "$@: $$(($$(date +%s) - start)) s"' EXIT;

# pytest in nine processes: XLA:CPU keeps every program it compiled mapped (tens to thousands of memory
# regions each: a training step attending in blocks about 1,800), and a process past the kernel's
# vm.max_map_count (65,530 here) crashes, a segfault or an abort in whichever test crosses it. Measured at
# 8 devices: test_attention_training.py 51k regions alone, test_engine.py 27k, the rest of test_[a-f] 25k,
# test_[g-r] 40k; test_tokenizer.py with test_train.py's first 23 tests 56k. The files that compile most
# get a process each; conftest.py stops a process before a test that could cross the limit, naming this.
TESTS_OWN := tests/test_loop.py tests/test_engine.py tests/test_train.py tests/test_attention_training.py \
	tests/test_scan.py
TESTS_a := $(filter-out $(TESTS_OWN),$(sort $(wildcard tests/test_[a-f]*.py)))
TESTS_b := $(filter-out $(TESTS_OWN),$(sort $(wildcard tests/test_[g-r]*.py)))
TESTS_c := $(filter-out $(TESTS_OWN),$(sort $(wildcard tests/test_s*.py)))
TESTS_d := $(filter-out $(TESTS_OWN),$(sort $(wildcard tests/test_[t-z]*.py)))
# One part per file of TESTS_OWN, named after it (test-pytest-loop runs tests/test_loop.py).
OWN := $(TESTS_OWN:tests/test_%.py=%)
$(foreach f,$(OWN),$(eval TESTS_$(f) := tests/test_$(f).py))
# The longest first (measured in make test, 2026-11-28 / 2026-11-29, a slow day for this VM: a 278 / 410 s,
# b 246 / 389, d 179 / 268, engine 136 / 270, loop 114 / 161, c 105 / 192, train 70 / 149,
# attention_training 38 / 55, scan 28 / 44).
PYTEST_PARTS := $(addprefix test-pytest-,a b d engine loop c train attention_training scan)

# nbval in three processes, each a group of notebooks with its own output folder; a notebook whose
# checkpoint others read runs before them in their group (04, 05, 06 and 06b read 03's). Measured in make test
# (beside another part, 2026-11-28, before 06's split / 2026-11-29, a slow day): 03-06b 680 / 1173 s,
# the rest 352 / 525 s, 01, 02 and 09 266 / 389 s.
NBVAL_GROUPS := 03 09 rest
NBVAL_03 := $(filter notebooks/03_% notebooks/04_% notebooks/05_% notebooks/06_% notebooks/06b_%,$(NOTEBOOKS))
NBVAL_09 := $(filter notebooks/01_% notebooks/02_% notebooks/09_%,$(NOTEBOOKS))
NBVAL_rest := $(filter-out $(NBVAL_03) $(NBVAL_09),$(NOTEBOOKS))
NBVAL_PARTS := $(NBVAL_GROUPS:%=test-nbval-%)

# Each part is one process that keeps a core or more busy (XLA:CPU compiles a program on one thread),
# so on a 2-core machine two at a time take about half the time; the longest start first.
# --output-sync prints each part's output whole, when it ends.
TEST_PARTS := test-nbval-03 test-nbval-rest test-pytest-a test-pytest-b test-nbval-09 \
	$(filter-out test-pytest-a test-pytest-b,$(PYTEST_PARTS))
.PHONY: $(TEST_PARTS) test-tpu

ifeq ($(TPU),)
test: .venv/installed
	$(TIMED) $(ONE_THREAD) $(MAKE) --no-print-directory -j2 --output-sync=target $(TEST_PARTS)
else
# The TPU plan: the process that opens the chips holds them, so one part at a time. The tests (those that
# start a child process opening the device skip themselves), then every notebook executed: asserts, no
# comparison with the committed outputs, which a CPU wrote (a TPU's last digits and timings differ).
# One host only: on every host of a pod it cannot work (the tests and notebooks write checkpoints to
# host-local folders, which the shared-checkpoint check refuses, and a skip or failure on one host leaves
# the others waiting in a collective), so a multi-host slice, known from its type, is refused in one line.
test: .venv/installed
	$(if $(ONE_HOST_REFUSAL),$(error $(ONE_HOST_REFUSAL)))
	$(TIMED) $(MAKE) --no-print-directory $(PYTEST_PARTS) test-tpu
endif
# The slice's host count from ACCELERATOR_TYPE / TPU_ACCELERATOR_TYPE (or the metadata server on a TPU VM):
# runtime.multi_host_slice, as the doctor and serve read it. Empty on one host (or before .venv exists).
ONE_HOST_REFUSAL = $(if $(wildcard $(PY)),$(shell $(PY) -c 'from llama_xla_helpers.runtime import \
	accelerator_type, multi_host_slice; n = multi_host_slice(); n and print(f"error: {accelerator_type()} is a \
	slice of {n} hosts and make test runs on one host; on a pod run the doctor on every host and one short \
	training run (README: A pod)")'))

# No CPU_NUM_DEVICES: init_runtime's default (8) is what the committed outputs were written with.
$(NBVAL_PARTS): test-nbval-%:
	$(TIMED) $(call notebook_env,outputs/nbval-$*) $(NBVAL) $(NBVAL_$*)
test-tpu:
	$(call execute_all,outputs/tpu)
# $(call once_more,COMMAND): COMMAND, run once more (saying so) if a signal killed it; $$s is then its status.
# CI saw test_scan.py die once of SIGSEGV in a native thread (JAX's backward beside XLA:CPU), which seven runs
# here did not repeat, and check-variants its 4-device run abort once; a second crash, or any failure, fails.
# Measured 2026-11-29: test_scan.py's scanned training at 4 devices aborts (SIGABRT in sync, no message) in
# 1 of 3 to 5 runs alone, with the loader's read-ahead thread or without it (prefetch=0).
# (test_compile_cache.py reruns its scanned train CLI child by the same rule: it died once so in CI.)
once_more = for run in 1 2; do $(1); s=$$?; if [ $$s -le 128 ] || [ $$run = 2 ]; then break; fi; \
	echo "$@: pytest was killed by signal $$((s - 128)); running it once more"; done
# Tests marked `variants` (extra bad-input launches, the serving benchmark's --quick run, option matrices
# beyond one combined configuration) run in make check-variants only (variant-marked).
$(PYTEST_PARTS): test-pytest-%:
	$(TIMED) $(call once_more,$(PYTEST) -q $(TESTS_$*) -m 'not variants' --durations=25); exit $$s

# The same two at a time; each nbval run writes its checkpoints apart (LLAMA_XLA_OUTPUTS). The bf16 parts
# run what a TPU runs by default (LLAMA_XLA_DEFAULT_DTYPE=bf16): every notebook (asserts only) at 4 devices,
# a v4-8 / v5e-4 TPU VM's count (so no fp32 run at 4: the 1- and 16-device runs cover the device counts),
# and the tests the default dtype reaches. The tests marked `fixed_dtype` would repeat their fp32 run
# exactly (conftest.py checks that they never read the default); the tests whose point is equality with an
# fp32 reference pin fp32.
VARIANT_DEVICES := variant-devices-1 variant-devices-4 variant-devices-16
VARIANT_NOTEBOOKS := variant-notebooks-1 variant-notebooks-16
VARIANT_BF16_TESTS := $(PYTEST_PARTS:test-pytest-%=variant-bf16-tests-%)
VARIANT_BF16 := variant-bf16-notebooks $(VARIANT_BF16_TESTS)
# Measured on a fresh clone (2026-11-28): 4,137 s in all; bf16-notebooks 1,687 s, avx2-one-thread 1,440,
# notebooks-16 1,412, notebooks-1 1,224, marked 366, devices 255 to 323, bf16-tests 8 to 246.
VARIANT_PARTS := variant-avx2-one-thread $(VARIANT_BF16) $(VARIANT_NOTEBOOKS) $(VARIANT_DEVICES) \
	variant-marked
.PHONY: $(VARIANT_PARTS)

check-variants: .venv/installed
	$(TIMED) $(ONE_THREAD) $(MAKE) --no-print-directory -j2 --output-sync=target $(VARIANT_PARTS)

# Another instruction set and one thread, in one run: an output that depends on either differs from the
# committed one (unless the two changes cancel exactly), and the notebooks run once, not twice.
variant-avx2-one-thread:
	$(TIMED) XLA_FLAGS=--xla_cpu_max_isa=AVX2 ATEN_CPU_CAPABILITY=avx2 $(call notebook_env,outputs/avx2-one-thread) \
		taskset -c 0 $(NBVAL) $(NOTEBOOKS)
$(VARIANT_NOTEBOOKS): variant-notebooks-%:
	$(call execute_all,outputs/devices-$*,CPU_NUM_DEVICES=$*)
# After once_more over a pytest run that may select no test (a part without such tests): its status $$s is 0, or 5
# (none collected).
PASSED_OR_NONE = [ $$s = 0 ] || [ $$s = 5 ] || exit 1
# In the processes of make test's parts: one process compiling every `devices` test's graphs aborted at 16
# devices (measured: each test passes alone; XLA:CPU keeps every program it compiled mapped).
$(VARIANT_DEVICES): variant-devices-%:
	$(TIMED) $(foreach p,$(PYTEST_PARTS:test-pytest-%=%),\
		$(call once_more,CPU_NUM_DEVICES=$* $(PYTEST) -q -m devices $(TESTS_$(p))); $(PASSED_OR_NONE);)
# One process per part of make test, as there (a part may hold no marked test).
variant-marked:
	$(TIMED) $(foreach p,$(PYTEST_PARTS:test-pytest-%=%),\
		$(call once_more,$(PYTEST) -q -m variants $(TESTS_$(p))); $(PASSED_OR_NONE);)
variant-bf16-notebooks:
	$(call execute_all,outputs/bf16,CPU_NUM_DEVICES=4 LLAMA_XLA_DEFAULT_DTYPE=bf16)
$(VARIANT_BF16_TESTS): variant-bf16-tests-%:
	$(TIMED) $(call once_more,LLAMA_XLA_DEFAULT_DTYPE=bf16 $(PYTEST) -q $(TESTS_$*) \
		-m 'not variants and not fixed_dtype'); $(PASSED_OR_NONE)

# One line per notebook (its seconds and the figures it saved), as it ends. On a CPU make test's three nbval
# groups run two at a time (measured: 665 s, 814 s one at a time), each group in order (04-06b read 03's
# checkpoint); on a TPU one notebook at a time (the process that opens the chips holds them). A notebook
# saves its figures into a folder of its own, moved into outputs/figures/ after it, so that its line names
# only its own. The kernels' messages (Jupyter's notices, XLA's C++ warnings) go to one log per group,
# whose tail is printed if a notebook fails.
TOUR_PARTS := $(if $(TPU),tour-all,$(NBVAL_GROUPS:%=tour-%))
.PHONY: tour-all $(NBVAL_GROUPS:%=tour-%)
tour: .venv/installed
	@mkdir -p outputs/figures
	@echo "Executing $(words $(NOTEBOOKS)) notebooks into outputs/$(if $(TPU),, (two at a time: about 11-20 minutes on a 2-core CPU))"
	@$(if $(TPU),,$(ONE_THREAD)) $(MAKE) --no-print-directory $(if $(TPU),,-j2) $(TOUR_PARTS)
	@echo "Executed notebooks: $(CURDIR)/outputs/*.ipynb; figures: $(CURDIR)/outputs/figures/"
	@echo "Kernel and XLA messages: $(CURDIR)/outputs/tour-*.log"
tour-all $(NBVAL_GROUPS:%=tour-%): tour-%:
	@log=outputs/tour-$*.log; : > $$log; for nb in $(or $(NBVAL_$*),$(NOTEBOOKS)); do start=$$(date +%s); echo "=== $$nb" >> $$log; \
		figs=outputs/figures/.$$(basename $$nb .ipynb); rm -rf $$figs; \
		$(call notebook_env,outputs,$$figs) $(EXECUTE) --log-level=ERROR --output-dir outputs $$nb >> $$log 2>&1 || \
			{ tail -n 25 $$log; echo "$$nb failed; the whole log: $(CURDIR)/$$log"; exit 1; }; \
		figures=$$(ls $$figs 2>/dev/null | tr '\n' ' '); [ -z "$$figures" ] || mv $$figs/* outputs/figures/; rm -rf $$figs; \
		printf '%-40s %4d s  %s\n' "$$nb" $$(($$(date +%s) - start)) "$${figures:-(no figures)}"; done

# For authors: re-execute the committed notebooks in place (outputs are what nbval compares), at 8 devices.
notebooks: .venv/installed
	for nb in $(NOTEBOOKS); do echo "$$nb"; $(call notebook_env,outputs) $(EXECUTE) --log-level=ERROR --inplace $$nb || exit 1; done

clean:
	rm -rf outputs
