"""Hostile callers and operators: figures bounded by the device, requests bounded before any work,
flags finite and bounded, devices that expire, no phantom memory, reports that never fail."""
from __future__ import annotations

import argparse

import grpc
import pytest
from google.rpc import error_details_pb2
from gpuplane.governor.v1 import governor_pb2 as pb
from gpuplane.governor.v1 import governor_pb2_grpc
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import InvalidArgument, ResourceExhausted
from services.governor import ledger as ledger_module
from services.governor.ledger import DeviceReport, DeviceSpec, Ledger, ZoneReport
from services.governor.policy import MAX_DEVICE_BYTES, MAX_ID_CHARS, Policy
from services.governor.server import start_governor
from services.governor.servicer import MAX_REQUEST_BYTES, device_pb
from tests.governor.ledgers import make

MIB = 1 << 20
I64_MAX = (1 << 63) - 1
GPU = DeviceSpec("GPU-h", total_bytes=2000 * MIB, free_bytes=1000 * MIB, granule_bytes=2 * MIB)


def snapshot(ledger: Ledger) -> list:
    return [(d.uuid, d.device_used_bytes, d.ledger_bytes, d.unaccounted_bytes,
             [(w.worker_id, w.committed_bytes, w.process_used_bytes) for w in d.workers])
            for d in ledger.resources()]


# ---- heartbeat figures -------------------------------------------------------------------------

@pytest.mark.parametrize("figures", [
    {"device_used": 2000 * MIB + 1},
    {"process_used": 2000 * MIB + 1},
    {"zones": {"kv": (2000 * MIB + 1, 0)}},
    {"zones": {"kv": (0, I64_MAX)}},
    {"zones": {"kv": (1500 * MIB, 0), "weights": (1500 * MIB, 0)}},  # each fits, the sum does not
], ids=["device_used", "process_used", "committed", "content", "committed-sum"])
def test_a_heartbeat_figure_beyond_the_device_total_is_invalid_argument_and_changes_nothing(
        tmp_path, clock, figures):
    ledger = make(tmp_path, clock)
    token = ledger.register("w1", GPU).incarnation
    ledger.heartbeat("w1", "", 800 * MIB, 10 * MIB, {"kv": (300 * MIB, 300 * MIB)}, token)
    before = snapshot(ledger)
    with pytest.raises(InvalidArgument, match="2097152000 bytes in all"):
        ledger.heartbeat("w1", "", figures.get("device_used", 0), figures.get("process_used", 0),
                         figures.get("zones", {}), token)
    assert snapshot(ledger) == before, "a refused heartbeat changed the reports"


