"""The names in a run directory and in its ``checkpoint-N`` folders: the folder prefix, the
file each part of a Trainer checkpoint goes to, and the bound on the JSON files read back."""

from __future__ import annotations

import re

from ...engine import marks

PREFIX = "checkpoint"
MODEL_NAME = "model.ckpt"
OPTIMIZER_NAME = "optimizer.ckpt"
SCHEDULER_NAME = "scheduler.ckpt"
SCALER_NAME = "scaler.ckpt"
RNG_NAME = "rng_state.ckpt"
TRAINER_STATE_NAME = "trainer_state.ckpt"
TRAINER_STATE_JSON = "trainer_state.json"
CONFIG_JSON = "config.json"
#: the training arguments as JSON (TrainingArguments.to_json_string), in place of the
#: Trainer's pickled ``training_args.bin``
TRAINING_ARGS_JSON = "training_args.json"
#: ckptfmt's mark (engine.marks): the first entry of every ``checkpoint-N`` folder ckptfmt makes,
#: the proof that one without a valid commit record is ckptfmt's to delete
MARK_NAME = marks.MARK_NAME
WRITER = "ckptfmt.integrations.transformers"
#: the JSON files read from a folder (trainer_state.json, config.json) are bounded: a
#: hostile folder cannot make a read take unbounded memory
MAX_JSON_BYTES = 64 << 20
DIR_RE = re.compile(rf"{PREFIX}-([0-9]+)")


def checkpoint_step(name: str) -> int | None:
    """N for a folder named ``checkpoint-N``, else None."""
    m = DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None
