"""Each checkpoint's cost reaches the trainer's own loggers: Lightning's through
SaveCostMonitor (here its CSVLogger), the Hugging Face Trainer's through its callbacks' on_log
(which TensorBoard, W&B and the other report_to integrations are), never its log_history."""

from __future__ import annotations

import csv
import glob
import importlib.util
import os
import re
from typing import Any

import pytest
import torch

needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs ckptfmt[lightning]"
)
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs ckptfmt[transformers]",
)


def _check(metrics: dict[str, float], nbytes: int) -> None:
    assert metrics["ckptfmt/save_bytes"] == nbytes > 0
    assert 0 < metrics["ckptfmt/save_blocked_s"] <= metrics["ckptfmt/save_durable_s"] < 120
    assert metrics["ckptfmt/save_GBps"] == pytest.approx(nbytes / metrics["ckptfmt/save_durable_s"] / 1e9)


@needs_lightning
@pytest.mark.parametrize("blocking", [True, False])
def test_lightning_logs_each_save_at_its_step(tmp_path: Any, blocking: bool) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, SaveCostMonitor

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 64)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pl.seed_everything(3, verbose=False)
    data = DataLoader(TensorDataset(torch.randn(48, 64)), batch_size=8)
    ckpts = tmp_path / "ckpts"
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        plugins=[CkptfmtCheckpointIO(blocking=blocking)],
        callbacks=[
            pl.callbacks.ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=2, save_top_k=-1),
            SaveCostMonitor(),
        ],
        logger=pl.loggers.CSVLogger(str(tmp_path / "logs"), name="run", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data)
    sizes = {
        int(re.search(r"step=(\d+)", p).group(1)): os.path.getsize(p)  # type: ignore[union-attr]
        for p in glob.glob(str(ckpts / "*.ckpt"))
    }
    assert sorted(sizes) == [2, 4, 6]
    with open(tmp_path / "logs" / "run" / "version_0" / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("ckptfmt/save_bytes")]
    logged = {
        int(r["step"]): {k: float(v) for k, v in r.items() if k.startswith("ckptfmt/") and v} for r in rows
    }
    assert sorted(logged) == [2, 4, 6], rows  # one row per save, at the step it saved
    for step, metrics in logged.items():
        _check(metrics, sizes[step])


@needs_transformers
@pytest.mark.parametrize("blocking", [True, False])
def test_hf_trainer_hands_each_save_to_its_callbacks(tmp_path: Any, blocking: bool) -> None:
    from trainer_helpers import Tokens, tiny_gpt2
    from transformers import TrainerCallback, TrainingArguments

    from ckptfmt.integrations.transformers import CkptfmtTrainer

    seen: list[dict[str, float]] = []

    class Record(TrainerCallback):  # the shape of TensorBoardCallback and WandbCallback
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "ckptfmt/save_bytes" in logs:
                seen.append(dict(logs))

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    model = tiny_gpt2(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    trainer = CkptfmtTrainer(
        model=model,
        args=args,
        train_dataset=Tokens(n=24, length=16, vocab=64, seed=1),
        callbacks=[Record()],
        ckptfmt_blocking=blocking,
    )
    trainer.train()
    trainer.wait_for_checkpoints()
    assert [int(m["ckptfmt/save_step"]) for m in seen] == [2, 4, 6], seen
    for m in seen:
        folder = tmp_path / f"checkpoint-{int(m['ckptfmt/save_step'])}"
        ours = sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(".ckpt"))
        _check(m, ours)
    assert not any(k.startswith("ckptfmt/") for entry in trainer.state.log_history for k in entry)
