"""For tests/test_lightning.py: `Trainer(strategy="ddp_spawn")` on 2 CPU processes (gloo) with a
non-blocking CkptfmtCheckpointIO.

ddp_spawn pickles the Trainer (the plugin with it) into each process, which import the
module class by name: it lives here, at the top of a module that imports Lightning
(test_lightning.py imports Lightning only inside its tests).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, load_checkpoint


class SpawnNet(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_ddp_spawn(out: str) -> dict[str, Any]:
    """Train 2 epochs on 2 processes; the checkpoint files, and whether the weights the main
    process got back (through the plugin's save and load) equal those in last.ckpt."""
    warnings.filterwarnings("ignore")
    pl.seed_everything(3, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    ckpts = os.path.join(out, "ckpts")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        plugins=[CkptfmtCheckpointIO(blocking=False)],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=ckpts, save_last=True, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = SpawnNet()
    trainer.fit(model, data)
    last = load_checkpoint(os.path.join(ckpts, "last.ckpt"))["state_dict"]
    same = all(torch.equal(v, last[k]) for k, v in model.state_dict().items())
    return {"files": sorted(os.listdir(ckpts)), "weights_back": same}