def test_figures_near_int64_max_never_make_get_resources_or_watch_resources_fail(tmp_path):
    server, _ = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite", Policy(budget_fraction=1.0),
                               tracer_provider=TracerProvider())
    channel = grpc.insecure_channel(server.address)
    stub = governor_pb2_grpc.GovernorServiceStub(channel)
    try:
        stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id="liar", device=pb.Device(
            uuid="GPU-h", total_bytes=2000 * MIB, free_bytes=1000 * MIB)), timeout=5)
        lie = pb.HeartbeatRequest(worker_id="liar", device_used_bytes=I64_MAX, zones=[
            pb.ZoneUsage(zone=pb.ZONE_KV, committed_bytes=I64_MAX, content_bytes=I64_MAX),
            pb.ZoneUsage(zone=pb.ZONE_WEIGHTS, committed_bytes=I64_MAX, content_bytes=I64_MAX)])
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(lie, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (device,) = stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices
        assert device.device_used_bytes == 0 and not device.unaccounted_alert, \
            "the refused lie left figures or an alert behind"
        first = next(stub.WatchResources(pb.WatchResourcesRequest(), timeout=5))
        assert [d.uuid for d in first.devices] == ["GPU-h"]
    finally:
        channel.close()
        server.stop(grace=0)


def test_a_report_saturates_at_int64_rather_than_failing_to_serialize():
    """The conversion's own guard, whatever the ledger's figures add up to."""
    huge = 1 << 70
    zone = ZoneReport("kv", huge, huge, huge, 0, 0)
    report = DeviceReport("GPU-h", "", huge, huge, 0, 0, huge, huge, 2 * huge, -2 * huge, False,
                          [zone], [])
    message = device_pb(report)
    parsed = pb.DeviceResources.FromString(message.SerializeToString())
    assert parsed.ledger_bytes == I64_MAX and parsed.unaccounted_bytes == -I64_MAX - 1
    assert parsed.zones[0].committed_bytes == I64_MAX


# ---- devices and phantom memory ----------------------------------------------------------------

def test_a_device_with_no_worker_is_forgotten_after_the_device_ttl_and_not_before(tmp_path, clock):
    ledger = make(tmp_path, clock, lease_ttl_s=10, device_ttl_s=100)
    for i in range(3):  # one id hopping over made-up devices
        token = ledger.register("hopper", DeviceSpec(f"GPU-fake-{i}", 100 * MIB, 100 * MIB))
        ledger.deregister("hopper", token.incarnation)
    ledger.register("alive", GPU)
    clock.now += 50
    ledger.heartbeat("alive", "", 0, 0, {})
    assert ledger.expire() == []
    assert len(ledger.resources()) == 4, "a device must outlive its last worker by the device TTL"
    clock.now += 51
    ledger.heartbeat("alive", "", 0, 0, {})
    ledger.expire()
    assert [d.uuid for d in ledger.resources()] == ["GPU-h"], \
        "devices with no worker must be forgotten after the device TTL"
    reopened = make(tmp_path, clock, lease_ttl_s=10, device_ttl_s=100)
    assert [d.uuid for d in reopened.resources()] == ["GPU-h"], "forgotten devices came back"


def test_a_worker_that_moves_to_another_device_leaves_the_first_to_expire_not_the_second(
        tmp_path, clock):
    ledger = make(tmp_path, clock, lease_ttl_s=1000, device_ttl_s=100)
    token = ledger.register("w1", GPU).incarnation
    ledger.register("w1", DeviceSpec("GPU-next", 100 * MIB, 100 * MIB), incarnation=token)
    clock.now += 101
    ledger.heartbeat("w1", "", 0, 0, {}, token)
    ledger.expire()
    assert [d.uuid for d in ledger.resources()] == ["GPU-next"], \
        "the device left behind must expire and the one in use must not"


def test_device_rows_left_from_before_a_restart_expire_too(tmp_path, clock):
    first = make(tmp_path, clock, device_ttl_s=100)
    token = first.register("w1", GPU).incarnation
    first.deregister("w1", token)
    reopened = make(tmp_path, clock, device_ttl_s=100)
    assert [d.uuid for d in reopened.resources()] == ["GPU-h"]
    clock.now += 101
    reopened.expire()
    assert reopened.resources() == [], "a row loaded with no worker must expire"


def test_a_dead_workers_last_device_truth_never_shows_as_unaccounted_memory(tmp_path, clock):
    ledger = make(tmp_path, clock, lease_ttl_s=10, unaccounted_alert_bytes=100 * MIB)
    ledger.register("dying", GPU)
    ledger.register("alive", GPU)
    for _ in range(5):
        clock.now += 1
        ledger.heartbeat("alive", "", 0, 0, {"kv": (200 * MIB, 200 * MIB)})
        ledger.heartbeat("dying", "", 900 * MIB, 0, {"weights": (700 * MIB, 700 * MIB)})
    assert ledger.resources()[0].unaccounted_bytes == 0, "negative control: all memory booked"
    clock.now += 8
    ledger.heartbeat("alive", "", 0, 0, {"kv": (200 * MIB, 200 * MIB)})  # no truth in this beat
    clock.now += 3
    assert ledger.expire() == ["dying"]
    d = ledger.resources()[0]
    assert d.unaccounted_bytes == 0 and d.device_used_bytes == 0, \
        "the dead worker's last device_used shows as unaccounted memory"
    assert {z.zone: z.committed_bytes for z in d.zones}["foreign"] == 0
    clock.now += 1
    ledger.heartbeat("alive", "", 200 * MIB, 0, {"kv": (200 * MIB, 200 * MIB)})
    d = ledger.resources()[0]
    assert (d.device_used_bytes, d.unaccounted_bytes, d.unaccounted_alert) == (200 * MIB, 0, False)


# ---- request bounds over gRPC -------------------------------------------------------------------

@pytest.fixture
def stub(tmp_path):
    server, ledger = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite",
                                    Policy(budget_fraction=1.0), tracer_provider=TracerProvider())
    channel = grpc.insecure_channel(server.address)
    s = governor_pb2_grpc.GovernorServiceStub(channel)
    s.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w1", host="node-a", device=pb.Device(
        uuid="GPU-h", total_bytes=2000 * MIB, free_bytes=1000 * MIB)), timeout=5)
    yield s, ledger
    channel.close()
    server.stop(grace=0)


