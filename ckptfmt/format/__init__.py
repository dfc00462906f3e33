"""The format in code: what spec/FORMAT.md says, with no I/O policy of its own.

The byte layout of a file (``layout``: magic, prologue, footer, limits, seeds and
checksums), the object model of a saved state (``tree``), the index and its rules
(``index``), the dtypes and devices a file may name, and telling formats apart
(``sniff``).

May import: ``ckptfmt.errors``, ``ckptfmt.fileio``, ``ckptfmt.gcpause``.
"""
