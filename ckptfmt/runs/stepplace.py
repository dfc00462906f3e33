"""A step of a run on an object store as the place of its multi-file checkpoint
(files/places.py): the checks a step's commit record must pass there besides a record's own.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptError
from ..files import multifile
from ..files.names import STATE_NAME_RE
from ..files.places import ObjectPlace
from ..storage.urls import ObjectURL
from .objectnames import referenced_step


class StepPlace(ObjectPlace):
    """A step of a run on a store as the place of its checkpoint: its commit record must be
    for that step and refer only to objects of the run's steps (``../step-N/NAME``)."""

    def __init__(self, url: ObjectURL, storage_options: dict[str, Any] | None, step: int) -> None:
        super().__init__(url, storage_options)
        self.step = step

    def record_sized(self, size: int | None, trusted: Any = None) -> multifile.CommitRecord:
        record = super().record_sized(size, trusted)
        url = self.path_of(multifile.COMMIT_NAME)
        if record.step != self.step:
            raise CorruptError(f"the commit record is for step {record.step}, not {self.step}", path=url)
        if record.layout == "state" and [
            STATE_NAME_RE.fullmatch(p.name) is not None for p in record.files
        ] != [True]:
            raise CorruptError(
                "a 'state' commit record must name exactly one state object (state.ckpt, or "
                "state.<16 hex digits>.ckpt)",
                path=url,
            )
        for ref in record.references:
            other = referenced_step(ref.name, url)[0]  # a reference names a step of this run
            if other >= self.step:  # cleanup relies on it: only later steps read a step's objects
                raise CorruptError(
                    f"the commit record refers to step {other}, not an earlier step ({ref.name[:80]!r})",
                    path=url,
                )
        return record