LONG = "x" * (MAX_ID_CHARS + 1)
DEVICE = pb.Device(uuid="GPU-h", total_bytes=2000 * MIB, free_bytes=1000 * MIB)
ALL_ZONES = [pb.ZoneUsage(zone=z) for z in range(1, 10)]
BOUNDED = {
    "register worker_id": ("RegisterWorker", pb.RegisterWorkerRequest(
        worker_id=LONG, device=DEVICE), "worker_id"),
    "register host": ("RegisterWorker", pb.RegisterWorkerRequest(
        worker_id="w2", host="h" * 257, device=DEVICE), "host"),
    "register device uuid": ("RegisterWorker", pb.RegisterWorkerRequest(
        worker_id="w2", device=pb.Device(uuid=LONG, total_bytes=1, free_bytes=1)), "device.uuid"),
    "register device name": ("RegisterWorker", pb.RegisterWorkerRequest(
        worker_id="w2", device=pb.Device(uuid="u", name="n" * 257, total_bytes=1, free_bytes=1)),
        "device.name"),
    "register device size": ("RegisterWorker", pb.RegisterWorkerRequest(
        worker_id="w2", device=pb.Device(uuid="u", total_bytes=I64_MAX, free_bytes=1)),
        "device.total_bytes"),
    "acquire bytes": ("Acquire", pb.AcquireRequest(
        worker_id="w1", zone=pb.ZONE_KV, bytes=MAX_DEVICE_BYTES + 1), "bytes"),
    "acquire incarnation": ("Acquire", pb.AcquireRequest(
        worker_id="w1", zone=pb.ZONE_KV, bytes=1, incarnation=LONG), "incarnation"),
    "resize lease_id": ("Resize", pb.ResizeRequest(worker_id="w1", lease_id=LONG, bytes=1),
                        "lease_id"),
    "resize bytes": ("Resize", pb.ResizeRequest(worker_id="w1", lease_id="l-x",
                                                bytes=MAX_DEVICE_BYTES + 1), "bytes"),
    "release lease_id": ("Release", pb.ReleaseRequest(worker_id="w1", lease_id=LONG), "lease_id"),
    "heartbeat zones": ("Heartbeat", pb.HeartbeatRequest(
        worker_id="w1", zones=ALL_ZONES + ALL_ZONES[:1]), "zones"),
    "heartbeat duplicate zone": ("Heartbeat", pb.HeartbeatRequest(
        worker_id="w1", zones=ALL_ZONES[:1] * 2), "zones"),
    "heartbeat device_uuid": ("Heartbeat", pb.HeartbeatRequest(worker_id="w1", device_uuid=LONG),
                              "device_uuid"),
    "deregister worker_id": ("DeregisterWorker", pb.DeregisterWorkerRequest(worker_id=LONG),
                             "worker_id"),
    "resources device_uuid": ("GetResources", pb.GetResourcesRequest(device_uuid=LONG),
                              "device_uuid"),
}


@pytest.mark.parametrize("case", list(BOUNDED))
def test_every_size_bearing_request_field_has_a_bound_named_in_its_invalid_argument(stub, case):
    s, ledger = stub
    method, request, field = BOUNDED[case]
    before = snapshot(ledger)
    with pytest.raises(grpc.RpcError) as info:
        getattr(s, method)(request, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details() and "bound" in info.value.details(), \
        f"the refusal must name the field and its bound: {info.value.details()!r}"
    assert snapshot(ledger) == before, "a request past a bound changed the ledger"


def test_a_request_larger_than_the_governor_takes_is_refused_before_any_handler(stub):
    s, ledger = stub
    huge = pb.HeartbeatRequest(worker_id="w1", zones=[pb.ZoneUsage(zone=pb.ZONE_KV)] * (
        MAX_REQUEST_BYTES // 2 + 1))
    assert huge.ByteSize() > MAX_REQUEST_BYTES, "negative control: the request is over the cap"
    with pytest.raises(grpc.RpcError) as info:
        s.Heartbeat(huge, timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ledger.resources()[0].workers[0].last_heartbeat == 0, "the oversized beat was recorded"


def test_a_refused_acquire_says_when_to_retry(stub):
    s, _ = stub
    with pytest.raises(grpc.RpcError) as info:
        s.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV, bytes=1001 * MIB), timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in rpc_status.from_call(info.value).details), \
        "an admission refusal must carry RetryInfo"
    assert retry.retry_delay.ToMilliseconds() == int(ledger_module.ADMISSION_RETRY_S * 1000)
    from services.governor.client import exhausted_from
    assert exhausted_from(info.value).retry_after_s == ledger_module.ADMISSION_RETRY_S, \
        "the client must read the delay back"


@pytest.mark.parametrize("quota,call", [
    ("MAX_WORKERS", lambda led: led.register("w-extra", GPU)),
    ("MAX_DEVICES", lambda led: led.register("w-extra", DeviceSpec("GPU-new", MIB, MIB))),
    ("MAX_LEASES_PER_WORKER", lambda led: led.acquire("w0", "", "kv", MIB)),
])
def test_state_a_caller_can_make_the_governor_keep_is_a_quota_refused_with_quota_failure(
        tmp_path, clock, monkeypatch, quota, call):
    monkeypatch.setattr(ledger_module, quota, 2)
    ledger = make(tmp_path, clock)
    ledger.register("w0", GPU)
    ledger.register("w1", DeviceSpec("GPU-b", 100 * MIB, 100 * MIB))
    ledger.acquire("w0", "", "kv", MIB)
    ledger.acquire("w0", "", "kv", MIB)
    with pytest.raises(ResourceExhausted) as info:
        call(ledger)
    assert info.value.violations, "a quota refusal must name the quota (QuotaFailure)"
    assert info.value.retry_after_s > 0


# ---- flags and policy ---------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--lease-ttl-seconds", "--device-ttl-seconds",
                                  "--budget-fraction"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "-1", "0"])
