"""DCP's default planners, with ckptfmt's object model in place of pickle for non-tensor values.

Everything else (flattening, deduplication of replicated tensors, resharding on
load) is DCP's own.  DefaultSavePlanner turns each non-tensor value into
``torch.save`` bytes and DefaultLoadPlanner reads them with
``torch.load(weights_only=False)``; these subclasses replace exactly those two steps.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem, WriteItemType

from ..gcpause import pausing
from .values import ObjectBytes, check_storable, decode_value, encode_value


class SavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose non-tensor values are stored through ckptfmt's object model.

    Values ckptfmt cannot store fail in ``create_local_plan``, naming their key, before
    any rank writes a byte.  With ``enable_plan_caching=True`` (DCP's option: a save whose
    plans match the previous one's skips sending them) give a `cache_key` naming the
    process group: DCP keys its process-wide plan cache by class name alone, and merges
    cached plans rank by rank, so two groups sharing one key would mix their plans.
    """

    def __init__(self, *args: Any, cache_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if cache_key is not None:
            self._cached_plans_key = f"{type(self).__name__}:{cache_key}"

    @pausing  # DCP's planning makes an object per item (async saves plan in DCP's thread)
    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.usable and not _same_details(self.plan, _cached_local_plan(self._cached_plans_key)):
            # DCP compares keys, offsets and sizes only: a dtype, requires_grad or key path
            # that changed would leave the previous save's Metadata in this one's record
            self._pending_local_plan = self.plan
            plan = self.plan
        for item in self.plan.items:  # the whole plan, also when DCP's cache serves it
            if item.type == WriteItemType.BYTE_IO:
                check_storable(self.lookup_object(item.index), item.index.fqn)
        return plan

    @pausing
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, md = super().create_global_plan(all_plans)
        # the cache keeps `md` for the next save; each save returns (and records) its own copy
        return plans, dataclasses.replace(md)

    def forget_cached_plans(self) -> None:
        """Drop what DCP's plan cache holds under this planner's key (after a failed save, when
        ranks may have cached different steps of it)."""
        forget_cached_plans(self._cached_plans_key)

    def resolve_object(self, write_item: WriteItem) -> Any:
        """The non-tensor value itself (ckptfmt's Writer stores it without a byte round trip)."""
        return self.lookup_object(write_item.index)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if write_item.type == WriteItemType.BYTE_IO:
            if isinstance(object, io.BytesIO) and not isinstance(object, ObjectBytes):
                raw = object.getvalue()  # a BytesIO: its raw bytes, as any storage layer writes them
                return ObjectBytes(raw, raw)
            return ObjectBytes(object, encode_value(object, write_item.index.fqn))
        return object


def _cached_local_plan(key: str) -> SavePlan | None:
    return dcp_planner.SavePlanner._cached_save_plan.get(key)


def _same_details(plan: SavePlan, cached: SavePlan | None) -> bool:
    if cached is None or plan.planner_data != cached.planner_data or len(plan.items) != len(cached.items):
        return False
    return all(a.tensor_data == b.tensor_data for a, b in zip(plan.items, cached.items))


def forget_cached_plans(key: str) -> None:
    for cache in (
        dcp_planner.SavePlanner._cached_save_plan,
        dcp_planner.SavePlanner._cached_final_save_plan,
        dcp_planner.SavePlanner._cached_all_plans,
        dcp_planner.SavePlanner._cached_global_plan,
        dcp_planner.SavePlanner._cached_metadata,
    ):
        cache.pop(key, None)


class LoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with ckptfmt's object model, never pickle."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        into_bytes_io = isinstance(self.state_dict.get(fqn), io.BytesIO)
        if isinstance(value, ObjectBytes):
            obj = value.value
        elif into_bytes_io:  # another storage layer's bytes of a BytesIO: raw, as saved
            obj = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        else:
            obj = decode_value(value.getbuffer() if isinstance(value, io.BytesIO) else value.read(), fqn)
        if into_bytes_io and type(obj) is bytes:  # a BytesIO is stored as its bytes: give one back
            obj = io.BytesIO(obj)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
