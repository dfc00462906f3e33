# Targets use the virtual environment made by .ci/setup unless PY is given.
PY ?= .venv/bin/python

.PHONY: setup test lint demo golden corpus crash soak soak-tiered fuzz fuzz-smoke bench bench-quick bench-incremental asan

setup:
	bash .ci/setup

# two workers, each given whole test files (their module fixtures, servers and process groups
# stay on one worker): the suite in about half the time on a 2-core machine
test:
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20

lint:
	$(PY) -m ruff check ckptfmt tests bench examples
	$(PY) -m ruff format --check ckptfmt tests bench examples
	$(PY) -m mypy ckptfmt

demo:
	$(PY) -m ckptfmt.demo

# regenerate the golden files: only on purpose, when the format changes version
golden:
	$(PY) tests/golden/make_golden.py

# the SIGKILL crash loop, long version (CI runs 80 kills)
crash:
	CKPTFMT_CRASH_KILLS=2000 $(PY) -m pytest -q -s tests/test_crash.py

# the checkpoint manager's SIGKILL campaign, long version (the test suite runs 150 kills)
soak:
	CKPTFMT_MANAGER_KILLS=10000 $(PY) -m pytest -q -s tests/test_manager_crash.py

# the tiered run's SIGKILL soak (local disk + archive on a local S3 server), long version:
# 500 kills in each of the plain, signed, encrypted and zstd runs (the test suite runs 6 each)
soak-tiered:
	CKPTFMT_TIERED_KILLS=500 $(PY) -m pytest -q -s tests/test_tiered_soak.py

# a torchrun job archived, encrypted, incremental and non-blocking, restarted on a fresh node
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

# full vs incremental saves (95% frozen state) on tmpfs and disk (writes bench/results/incremental.json)
bench-incremental:
	$(PY) bench/incremental.py

# the C engine built with AddressSanitizer + UndefinedBehaviorSanitizer, and the
# tests that reach C (engine, non-blocking saves, corpus, corruption) run against it
ASAN_LIB = $(shell gcc -print-file-name=libasan.so)
PYABS = $(if $(findstring /,$(PY)),$(abspath $(PY)),$(shell command -v $(PY)))
ASAN_TESTS = tests/test_engine.py tests/test_nonblocking.py tests/test_reader.py tests/test_small_tensors.py tests/test_load_into.py tests/test_hostile.py tests/test_corruption.py tests/test_incremental.py tests/test_forksave.py tests/test_signing.py tests/test_encryption.py
asan:
	rm -rf build/asan && mkdir -p build/asan/pkg
	cp -r ckptfmt build/asan/pkg/ && rm -f build/asan/pkg/ckptfmt/*.so
	cd build/asan/pkg && CKPTFMT_SANITIZE=1 $(PYABS) $(CURDIR)/csrc/build_ffi.py >../build.log
	cd build/asan && LD_PRELOAD=$(ASAN_LIB) PYTHONPATH=pkg CKPTFMT_SANITIZED=1 \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  $(PYABS) -m pytest -q -p no:cacheprovider $(addprefix $(CURDIR)/,$(ASAN_TESTS))
