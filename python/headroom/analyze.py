"""headroom.analyze_snapshot: a PyTorch memory snapshot, diagnosed without unpickling it in Python."""
import json
import os
from typing import Any, Dict, Optional, Union

from . import _core


def analyze_snapshot(
    path: Union[str, "os.PathLike[str]"], *, top: int = 12, report: Optional[Union[str, "os.PathLike[str]"]] = None
) -> Dict[str, Any]:
    """Diagnoses the memory snapshot pickle at ``path`` as ``headroom analyze --json`` does.

    The file is read by headroom's own reader, which accepts plain data only (dict, list, tuple, str,
    bytes, int, float, bool, None): a pickle that would construct objects or call code is refused,
    never executed — unlike ``pickle.load``. The result has, per device (``result["devices"]``):
    ``peak`` (allocated and reserved, and what was live at the peak grouped by the allocating Python
    line), ``iterations`` and ``leak`` (with the leaking sites), ``fragmentation`` (inactive-split
    bytes, what ``empty_cache`` would return, the trace replayed with other allocator settings, a
    timeline) and ``ooms`` (each with the levers that would have avoided it).

    ``top``: how many allocating sites to list. ``report``: also write the HTML report there.
    Raises ValueError (one line, naming the byte offset) for a file that is not such a snapshot.
    """
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    text = _core.analyze_snapshot(os.fspath(path), int(top), os.fspath(report) if report is not None else "")
    return json.loads(text)
