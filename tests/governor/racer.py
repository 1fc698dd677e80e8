"""A worker process for the race test: reserve until refused, print what it holds as JSON.

Run as `python tests/governor/racer.py TARGET WORKER_ID GO_FILE STEP_BYTES CHUNK_BYTES`; it waits
for GO_FILE so that every racer starts at once, and exits without deregistering so that the
governor still holds its leases for the test to compare.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from services.common.errors import ResourceExhausted
from services.governor.client import DeviceDescription, GovernorClient

MIB = 1 << 20


def main() -> None:
    target, worker_id, go_file, step, chunk = sys.argv[1:6]
    device = DeviceDescription("GPU-race", "race", 4096 * MIB, 256 * MIB, 2 * MIB)
    client = GovernorClient(target, worker_id, device, chunk_bytes=int(chunk), heartbeat_s=0.5)
    while not pathlib.Path(go_file).exists():
        time.sleep(0.005)
    reserved, refusals = 0, 0
    while refusals < 3:  # a few refusals in a row: the budget is gone, not just contended
        try:
            client.reserve("kv", int(step))
            reserved += int(step)
            refusals = 0
        except ResourceExhausted as err:
            if "unreachable" in err.message:  # a deadline under load, not the budget: go on
                time.sleep(0.1)
                continue
            refusals += 1
    # A call that timed out may still have been granted: wait for the re-registration that
    # reconciles both sides' leases before reporting what this worker holds.
    deadline = time.monotonic() + 30
    while not (client.connected() and client.stats()["registered"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"worker_id": worker_id, "reserved": reserved,
                      "lease_ids": sorted(client.lease_ids()),
                      "leased": sum(client.leased().values())}), flush=True)
    os._exit(0)  # no close(): the leases must stay with the governor


if __name__ == "__main__":
    main()
