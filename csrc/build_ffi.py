"""cffi builder for the C engine (out-of-line API mode), used by setup.py's cffi_modules.

Links the system libzstd and libxxhash (Debian: libzstd-dev, libxxhash-dev).
CKPTFMT_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer.
"""

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["pool.c", "codec.c", "hash.c", "writer.c", "reader.c"]

ffibuilder = FFI()
with open(os.path.join(HERE, "ckptfmt.cdef")) as f:
    ffibuilder.cdef(f.read())

cflags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-D_GNU_SOURCE"]
ldflags = ["-pthread"]
if os.environ.get("CKPTFMT_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    cflags = [c for c in cflags if c != "-O2"] + ["-O1", "-g"] + san
    ldflags += san

ffibuilder.set_source(
    "ckptfmt._ckptfmt_c",
    '#include "ckptfmt.h"',
    sources=[os.path.relpath(os.path.join(HERE, s)) for s in SOURCES],
    include_dirs=[os.path.relpath(HERE)],
    libraries=["zstd", "xxhash"],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
