"""Whether a failed write of a commit record (a step's, an archive copy's) got the store's
definite answer: one that says the write did not happen.  Without one the record may land
yet, naming the objects it was written against, which must then stay: a request that went
unanswered (a timeout, a reset, an answer cut short) or was answered 500, 502 or 504 (a store
or a proxy in front of it may send those after the write is done), by ANY attempt of the
write's retries, not only the last: an earlier attempt's write may land after a later one
was refused."""

from __future__ import annotations

from ..storage import lost_answer
from ..storage.client import error_code

#: the statuses a store, or a proxy before it, may answer after carrying a write out
_UNDECIDED_STATUSES = {408, 500, 502, 504}


def store_answered(e: BaseException) -> bool:
    """Whether failure `e` of a write, and every failed attempt of it before, is the store's
    definite answer (it refused the write, which did not happen)."""
    seen: BaseException | None = e
    for _ in range(8):  # the chain of causes a storage error carries, bounded
        if seen is None:
            return False
        if not all(_definite(a) for a in lost_answer.failed_attempts(seen)):
            return False
        if error_code(seen)[1]:
            return _definite(seen)
        seen = seen.__cause__ or seen.__context__
    return False


def _definite(e: BaseException) -> bool:
    """Whether one failed attempt `e` ended with an answer saying the write did not happen."""
    code, status = error_code(e)
    if not status:
        return False  # no answer at all
    return status not in _UNDECIDED_STATUSES and code != "RequestTimeout"
