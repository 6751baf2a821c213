"""headroom.chunked_cross_entropy against the full head + cross-entropy and against Liger's
LigerFusedLinearCrossEntropyLoss: the peak above the inputs and the time of forward + backward, for
a Qwen3-0.6B-shaped head (1,024 x 151,936) and a Gemma-3-1B-shaped one (1,152 x 262,144) over 2,048
tokens, bf16 autocast. Liger runs only where Triton has a device (not on a cpu-only machine: its
kernels are Triton's); the row says why when it cannot.

    PYTHONPATH=build/python python bench/chunked_loss_vs_liger.py [--device cpu|cuda] [--tokens N]
"""
import argparse
import time

import torch

import headroom
from headroom import _core


def peak_of(device, fn):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _core.reset_cpu_peak()
        base = _core.cpu_live_bytes()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _core.cpu_peak_bytes() - base
    return peak, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    dev = args.device
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        liger_error = None
    except Exception as e:  # noqa: BLE001 - any import failure is the row's reason
        liger, liger_error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for name, hidden_size, vocab in (("qwen3-0.6b", 1024, 151936), ("gemma-3-1b", 1152, 262144)):
        torch.manual_seed(0)
        w = (torch.randn(vocab, hidden_size, device=dev) * 0.02).requires_grad_()
        h = torch.randn(args.tokens, hidden_size, device=dev).requires_grad_()
        t = torch.randint(vocab, (args.tokens,), device=dev)

        def full():
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = torch.nn.functional.linear(h, w)
            torch.nn.functional.cross_entropy(logits.float(), t).backward()

        def chunked():
            with torch.autocast(dev, dtype=torch.bfloat16):
                headroom.chunked_cross_entropy(h, w, t).backward()

        def theirs():
            with torch.autocast(dev, dtype=torch.bfloat16):
                liger(w, h, t).backward()

        rows = [("full (lm_head + cross_entropy)", full), ("headroom chunked", chunked)]
        if liger is not None:
            rows.append(("liger fused linear CE", theirs))
        print(f"\n{name}: {args.tokens} tokens x {hidden_size} -> {vocab}, bf16 autocast, {dev}")
        first = None
        for label, fn in rows:
            try:
                fn()  # warm-up
            except Exception as e:  # noqa: BLE001 - Liger imports on a cpu, but Triton has no driver there
                if fn is not theirs:
                    raise
                liger, liger_error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                break
            h.grad = w.grad = None
            peak, secs = peak_of(dev, fn)
            h.grad = w.grad = None
            first = first or (peak, secs)
            print(f"  {label:<32} peak {headroom.format_bytes(peak):>10} ({peak / first[0]:.3f}x)  "
                  f"{secs:.3f} s ({secs / first[1]:.2f}x)")
        if liger is None:
            print(f"  liger fused linear CE            cannot run here: {liger_error}")


if __name__ == "__main__":
    main()
