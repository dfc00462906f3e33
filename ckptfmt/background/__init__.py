"""Saves that run while training goes on.

Snapshots into staging memory written on a background thread (``copysave``),
copy-on-write snapshots written by a forked child (``forksave``), the pool of
staging slabs (``staging``) and the registry of saves in flight that loads and
removals wait for (``inflight``, which imports nothing of ckptfmt).

May import: ``ckptfmt.engine``, ``ckptfmt.format`` and the base modules.
"""
