"""A Hugging Face Trainer with ckptfmt checkpoints, a crash mid-save, and a resume.

    python examples/transformers_resume.py runs/hf

Trains a tiny GPT-2 (random weights from a config: nothing is downloaded) for
12 steps with a checkpoint every 4, then simulates a crash in the middle of
saving checkpoint-12 (its model and optimizer files written, the rest never),
then resumes with `resume_from_checkpoint=True`: the torn checkpoint-12 is
skipped with a warning, training continues from checkpoint-8 to step 16.  The
stock Trainer would pick checkpoint-12 and fail.  Needs
`pip install 'ckptfmt[transformers]'`.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from ckptfmt.integrations.transformers import CkptfmtTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def trainer(run_dir: str, max_steps: int) -> CkptfmtTrainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    args = TrainingArguments(
        output_dir=run_dir,
        max_steps=max_steps,
        per_device_train_batch_size=8,
        save_steps=4,
        save_total_limit=2,
        logging_steps=4,
        report_to="none",
        use_cpu=True,
    )
    return CkptfmtTrainer(model=model, args=args, train_dataset=Tokens(), ckptfmt_blocking=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    run_dir = ap.parse_args().run_dir
    shutil.rmtree(run_dir, ignore_errors=True)

    trainer(run_dir, max_steps=12).train()
    # what a crash in the middle of saving checkpoint-12 leaves behind
    torn = os.path.join(run_dir, "checkpoint-12")
    for name in os.listdir(torn):
        if name not in ("model.ckpt", "optimizer.ckpt", "config.json"):
            os.unlink(os.path.join(torn, name))
    print("checkpoint-12 after the crash:", sorted(os.listdir(torn)))

    t = trainer(run_dir, max_steps=16)
    t.train(resume_from_checkpoint=True)  # warns: skipping .../checkpoint-12: not a complete checkpoint
    print("resumed and trained to step", t.state.global_step)
    print("checkpoints:", sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint-")))


if __name__ == "__main__":
    main()
