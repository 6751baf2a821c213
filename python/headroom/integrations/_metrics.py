"""The headroom/* values the trainer callbacks log, from a Monitor's step record."""
from __future__ import annotations

from typing import Any, Dict


def step_metrics(record: Dict[str, Any]) -> Dict[str, Any]:
    """The ``headroom/*`` values of one step's :meth:`Monitor.end_step` record."""
    phases = record.get("phases", {})
    out: Dict[str, Any] = {
        "headroom/peak_bytes": record["peak_bytes"],
        "headroom/live_bytes": record["live_bytes"],
    }
    if "reserved_bytes" in record:
        out["headroom/reserved_bytes"] = record["reserved_bytes"]
    for phase in ("forward", "backward", "optimizer"):
        out[f"headroom/{phase}_peak_bytes"] = phases.get(phase, {}).get("peak", 0)
    at_peak = phases.get(record.get("peak_phase", ""), {}).get("breakdown", {})
    for category in ("weights", "gradients", "optimizer", "activations"):
        out[f"headroom/{category}_bytes"] = at_peak.get(category, 0)
    out["headroom/oom_recoveries"] = record.get("oom_recoveries", 0)
    return out
