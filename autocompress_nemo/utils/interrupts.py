"""Ctrl-C held back while a checkpoint is written: a SIGINT that arrives inside :func:`ctrl_c_deferred`
is noted, the block finishes (the checkpoint is whole, its writer processes see their parent to the
end) and the interrupt is delivered on the way out, as the handler that was installed would have
delivered it. Without this, a Ctrl-C during Megatron's checkpoint save interrupted the parent while a
``multiprocessing`` manager child was starting, and that child printed a ``BrokenPipeError``
traceback next to the one-line "interrupted" (seen in CI, test_bad_inputs_interrupt). Outside the
main thread, or with SIGINT ignored, the block runs as it is."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    if before in (signal.SIG_IGN, None):
        yield
        return
    got: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if got:  # delivered now, by the handler that was there (KeyboardInterrupt, or the default end)
            signal.raise_signal(signal.SIGINT)
