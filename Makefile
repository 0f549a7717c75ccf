# make tour: run every notebook on this machine (the CPU stands in for an 8-device TPU slice)
# make test: pytest + nbval over the committed notebooks
# Both create .venv from pyproject.toml on first use.
PY := .venv/bin/python
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
EXECUTE := $(PY) -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=1800
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: test tour notebooks clean

.venv/installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -e '.[dev]'
	touch $@

test: .venv/installed
	$(PY) -m pytest -q tests/
	$(PY) -m pytest -q --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg \
		--nbval-cell-timeout=1800 $(NOTEBOOKS)

tour: .venv/installed
	mkdir -p outputs/figures
	for nb in $(NOTEBOOKS); do \
		LLAMA_XLA_FIGURES=$(CURDIR)/outputs/figures $(EXECUTE) --output-dir outputs $$nb || exit 1; done
	@echo "executed notebooks: $(CURDIR)/outputs/*.ipynb"
	@echo "figures:            $(CURDIR)/outputs/figures/*.png"

# For authors: re-execute the committed notebooks in place (outputs are what nbval compares).
notebooks: .venv/installed
	for nb in $(NOTEBOOKS); do $(EXECUTE) --inplace $$nb || exit 1; done

clean:
	rm -rf outputs
