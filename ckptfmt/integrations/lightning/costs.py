"""SaveCostMonitor: what each checkpoint cost, logged with the Trainer's own loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .plugin import CkptfmtCheckpointIO

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback as _Callback
else:

    def _find_callback() -> type:
        """Lightning's Callback: from the `lightning` package if installed, else `pytorch_lightning`."""
        for module in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"):
            try:
                return __import__(module, fromlist=["Callback"]).Callback
            except ImportError:
                continue
        raise ImportError(
            "SaveCostMonitor needs Lightning's Trainer: pip install 'ckptfmt[lightning]' "
            "(the `lightning` or the `pytorch-lightning` package)"
        )

    _Callback = _find_callback()


class SaveCostMonitor(_Callback):
    """Log what each checkpoint of `CkptfmtCheckpointIO` cost through the Trainer's loggers
    (TensorBoard, W&B, CSV...), as ``LearningRateMonitor`` logs learning rates:
    ``ckptfmt/save_blocked_s`` (the training loop's stall), ``save_durable_s``, ``save_bytes``,
    ``save_GBps`` (and ``save_archived_s`` where known), at the global step of the save.

    A blocking save is logged at the next batch's end; a non-blocking one at the first batch
    end (or the end of fit) after it finished, so logging never waits for a save.

        trainer = Trainer(plugins=[CkptfmtCheckpointIO()], callbacks=[SaveCostMonitor()])
    """

    def __init__(self, prefix: str = "ckptfmt/") -> None:
        self.prefix = prefix

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._log(trainer)

    def on_validation_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._log(trainer)

    def on_fit_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is not None:
            plugin.wait()  # the last saves' costs: fit has ended, nothing is stalled by this
        self._log(trainer)

    def _log(self, trainer: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is None or not trainer.loggers:
            return
        for step, cost in plugin.finished_costs():
            metrics = cost.metrics(self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step if step is None else step)


def _plugin(trainer: Any) -> CkptfmtCheckpointIO | None:
    """The Trainer's CkptfmtCheckpointIO, or None (another plugin: nothing of ours to log)."""
    io = getattr(trainer.strategy, "checkpoint_io", None)
    return io if isinstance(io, CkptfmtCheckpointIO) else None
