"""A training run's directory: steps, resuming, retention.

The checkpoint manager (``manager``); step directories and the save that holds one
(``steps``, ``locks``); one listing of the run directory (``scan``); what makes a step
a checkpoint, and verifying steps (``stepcheck``); sharded steps through DCP
(``sharded``); restoring a whole training state (``resume``); RNG capture (``rng``);
retention rules (``retention``); incremental saves (``incremental``).

May import: ``ckptfmt.dcp`` and every layer below it.
"""
