"""One checkpoint file, and the commit record that binds several into one checkpoint.

Save (``save``), load and open (``load``, with ``reader`` beneath it), verify
(``verify``), load into live objects (``load_into``, with ``targets`` matching the
file against them, ``fillplan`` planning and ``fillreads`` reading), and the commit
records of multi-file checkpoints (``multifile``) that DCP saves, manager steps,
incremental saves and Hugging Face folders share.  Signed files: keys and signature
checks (``signing``), and signing an existing file (``signfile``).

May import: ``ckptfmt.background``, ``ckptfmt.engine``, ``ckptfmt.format`` and the base modules.
"""
