"""Bytes and threads: the C engine's bindings and what moves chunks between memory and files.

The bindings (``native``), views of tensor and array memory as bytes (``bytesview``),
host memory with the huge-page choice (``hostmem``), chunk encoding and writing
(``chunkwrite``) and verified chunk reading (``chunkread``), the filesystem inside
a checkpoint directory (``ckptdir``) and the atomic, durable commit of one file
(``commit``).

May import: ``ckptfmt.format`` and the base modules.
"""
