"""Drop-in ckptfmt checkpointing for training frameworks.

Each integration lives in its own module and imports its framework only when
that module is imported, so ``import ckptfmt`` never imports them:

* :mod:`ckptfmt.integrations.lightning`: ``CkptfmtCheckpointIO``, a Lightning
  ``CheckpointIO`` plugin (``Trainer(plugins=[CkptfmtCheckpointIO()])``);
* :mod:`ckptfmt.integrations.transformers`: ``CkptfmtTrainer``, a Hugging Face
  ``Trainer`` whose ``checkpoint-N`` folders are ckptfmt files made valid by a
  commit record;
* :mod:`ckptfmt.integrations.objects`: the allow-listed Python objects both
  store as tagged plain dicts (Namespace, Path, enum, dataclass, ...).
"""
