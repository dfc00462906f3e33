"""cffi builder for the C engine (out-of-line API mode), used by setup.py's cffi_modules.

Links the system libzstd and libxxhash (Debian: libzstd-dev, libxxhash-dev).
CKPTFMT_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer.
"""

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["pool.c", "cache.c", "codec.c", "hash.c", "memory.c", "writer.c", "reader.c", "snapshot.c", "crypto.c"]

ffibuilder = FFI()
with open(os.path.join(HERE, "ckptfmt.cdef")) as f:
    ffibuilder.cdef(f.read())

cflags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-D_GNU_SOURCE"]
ldflags = ["-pthread"]
libraries = ["zstd", "xxhash"]
# signing (SHA-256 chunk digests) links OpenSSL's libcrypto where its headers are installed
# (Debian: libssl-dev); without them, or with CKPTFMT_NO_CRYPTO=1, the engine builds without
# it and signing raises a clear error
if not os.environ.get("CKPTFMT_NO_CRYPTO") and any(
    os.path.exists(os.path.join(d, "openssl", "evp.h")) for d in ("/usr/include", "/usr/local/include")
):
    cflags.append("-DCKF_HAVE_CRYPTO")
    libraries.append("crypto")
if os.environ.get("CKPTFMT_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    cflags = [c for c in cflags if c != "-O2"] + ["-O1", "-g"] + san
    ldflags += san



def _set_source(where) -> None:
    # setuptools wants relative source paths; a standalone build (make asan) uses
    # absolute ones so that every object file lands under its own build directory
    ffibuilder.set_source(
        "ckptfmt._ckptfmt_c",
        '#include "ckptfmt.h"',
        sources=[where(os.path.join(HERE, s)) for s in SOURCES],
        include_dirs=[where(HERE)],
        libraries=libraries,
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    )


if __name__ == "__main__":
    _set_source(os.path.abspath)
    ffibuilder.compile(tmpdir=".", verbose=True)
else:
    _set_source(os.path.relpath)
