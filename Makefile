# Targets use the virtual environment made by .ci/setup unless PY is given.
PY ?= .venv/bin/python

.PHONY: setup test lint demo golden crash

setup:
	bash .ci/setup

test:
	$(PY) -m pytest -q

lint:
	$(PY) -m ruff check ckptfmt tests
	$(PY) -m ruff format --check ckptfmt tests
	$(PY) -m mypy ckptfmt

demo:
	$(PY) -m ckptfmt.demo

# regenerate the golden files: only on purpose, when the format changes version
golden:
	$(PY) tests/golden/make_golden.py

# the SIGKILL crash loop, long version (CI runs 120 kills)
crash:
	CKPTFMT_CRASH_KILLS=2000 $(PY) -m pytest -q -s tests/test_crash.py
