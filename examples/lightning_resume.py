"""Lightning with ckptfmt checkpoints: run it twice, the second run resumes bit-exactly.

    python examples/lightning_resume.py runs/lit --epochs 2    # trains 2 epochs, then stops
    python examples/lightning_resume.py runs/lit --epochs 4    # resumes from runs/lit/last.ckpt

Each .ckpt is a ckptfmt file (no pickle, checksummed, committed atomically),
saved without stopping training (blocking=False), and holds the RNG state, so
the resumed epochs draw the same dropout masks and shuffle order as one
uninterrupted 4-epoch run.  `ckptfmt verify runs/lit/last.ckpt` checks a file;
after `enable()`, `Regressor.load_from_checkpoint(path)` reads one.
Needs `pip install 'ckptfmt[lightning]'`.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, enable


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 1e-2, config: argparse.Namespace | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()  # a Namespace in the hparams: stored and given back, no pickle
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args()

    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=g)
    train = DataLoader(TensorDataset(x[:448], y[:448]), batch_size=32, shuffle=True)
    val = DataLoader(TensorDataset(x[448:], y[448:]), batch_size=64)

    model = Regressor(config=argparse.Namespace(data="synthetic", seed=0))
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        plugins=[CkptfmtCheckpointIO(blocking=False)],
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=args.run_dir, monitor="val_loss", save_top_k=2, save_last=True
            )
        ],
        logger=False,
    )
    resume = os.path.exists(os.path.join(args.run_dir, "last.ckpt"))
    trainer.fit(model, train, val, ckpt_path="last" if resume else None)
    print(
        f"{'resumed' if resume else 'trained'} to epoch {trainer.current_epoch}; files: {sorted(os.listdir(args.run_dir))}"
    )
    enable()  # Lightning's own loader reads ckptfmt files from here on
    best = Regressor.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    print(f"best model: {trainer.checkpoint_callback.best_model_path} (hidden={best.hparams.hidden})")


if __name__ == "__main__":
    main()
