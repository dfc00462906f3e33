"""A training run's directory: steps, resuming, retention.

The checkpoint manager (``manager``) and its sharded steps through DCP
(``sharded``), restoring a whole training state (``resume``), RNG capture
(``rng``), retention rules (``retention``) and incremental saves
(``incremental``).

May import: ``ckptfmt.dcp`` and every layer below it.
"""
