# Targets use the virtual environment made by .ci/setup unless PY is given.
PY ?= .venv/bin/python

.PHONY: setup test lint demo golden corpus crash fuzz fuzz-smoke bench bench-quick

setup:
	bash .ci/setup

test:
	$(PY) -m pytest -q

lint:
	$(PY) -m ruff check ckptfmt tests bench
	$(PY) -m ruff format --check ckptfmt tests bench
	$(PY) -m mypy ckptfmt

demo:
	$(PY) -m ckptfmt.demo

# regenerate the golden files: only on purpose, when the format changes version
golden:
	$(PY) tests/golden/make_golden.py

# the SIGKILL crash loop, long version (CI runs 120 kills)
crash:
	CKPTFMT_CRASH_KILLS=2000 $(PY) -m pytest -q -s tests/test_crash.py

# rewrite tests/corpus/*.ckpt (the malicious-file corpus) from make_corpus.py
corpus:
	$(PY) tests/corpus/make_corpus.py

# fuzz the reader with atheris: a one-minute smoke run (CI) and a long run
fuzz-smoke:
	$(PY) tests/fuzz/fuzz_reader.py -max_total_time=60 -rss_limit_mb=4096 -print_final_stats=1

fuzz:
	$(PY) tests/fuzz/fuzz_reader.py -max_total_time=36000 -rss_limit_mb=4096 -print_final_stats=1

# benchmarks against torch.save, safetensors and DCP (writes bench/results/latest.*)
bench-quick:
	$(PY) bench/run.py --quick

bench:
	$(PY) bench/run.py
