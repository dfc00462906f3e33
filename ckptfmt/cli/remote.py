"""The command line on object-store URLs: `ls`, `verify`, `inspect` and `consolidate` of
``s3://`` paths.

Credentials, region and endpoint come from boto3's own conventions (``AWS_*`` environment
variables such as AWS_ENDPOINT_URL, ``~/.aws``), as for the AWS CLI.  A URL names one
checkpoint file (an object), one multi-file checkpoint (a prefix holding a commit record:
a DCP checkpoint, or a run's step), or a run (a prefix holding step-N/ "directories").
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError


def is_object(url: str) -> bool:
    """Whether `url` names an existing object (else it is taken as a run's prefix): one HEAD
    request, nothing fetched."""
    from ..storage.download import head
    from ..storage.urls import parse_url

    try:
        head(parse_url(url), {})
    except FileNotFoundError:
        return False
    except CheckpointError:
        return True  # there, but not readable as a checkpoint: the file commands say why
    return True


def run_entries(
    url: str, step: int | None, problem_dict: Any, trusted: Any = None, decrypt: Any = None
) -> list[dict[str, Any]]:
    """verify's entries for the steps of the run at `url` (every step, or `step`), with the
    checks a load makes (a step whose record the store failed to serve: "unreadable"): `trusted` keys one of which must have signed each step, `decrypt`
    the key of an encrypted run."""
    from ..runs.objectmanager import ObjectRunManager  # CheckpointManager(url)

    manager = ObjectRunManager(url, trusted_keys=trusted, decrypt_with=decrypt)
    statuses = manager.statuses()
    if not statuses:
        return [{"path": url, "status": "incomplete", "error": "no object and no step-N/ prefix here"}]
    if step is not None:
        statuses = [s for s in statuses if s.step == step]
        if not statuses:
            return [{"path": url, "status": "incomplete", "error": f"no step {step} in this run"}]
    out = []
    for s in statuses:
        entry: dict[str, Any] = {"path": s.path, "step": s.step}
        if s.unknown:  # the store failed: its row is unreadable, the others are verified
            entry.update(status="unreadable", error=s.problem)
        elif s.info is None:
            entry.update(status="damaged" if s.damaged else "incomplete", error=s.problem)
        else:
            report = manager.verify(s.step)
            entry.update(
                status="failed" if report.problems else "ok",
                chunks=report.chunks,
                problems=[problem_dict(p) for p in report.problems],
            )
        out.append(entry)
    return out


def run_rows(url: str) -> list[Any]:
    """ls's step statuses of the run at `url`."""
    from ..runs.objectmanager import ObjectRunManager  # CheckpointManager(url)

    return ObjectRunManager(url).statuses()


def has_record(url: str) -> bool:
    """Whether `url` is the prefix of a multi-file checkpoint: one HEAD of its commit record."""
    from ..files import multifile
    from ..files.places import ObjectPlace

    return ObjectPlace(url).exists(multifile.COMMIT_NAME)


def checkpoint_entry(url: str, problem_dict: Any, decrypt: Any = None, trusted: Any = None) -> dict[str, Any]:
    """verify's entry for the multi-file checkpoint under the prefix `url`, with the checks
    a load makes (`trusted` keys, `decrypt` key)."""
    from ..files.places import ObjectPlace
    from ..runs.stepcheck import verify_objects

    report = verify_objects(ObjectPlace(url), decrypt, trusted)
    return {
        "path": report.path,
        "step": None,
        "status": "failed" if report.problems else "ok",
        "chunks": report.chunks,
        "problems": [problem_dict(p) for p in report.problems],
    }
