# make tour:           run every notebook on this machine (the CPU stands in for a TPU slice)
# make test:           pytest + nbval over the committed notebooks (8 devices), and every notebook
#                      executed on 4 devices (a v4-8 / v5e-4 TPU VM's count): asserts, no output comparison.
#                      Its four parts run two at a time (TEST_PARTS below).
# make check-variants: what CI leaves out: nbval on another instruction set and on one thread,
#                      the device-count tests at 1, 4 and 16 devices, every notebook on 1 and 16 devices
# All create .venv from pyproject.toml on first use.
PY := .venv/bin/python
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
EXECUTE := $(PY) -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=1800
NBVAL := $(PY) -m pytest -q --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg \
	--nbval-cell-timeout=1800
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: test tour notebooks check-variants clean

.venv/installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -e '.[dev,scan]'
	# torch_xla 2.9's wheel carries an older torchax (it imports flax) that replaces the scan extra's
	# whenever pip installs torch_xla after it; put torchax 0.0.7 back.
	$(PY) -m pip install --no-deps --force-reinstall torchax==0.0.7
	touch $@

# Execute every notebook with N stand-in devices into outputs/devices-N/ (asserts must hold); the
# notebooks write their checkpoints there too (LLAMA_XLA_OUTPUTS), apart from nbval's run in outputs/.
define run_at
	mkdir -p outputs/devices-$(1)
	for nb in $(NOTEBOOKS); do echo "$$nb on $(1) devices"; \
		CPU_NUM_DEVICES=$(1) LLAMA_XLA_OUTPUTS=$(CURDIR)/outputs/devices-$(1) \
		$(EXECUTE) --log-level=ERROR --output-dir outputs/devices-$(1) $$nb || exit 1; done
endef

# pytest in two processes: XLA:CPU keeps every program it compiled mapped in memory, and one process
# compiling every test's graphs crashed near the end (a segfault) once the scan tests were added.
TESTS_A := $(sort $(wildcard tests/test_[a-m]*.py))
TESTS_B := $(sort $(wildcard tests/test_[n-z]*.py))

# Each part is one process that keeps about one core busy (XLA:CPU compiles a program on one thread),
# so on a 2-core machine two at a time take about half the time; the longest two start first.
# --output-sync prints each part's output whole, when it ends.
TEST_PARTS := test-nbval test-devices-4 test-pytest-b test-pytest-a
.PHONY: $(TEST_PARTS)

test: .venv/installed
	$(MAKE) --no-print-directory -j2 --output-sync=target $(TEST_PARTS)

test-nbval:
	CPU_NUM_DEVICES=8 $(NBVAL) $(NOTEBOOKS)
test-devices-4:
	$(call run_at,4)
test-pytest-a:
	CPU_NUM_DEVICES=8 $(PY) -m pytest -q $(TESTS_A)
test-pytest-b:
	CPU_NUM_DEVICES=8 $(PY) -m pytest -q $(TESTS_B)

# The same two at a time; each nbval run writes its checkpoints apart (LLAMA_XLA_OUTPUTS).
VARIANT_DEVICES := variant-devices-1 variant-devices-4 variant-devices-16
VARIANT_NOTEBOOKS := variant-notebooks-1 variant-notebooks-16
VARIANT_PARTS := variant-one-thread variant-avx2 $(VARIANT_NOTEBOOKS) $(VARIANT_DEVICES)
.PHONY: $(VARIANT_PARTS)

check-variants: .venv/installed
	$(MAKE) --no-print-directory -j2 --output-sync=target $(VARIANT_PARTS)

variant-avx2:
	CPU_NUM_DEVICES=8 XLA_FLAGS=--xla_cpu_max_isa=AVX2 ATEN_CPU_CAPABILITY=avx2 \
		LLAMA_XLA_OUTPUTS=$(CURDIR)/outputs/avx2 $(NBVAL) $(NOTEBOOKS)
variant-one-thread:
	CPU_NUM_DEVICES=8 LLAMA_XLA_OUTPUTS=$(CURDIR)/outputs/one-thread taskset -c 0 $(NBVAL) $(NOTEBOOKS)
$(VARIANT_NOTEBOOKS): variant-notebooks-%:
	$(call run_at,$*)
$(VARIANT_DEVICES): variant-devices-%:
	CPU_NUM_DEVICES=$* $(PY) -m pytest -q -m devices tests/

tour: .venv/installed
	mkdir -p outputs/figures
	for nb in $(NOTEBOOKS); do echo "$$nb"; \
		LLAMA_XLA_FIGURES=$(CURDIR)/outputs/figures $(EXECUTE) --log-level=ERROR --output-dir outputs $$nb || exit 1; done
	@echo "executed notebooks: $(CURDIR)/outputs/*.ipynb"
	@echo "figures:            $(CURDIR)/outputs/figures/*.png"

# For authors: re-execute the committed notebooks in place (outputs are what nbval compares), at 8 devices.
notebooks: .venv/installed
	for nb in $(NOTEBOOKS); do echo "$$nb"; CPU_NUM_DEVICES=8 $(EXECUTE) --log-level=ERROR --inplace $$nb || exit 1; done

clean:
	rm -rf outputs
