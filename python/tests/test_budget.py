"""cpu_budget: an unchanged loop runs out of memory where a card of that size would."""
import headroom
import pytest
import torch

MIB = 1 << 20


def leaky_loop(steps):
    """Each step keeps 1 MiB and uses 4 MiB more for a while: live after step k is k MiB above the start."""
    kept = []
    for step in range(1, steps + 1):
        kept.append(torch.empty(MIB, dtype=torch.uint8))
        scratch = torch.empty(4 * MIB, dtype=torch.uint8)
        del scratch
        yield step


def test_unchanged_loop_raises_at_the_predicted_step():
    start = headroom._core.cpu_live_bytes()
    # Step k needs start + k MiB + 4 MiB at its peak: 10.5 MiB above the start fits k <= 6.
    budget = start + int(10.5 * MIB)
    reached = 0
    with headroom.cpu_budget(budget):
        with pytest.raises(torch.OutOfMemoryError, match="4.00 MiB"):
            for reached in leaky_loop(20):
                pass
    assert reached == 6  # step 7 failed inside
    assert headroom._core.cpu_budget() is None  # the with block put back the previous (none)


def test_sizes_and_errors():
    assert headroom.parse_size("8GiB") == 8 << 30
    assert headroom.cpu_budget("512MiB").bytes == 512 << 20
    assert headroom._core.cpu_budget() == 512 << 20
    headroom.cpu_budget(None)
    with pytest.raises(ValueError, match="size"):
        headroom.cpu_budget("lots")
    with pytest.raises(ValueError, match="positive"):
        headroom.cpu_budget(-5)


def test_injected_fault_is_a_torch_oom():
    headroom.inject_cpu_oom(1)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(16)
    torch.empty(16)  # one-shot
