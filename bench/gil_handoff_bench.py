"""What a short C call costs a thread when another thread runs Python: handing the GIL over, or not.

The worker's engine thread makes a few driver calls a step while the event loop thread writes the
step's messages (docs/worker.md, "The GIL between the engine and the edge"). cuda-python releases
the GIL around every driver call; device/cuda_enqueue.py keeps it for the calls that only
enqueue. This bench measures the mechanism on the host alone, no GPU: the same C call (libc's
`memset` of `--call-bytes`, a few microseconds as a driver enqueue is) through `ctypes.CDLL`
(releases the GIL, as cuda-python does) and through `ctypes.PyDLL` (keeps it, as
cuda_enqueue.py does),
- alone: the call's own cost, the limit;
- while a second thread runs Python without pause (a loop writing messages),
at the worker's switch interval (0.2 ms, --gil-switch-ms) and at Python's own (5 ms).

Figures (microseconds a call, median of `--trials`, their spread printed): each pairing above. A
trial's calls that hand the GIL over lose it to the busy thread on some calls and not others
(whether it wakes within the call's few microseconds), so those figures spread widely, most at
5 ms where each loss costs a whole interval. Target: with the busy
thread at the worker's interval, a call that keeps the GIL costs at most 2.5x its time alone
(the busy thread takes its fair half of the CPU through the forced switches, no more); a call
that hands the GIL over waits for the busy thread's switch on many calls, so its ratio is a
figure, printed beside it.

    python -m bench.gil_handoff_bench [--calls 2000] [--call-bytes 131072] [--trials 5] [--record]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable

from bench.record import add_record_flag
from bench.targets import Targets

INTERVALS_MS = (0.2, 5.0)


def _memset(kind: type[ctypes.CDLL], nbytes: int) -> Callable[[], object]:
    fn = kind(None).memset     # None: the symbols already in the process (libc's)
    fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(nbytes)
    return lambda: fn(buf, 1, nbytes)


def per_call_us(fn: Callable[[], object], calls: int, busy: bool) -> float:
    """Microseconds a call of `fn`, `calls` in a row, with or without a thread running Python."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(200):
                x += i

    other = threading.Thread(target=spin, daemon=True)
    if busy:
        other.start()
        time.sleep(0.01)       # it holds the GIL, as a loop mid-write does
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        stop.set()
        if busy:
            other.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000,
                   help="calls a trial (those that hand the GIL over: 1/10 of it at 5 ms)")
    p.add_argument("--call-bytes", type=int, default=128 << 10,
                   help="bytes the C call sets (its length: 128 KiB is a few microseconds)")
    p.add_argument("--trials", type=int, default=5)
    add_record_flag(p)
    args = p.parse_args(argv)
    targets = Targets("gil_handoff_bench", args=args)
    calls = {"hands the GIL over": _memset(ctypes.CDLL, args.call_bytes),
             "keeps the GIL": _memset(ctypes.PyDLL, args.call_bytes)}
    before = sys.getswitchinterval()
    us: dict[tuple[str, float, bool], float] = {}
    try:
        for ms in INTERVALS_MS:
            sys.setswitchinterval(ms / 1e3)
            for name, fn in calls.items():
                for busy in (False, True):
                    n = args.calls // 10 if busy and ms > 1 and "over" in name else args.calls
                    runs = [per_call_us(fn, n, busy) for _ in range(args.trials)]
                    t = us[name, ms, busy] = statistics.median(runs)
                    label = f"a call that {name}, {'another thread busy' if busy else 'alone'}, " \
                            f"switch interval {ms:g} ms"
                    print(f"{label}: {t:9.2f} us (trials {min(runs):.2f}-{max(runs):.2f})",
                          flush=True)
                    targets.figure(label, t, "us")
    finally:
        sys.setswitchinterval(before)
    for ms in INTERVALS_MS:
        over = us["hands the GIL over", ms, True] / us["hands the GIL over", ms, False]
        print(f"a call that hands the GIL over, busy / alone, {ms:g} ms: {over:.1f}x")
        targets.figure(f"a call that hands the GIL over, busy / alone, switch interval {ms:g} ms",
                       over, "ratio")
    kept = us["keeps the GIL", 0.2, True] / us["keeps the GIL", 0.2, False]
    targets.check("a call that keeps the GIL, busy / alone, switch interval 0.2 ms", kept, "<=",
                  2.5, unit="ratio")
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
