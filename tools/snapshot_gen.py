#!/usr/bin/env python3
"""Writes PyTorch memory snapshots (the structure torch.cuda.memory._snapshot() documents) without a
GPU, for headroom analyze's tests and benchmark, with plain pickle.dump as _dump_snapshot does.

    snapshot_gen.py SCENARIO OUT.pickle [--iterations N] [--bytes SIZE]

Scenarios (what each plants is printed as JSON on stdout, for the tests to assert against):
  training       a training loop: forward activations per layer, backward, optimizer step
  leak           the same loop, and each iteration keeps one more 4 MiB tensor (train.py:77)
  fragmentation  20 MiB segments each cut into three 6 MiB blocks, two of three freed, then 16 MiB
                 requests that none of the holes can serve
  oom            the training loop, then a request the device cannot serve (an "oom" event)
  large          the training loop repeated until the pickle reaches --bytes (the benchmark's)

Addresses come from a small allocator of its own: segments of PyTorch's sizes (2 MiB for requests
up to 1 MiB, 20 MiB below 10 MiB, else rounded up to 2 MiB), blocks cut from them in order, freed
blocks reused for requests of the same rounded size. The final segments and blocks are exactly what
the trace leaves, so a reader can undo the trace from them. Frames are shared lists, as PyTorch
shares a traceback among the events that have it.
"""
import json
import pickle
import sys

MiB = 1 << 20


