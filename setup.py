"""Builds the optional C engine with cffi; everything else is in pyproject.toml.

When the engine cannot be built (no compiler, no libzstd-dev/libxxhash-dev),
the install still succeeds and ckptfmt runs on its pure-Python path.
"""

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # compiler or headers missing
            print(f"ckptfmt: C engine not built ({e}); the pure-Python path will be used", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"ckptfmt: C engine not built ({e}); the pure-Python path will be used", file=sys.stderr)


setup(cffi_modules=["csrc/build_ffi.py:ffibuilder"], cmdclass={"build_ext": OptionalBuildExt})
