"""The torch headroom's extension was built against, checked against the torch it is imported with.

The extension links LibTorch's C++ symbols, which change between torch's minor releases: imported
under another torch it would fail with an undefined symbol, or worse, load and misbehave. The build
records its torch in ``_build.py`` (written by CMake); the import compares the two releases first and
says in one line what to do.
"""


def release(version: str) -> tuple[int, int]:
    """``"2.15.0+cu130"`` -> ``(2, 15)``: the part of a torch version its C++ ABI follows."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "-1")
    except (IndexError, ValueError):
        return (-1, -1)


def built_against() -> str | None:
    """The torch version this build of the extension links, or None for a build that did not record it."""
    try:
        from ._build import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION


REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps <headroom's source>"


def mismatch_message(built: str | None, running: str) -> str:
    if built is None:
        return f"headroom's extension does not load with torch {running}: rebuild it here ({REBUILD})"
    return (f"headroom was built against torch {built} but this Python has torch {running}: rebuild it here "
            f"({REBUILD}) or install torch=={built.split('+')[0]}")


def check(running: str) -> None:
    """Raises ImportError (one line) when the build's torch and ``running`` differ in their minor release."""
    built = built_against()
    if built is not None and release(built) != release(running):
        raise ImportError(mismatch_message(built, running))