def round_size(n):
    return max(512, (n + 511) // 512 * 512)


def segment_size(rounded):
    if rounded <= MiB:
        return 2 * MiB
    if rounded < 10 * MiB:
        return 20 * MiB
    return (rounded + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


TORCH = "/usr/lib/python3/site-packages/torch"
CPP = [frame("??", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"),
       frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 1402, "malloc"),
       frame("/pytorch/aten/src/ATen/native/TensorFactories.cpp", 255, "at::native::empty_cuda")]


def stack(*user):
    """A traceback: C++ frames, torch's Python frames, then the user's frames (innermost first)."""
    return CPP + [frame(TORCH + "/nn/modules/module.py", 1751, "_call_impl")] + [frame(*u) for u in user]


def site_of(frames):
    """The allocating code as a reader should name it: the innermost frame that is the user's."""
    for f in frames:
        if f["filename"] != "??" and not f["filename"].startswith(TORCH) and not f["filename"].endswith(".cpp"):
            return f"{f['filename']}:{f['line']} in {f['name']}"
    return "(no stack recorded)"


class Recorder:
    def __init__(self, settings=None, track=True):
        self.track = track  # the peaks, and what was live at the peak allocated, for the tests
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.live_at_peak = {}
        self.time = 1_700_000_000_000_000
        self.trace = []
        self.segments = {}  # address -> [size, small, {block address: (size, requested, frames)}, bump]
        self.free = {}  # rounded size -> [addresses]
        self.live = {}  # address -> (segment, rounded, requested, frames)
        self.next_segment = 0x7F0000000000
        self.settings = settings or {}

    def event(self, action, frames, **kw):
        self.time += 7
        e = {"action": action, "addr": kw.pop("addr", 0), "size": kw.pop("size", 0), "stream": 0,
             "time_us": self.time, "frames": frames}
        e.update(kw)
        self.trace.append(e)

    def _segment(self, rounded, frames):
        size = segment_size(rounded)
        addr = self.next_segment
        self.next_segment += size + 64 * MiB
        self.segments[addr] = [size, rounded <= MiB, {}, 0]
        self.event("segment_alloc", frames, addr=addr, size=size)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return addr

    def alloc(self, requested, frames):
        rounded = round_size(requested)
        pool = self.free.get(rounded)
        if pool:
            addr = pool.pop()
            seg = self._owner(addr)
        else:
            seg = None
            for a, s in self.segments.items():
                if s[1] == (rounded <= MiB) and s[0] - s[3] >= rounded:
                    seg = a
                    break
            if seg is None:
                seg = self._segment(rounded, frames)
            s = self.segments[seg]
            addr = seg + s[3]
            s[3] += rounded
        self.segments[seg][2][addr] = (rounded, requested, frames)
        self.live[addr] = (seg, rounded, requested, frames)
        self.event("alloc", frames, addr=addr, size=requested)
        self.allocated += requested
        if self.track and self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
            self.live_at_peak = {}
            for _, _, req, fr in self.live.values():
                site = site_of(fr)
                self.live_at_peak[site] = self.live_at_peak.get(site, 0) + req
        return addr

    def _owner(self, addr):
        for a, s in self.segments.items():
            if a <= addr < a + s[0]:
                return a
        raise KeyError(addr)

    def release(self, addr, frames=None):
        seg, rounded, requested, fr = self.live.pop(addr)
        del self.segments[seg][2][addr]
        self.free.setdefault(rounded, []).append(addr)
        self.event("free_requested", frames if frames is not None else fr, addr=addr, size=requested)
        self.event("free_completed", frames if frames is not None else fr, addr=addr, size=requested)
        self.allocated -= requested

    def oom(self, requested, device_free, frames):
        self.time += 7
        self.trace.append({"action": "oom", "size": requested, "device_free": device_free, "stream": 0,
                           "time_us": self.time, "frames": frames})

    def empty_cache(self):
        for addr in [a for a, s in self.segments.items() if not s[2]]:
            size = self.segments.pop(addr)[0]
            self.reserved -= size
            for r in list(self.free):
                self.free[r] = [x for x in self.free[r] if not addr <= x < addr + size]
            self.event("segment_free", [], addr=addr, size=size)

    def snapshot(self):
        segments = []
        for addr in sorted(self.segments):
            size, small, blocks, _ = self.segments[addr]
            out, at, allocated, requested = [], addr, 0, 0
            for b in sorted(blocks):
                if b > at:
                    out.append({"address": at, "size": b - at, "requested_size": 0, "state": "inactive", "frames": []})
                rounded, req, fr = blocks[b]
                out.append({"address": b, "size": rounded, "requested_size": req, "state": "active_allocated",
                            "frames": fr})
                allocated += rounded
                requested += req
                at = b + rounded
            if at < addr + size:
                out.append({"address": at, "size": addr + size - at, "requested_size": 0, "state": "inactive",
                            "frames": []})
            segments.append({"device": 0, "address": addr, "total_size": size, "allocated_size": allocated,
                             "active_size": allocated, "requested_size": requested, "stream": 0,
                             "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
                             "is_expandable": False, "frames": [], "blocks": out})
        settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
                    "expandable_segments": False, "release_lock_on_cudamalloc": False, "pinned_use_host_register": False,
                    "roundup_power2_divisions": {}}
        settings.update(self.settings)
        self.event("snapshot", [], addr=0, size=0)
        return {"segments": segments, "device_traces": [self.trace], "allocator_settings": settings,
                "external_annotations": []}


class Model:
    """A small Transformer's allocations: per layer, per iteration."""

    def __init__(self, layers=4, hidden=1024, tokens=2048, vocab=32000):
        self.layers, self.hidden, self.tokens, self.vocab = layers, hidden, tokens, vocab
        h, t = hidden, tokens
        self.weight_sizes = [vocab * h * 4] + [s for _ in range(layers) for s in (4 * h * h * 4, 3 * 4 * h * h * 4)]
        self.stacks = {
            "weights": stack(("train.py", 30, "build_model")),
            "act": [stack((f"model.py", 40 + k, "forward"), ("model.py", 90, "forward"), ("train.py", 51, "step"))
                    for k in range(6)],
            "logits": stack(("model.py", 120, "forward"), ("train.py", 51, "step")),
            "grad_in": [stack((TORCH + "/autograd/graph.py", 824, "_engine_run_backward"), ("train.py", 53, "step"))],
            "grad": stack((TORCH + "/autograd/graph.py", 824, "_engine_run_backward"), ("train.py", 53, "step")),
            "state": [frame(TORCH + "/optim/adamw.py", 370, "_multi_tensor_adamw")] + stack(("train.py", 55, "step")),
            "leak": stack(("train.py", 77, "remember"), ("train.py", 60, "step")),
        }
        self.activation = [t * h * 4, t * h * 4, t * 4 * h * 4, t * 4 * h * 4, t * h * 4, t * 4]
        self.weights, self.grads, self.state = [], [], []

    def setup(self, r):
        self.weights = [r.alloc(s, self.stacks["weights"]) for s in self.weight_sizes]

    def iteration(self, r, leak=False):
        saved = []
        for layer in range(self.layers):
            for k, size in enumerate(self.activation):
                saved.append(r.alloc(size, self.stacks["act"][k]))
        logits = r.alloc(self.tokens * self.vocab * 4, self.stacks["logits"])
        if not self.grads:
            self.grads = [r.alloc(s, self.stacks["grad"]) for s in self.weight_sizes]
        r.release(logits)
        for addr in reversed(saved):
            tmp = r.alloc(self.tokens * self.hidden * 4, self.stacks["grad_in"][0])
            r.release(addr)
            r.release(tmp)
        if not self.state:  # AdamW's two moments, made in the first step
            self.state = [r.alloc(s, self.stacks["state"]) for s in self.weight_sizes for _ in range(2)]
        for s in self.weight_sizes[:3]:
            r.release(r.alloc(s, self.stacks["state"]))
        if leak:
            r.alloc(4 * MiB, self.stacks["leak"])


def scenario(name, iterations=8, target_bytes=0):
    r = Recorder(track=(name != "large"))
    m = Model()
    if name != "fragmentation":
        m.setup(r)
    facts = {"scenario": name, "iterations": iterations}
    if name in ("training", "leak", "oom"):
        for i in range(iterations):
            m.iteration(r, leak=(name == "leak"))
        if name == "training":  # the loop over, the program empties the cache: segment_free events
            facts["emptied"] = sum(s[0] for s in r.segments.values() if not s[2])
            r.empty_cache()
        if name == "leak":
            facts.update({"leak_site": "train.py:77 in remember", "leak_bytes_per_iteration": 4 * MiB})
        if name == "oom":
            live = sum(v[2] for v in r.live.values())
            reserved = sum(s[0] for s in r.segments.values())
            request = 8 * 1024 * 1024 * 1024
            device_free = 3 * 1024 * 1024 * 1024
            r.oom(request, device_free, stack(("model.py", 120, "forward"), ("train.py", 51, "step")))
            facts.update({"request": request, "device_free": device_free, "live": live, "reserved": reserved,
                          "site": "model.py:120 in forward"})
    elif name == "fragmentation":
        fr = stack(("frag.py", 10, "cut"))
        blocks = [r.alloc(6 * MiB, fr) for _ in range(3 * 8)]  # 8 segments of 20 MiB, 3 blocks each
        for k, addr in enumerate(blocks):
            if k % 3 != 0:
                r.release(addr)
        big = [r.alloc(16 * MiB, stack(("frag.py", 20, "grow"))) for _ in range(4)]
        # At the peak reserved (now): 8 x 20 MiB segments, each holding one live 6 MiB block, and 4 of 16 MiB.
        facts.update({"segments_20": 8, "inactive_split": 8 * (20 - 6) * MiB, "live_6": 8 * 6 * MiB,
                      "big": 4 * 16 * MiB})
        # At the peak reserved, once the last 16 MiB segment holds its block: no segment is empty.
        facts.update({"free_segments_at_peak": 0, "hand_peak_allocated": 24 * 6 * MiB,
                      "hand_peak_reserved": (8 * 20 + 4 * 16) * MiB})
        for addr in big:
            r.release(addr)
        facts["empty_cache_now"] = 4 * 16 * MiB  # the 16 MiB segments hold nothing now; each 20 MiB one a block
    elif name == "large":
        i = 0
        while True:
            m.iteration(r)
            i += 1
            # About 59 bytes per event in the pickle (measured on this scenario's files).
            if len(r.trace) * 59 >= target_bytes:
                break
        facts["iterations"] = i
    else:
        raise SystemExit(f"unknown scenario {name}; one of training, leak, fragmentation, oom, large")
    facts["events"] = len(r.trace) + 1
    if r.track:
        facts.update({"peak_allocated": r.peak_allocated, "peak_reserved": r.peak_reserved,
                      "live_at_peak": r.live_at_peak})
    return r.snapshot(), facts


def parse_size(text):
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, f in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * f)
    return int(text)


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    name, out = argv[1], argv[2]
    iterations, target = 8, 0
    args = argv[3:]
    while args:
        if args[0] == "--iterations":
            iterations = int(args[1])
        elif args[0] == "--bytes":
            target = parse_size(args[1])
        else:
            raise SystemExit(f"unknown option {args[0]}")
        args = args[2:]
    snap, facts = scenario(name, iterations, target)
    with open(out, "wb") as f:
        pickle.dump(snap, f)
    print(json.dumps(facts))


if __name__ == "__main__":
    main(sys.argv)
