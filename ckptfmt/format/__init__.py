"""The format in code: what spec/FORMAT.md says, with no I/O policy of its own.

The byte layout of a file (``layout``: magic, prologue, footer, limits, seeds and
checksums); the object model of a saved state (``tree``), built from a state by
``encode``, checked when read by ``validate`` and turned back into objects by
``decode``; the index and its rules (``index``); the dtypes and devices a file may
name; telling formats apart (``sniff``); bounded text of values and key paths for
messages (``render``); the UTC times the format writes (``timestamps``); the signature
block of signed files and the message their signature covers (``signing``).

May import: ``ckptfmt.errors``, ``ckptfmt.fileio``, ``ckptfmt.gcpause``.
"""
