"""headroom.analyze_snapshot: the CLI's analysis as a dict, and hostile pickles refused unexecuted."""
import json
import os
import pickle
import subprocess
import sys

import pytest

import headroom

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEN = os.path.join(ROOT, "tools", "snapshot_gen.py")


def generate(tmp_path, scenario):
    path = tmp_path / f"{scenario}.pickle"
    facts = subprocess.run([sys.executable, GEN, scenario, str(path)], check=True, capture_output=True, text=True)
    return path, json.loads(facts.stdout)


def test_the_same_result_as_the_cli(tmp_path):
    path, facts = generate(tmp_path, "leak")
    result = headroom.analyze_snapshot(path)
    binary = os.environ.get("HEADROOM_BINARY", os.path.join(ROOT, "build", "headroom"))
    cli = json.loads(subprocess.run([binary, "analyze", "--json", str(path)], check=True, capture_output=True,
                                    text=True).stdout)
    assert result == cli
    device = result["devices"][0]
    assert device["peak"]["allocated"] == facts["peak_allocated"]
    assert device["leak"]["detected"]
    assert device["leak"]["sites"][0]["origin"] == facts["leak_site"]


def test_a_report_and_fewer_sites(tmp_path):
    path, _ = generate(tmp_path, "oom")
    report = tmp_path / "r.html"
    result = headroom.analyze_snapshot(path, top=2, report=report)
    assert len(result["devices"][0]["peak"]["live"]) == 2
    assert "<svg" in report.read_text()
    with pytest.raises(ValueError, match="top"):
        headroom.analyze_snapshot(path, top=0)


class _Plant:
    """Unpickling this would create a file: pickle.load runs code, analyze_snapshot must not."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_hostile_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "hostile.pickle"
    with open(path, "wb") as f:
        pickle.dump({"segments": [_Plant(str(marker))]}, f)
    with pytest.raises(ValueError, match=r"pickle offset \d+: opcode (STACK_GLOBAL|GLOBAL)"):
        headroom.analyze_snapshot(path)
    assert not marker.exists()
    with pytest.raises(ValueError, match="cannot open"):
        headroom.analyze_snapshot(tmp_path / "missing.pickle")


def test_a_torch_2_15_snapshot_reads_as_its_2_11_shape(tmp_path):
    """torch 2.15's snapshot adds the pinned host pool (host_segments, host_traces), "annotate" events
    with internal_metadata among the device's, and the pinned pool's limits among the settings: the
    analysis of a snapshot with them is that of the same snapshot without them."""
    path, facts = generate(tmp_path, "leak")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    at = len(trace) // 2
    newer = dict(snap, host_segments=[], host_traces=[[]],
                 allocator_settings=dict(snap["allocator_settings"], max_round_threshold=-1, max_cached_size=-1),
                 device_traces=[trace[:at] + [{"action": "annotate", "addr": 0, "size": 0, "stream": 0,
                                               "time_us": trace[at - 1].get("time_us", 0), "frames": [],
                                               "internal_metadata": "phase:backward"}] + trace[at:]])
    newer_path = tmp_path / "torch-2.15.pickle"
    with open(newer_path, "wb") as f:
        pickle.dump(newer, f)
    old, new = headroom.analyze_snapshot(path), headroom.analyze_snapshot(newer_path)
    old_peak, new_peak = dict(old["devices"][0]["peak"]), dict(new["devices"][0]["peak"])
    # The peak's event index counts the annotation when it comes before it; all else is the same.
    old_event = old_peak.pop("allocated_event")
    assert new_peak.pop("allocated_event") == old_event + (old_event >= at)
    assert new_peak == old_peak
    assert new["devices"][0]["peak"]["allocated"] == facts["peak_allocated"]
    assert new["devices"][0]["leak"]["sites"][0]["origin"] == facts["leak_site"]