def test_governor_flags_refuse_non_finite_or_unbounded_values_at_parse_time(
        capsys, flag, value):
    from services.governor.__main__ import _parser

    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["serve", f"{flag}={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "not a finite number in" in err, err


@pytest.mark.parametrize("flag", ["--transient-headroom", "--unaccounted-alert", "--zone-budget"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e300GiB", "2PiB", "4096TiB"])
def test_governor_byte_flags_refuse_non_finite_or_unbounded_sizes_at_parse_time(
        capsys, flag, value):
    from services.governor.__main__ import _parser

    arg = f"kv={value}" if flag == "--zone-budget" else value
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", flag, arg])
    assert flag in capsys.readouterr().err


def test_a_bad_flag_value_in_the_environment_names_the_variable(monkeypatch, capsys):
    from services.governor.__main__ import _parser

    monkeypatch.setenv("GPUPLANE_GOVERNOR_LEASE_TTL_SECONDS", "inf")
    with pytest.raises(SystemExit) as info:
        _parser()
    assert info.value.code == 2
    assert "GPUPLANE_GOVERNOR_LEASE_TTL_SECONDS" in capsys.readouterr().err


def test_sane_governor_flags_still_parse():
    """Negative control for the refusals above."""
    from services.governor.__main__ import _parser

    args = _parser().parse_args(["serve", "--lease-ttl-seconds", "2.5", "--device-ttl-seconds",
                                 "60", "--budget-fraction", "1", "--zone-budget", "kv=8GiB",
                                 "--metrics-port", "9100"])
    assert (args.lease_ttl_seconds, args.device_ttl_seconds, args.metrics_port) == (2.5, 60, 9100)


@pytest.mark.parametrize("field", ["lease_ttl_s", "device_ttl_s", "unaccounted_window_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, 0.0, -1.0])
def test_a_policy_refuses_a_duration_that_is_not_finite_positive_and_bounded(field, value):
    with pytest.raises(InvalidArgument, match="finite number of seconds"):
        Policy(**{field: value})


def test_a_policy_refuses_sizes_past_the_bound():
    for kwargs in ({"transient_headroom_bytes": MAX_DEVICE_BYTES + 1},
                   {"zone_budgets": {"kv": MAX_DEVICE_BYTES + 1}},
                   {"unaccounted_alert_bytes": MAX_DEVICE_BYTES + 1}):
        with pytest.raises(InvalidArgument, match="1 PiB"):
            Policy(**kwargs)


def test_parse_time_types_are_argparse_errors_not_tracebacks():
    from services.common.config import bounded_number

    with pytest.raises(argparse.ArgumentTypeError):
        bounded_number(0, 10, "--x")("inf")


def test_a_database_from_before_incarnations_is_migrated_and_each_id_is_claimed_once(
        tmp_path, clock):
    import sqlite3

    conn = sqlite3.connect(tmp_path / "gov.sqlite")
    conn.executescript("""
        CREATE TABLE devices (uuid TEXT PRIMARY KEY, name TEXT, total_bytes INTEGER,
                              budget_bytes INTEGER, granule_bytes INTEGER);
        CREATE TABLE workers (worker_id TEXT PRIMARY KEY, device_uuid TEXT, host TEXT);
        INSERT INTO devices VALUES ('GPU-h', '', 2097152000, 1048576000, 0);
        INSERT INTO workers VALUES ('w1', 'GPU-h', 'node-a');""")
    conn.commit()
    conn.close()
    ledger = make(tmp_path, clock)
    claimed = ledger.register("w1", GPU, host="node-a")
    assert claimed.incarnation, "the first registration of a migrated id claims it"
    with pytest.raises(ledger_module.AlreadyExists):
        ledger.register("w1", GPU, host="node-b")
