"""Errors the executor's CLI turns into one line and exit code 2, never a traceback."""

from __future__ import annotations


class ExecutorError(Exception):
    """A problem with the user's model, batch or files that the executor explains (exit code 2).

    The message is one line: what (which module, tensor, file or field), what was expected, and the fix.
    """

    exit_code = 2


def out_of_memory(what: str, nbytes: int | None, device: object, exc: BaseException) -> ExecutorError:
    """`torch.OutOfMemoryError` as one line: what needed the bytes, how many, what the GPU had free, the fix.

    The schedule's DEVICE budget promised that memory: another process on the GPU, fragmentation or a
    budget solved for a larger GPU took it (a real GPU's usable memory is less than its size)."""
    import torch

    free = ""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        try:
            free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
            free = f"; the GPU has {free_bytes / 2**30:.3g} GiB free of {total_bytes / 2**30:.3g} GiB"
        except Exception:  # noqa: BLE001 - the error itself must not fail
            free = ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    need = f"{nbytes} bytes" if nbytes is not None else "more memory"
    return ExecutorError(f"out of memory on {dev}: {what} needed {need}{free} ({first}); the schedule's "
                         "DEVICE budget is more than this GPU can give: re-solve with a smaller `--device-memory-gb` "
                         "(`python -m planner solve ... --device-memory-gb N`)")
