"""Property-based fuzzing of a real ds3dd (issue 17): over a thousand generated requests across
every RPC of ds3d.v1.Control, as a careless or hostile client would send them: wrong types and
out-of-range values in job configurations, huge and non-finite numbers, unicode, control
characters, path-like and whitespace names, oversized messages and raw bytes that are no
protobuf at all.

What must hold for every request: the daemon answers with a status code a client can act on
(never INTERNAL or UNKNOWN). And afterwards: health says SERVING, ListJobs works, nothing was
created outside the daemon's state directory and the checkpoint store, and a new ds3dd starts
on the same state directory.

Requests are built to be refused fast: the one job that may be accepted (named `fz`, started
and stopped before the fuzzing) makes every later valid configuration ALREADY_EXISTS, generated
names of new jobs are never valid, and StartShare always carries an invalid job, so no worker
is started while fuzzing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds3d.trainer.config import valid_job_name

from test_daemon_support import BIN, DaemonProc, kill_job_processes, new_token, pb, tiny_job_json

pytestmark = pytest.mark.timeout(300)

EXAMPLES = int(os.environ.get("DS3D_FUZZ_EXAMPLES", "1100"))
MARK = "fzmark"  # in every generated path, to find anything created from one
CONTROL = pb.DESCRIPTOR.services_by_name["Control"]
METHODS = [m.name for m in CONTROL.methods]
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}


def _walk(root: Path, skip: set[Path]) -> set[str]:
    """Every path under `root` except the subtrees in `skip`."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        out.update(str(here / n) for n in dirnames + filenames)
    return out


# ---- strategies ------------------------------------------------------------------------------

def _strategies(outside: Path, store: Path) -> dict[str, st.SearchStrategy]:
    paths = st.sampled_from([
        f"{outside}/{MARK}.bin", f"{outside}/{MARK}/../{MARK}2.bin", f"../{MARK}.bin",
        f"{MARK}/../../{MARK}.bin", f"./{MARK}", f"~/{MARK}.bin", f"/proc/self/{MARK}.bin",
        f"file://{outside}/{MARK}", f"file:///{MARK}/..", f"file://{store}/../{MARK}",
        f"s3://{MARK}/x", f"s3://../{MARK}", f"{outside}/{'d' * 300}/{MARK}.bin",
        f"{outside}/{MARK}\n.bin", f"{outside}/{MARK}\x00.bin", f"{outside}/{MARK} .bin"])
    weird_text = st.one_of(
        st.text(max_size=24),
        st.text(alphabet=st.characters(max_codepoint=0x9F), max_size=12),
        st.sampled_from(["", " ", "\t", "\n", "\r\n", "nl\n", "fz\n", "fz ", " fz", "FZ", "..",
                         "../..", "/", "fz/..", "\x00", "\x1b[2J", "\u2028", "\ufeff", "é",
                         "Ω" * 30, "a" * 64, "a" * 5000, "-x", ".hidden", "_x"]),
        paths)
    invalid_names = weird_text.filter(lambda s: not valid_job_name(s))
    numbers = st.one_of(
        st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -2**63,
                         2**64, 10**12, 10**30, 10**400, float("nan"), float("inf"),
                         float("-inf"), 1e308, -0.0, 5e-324, 0.5, 1.5]),
        st.integers(), st.floats())
    values = st.recursive(
        st.one_of(numbers, weird_text, st.booleans(), st.none()),
        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                st.dictionaries(st.text(max_size=6), inner, max_size=3)),
        max_leaves=6)
    return {"paths": paths, "text": weird_text, "invalid_names": invalid_names,
            "numbers": numbers, "values": values}


def _leaf_paths(d: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for k, v in d.items():
        out += _leaf_paths(v, prefix + (k,)) if isinstance(v, dict) and v else [prefix + (k,)]
    return out


def _config_strategy(base: dict, s: dict[str, st.SearchStrategy], *,
                     force_bad_name: bool) -> st.SearchStrategy[str]:
    """A job as JSON: the base job with 1-4 fields set to nasty values (sometimes a new key),
    or not a job at all; with `force_bad_name`, the name is always one no job may have."""
    leaves = _leaf_paths(base) + [("train", "learning_rate"), ("bogus",), ("model", "x", "y")]
    mutation = st.tuples(st.sampled_from(leaves),
                         st.one_of(s["values"], s["paths"], s["numbers"]))

    def build(mutations: list, name: str | None) -> str:
        job = copy.deepcopy(base)
        for path, value in mutations:
            node = job
            for key in path[:-1]:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            node[path[-1]] = value
        if name is not None:
            job["name"] = name
        return json.dumps(job)  # NaN/Infinity as JSON's extensions, ints of any size

    names = s["invalid_names"] if force_bad_name else st.one_of(st.none(), s["invalid_names"])
    jobs = st.builds(build, st.lists(mutation, min_size=0 if force_bad_name else 1,
                                     max_size=4), names)
    garbage = st.one_of(st.text(max_size=40), st.sampled_from(
        ["null", "[]", "{}", "1e999", "NaN", '{"name": "fz"', '{"model": 1}', "\"\"",
         json.dumps({"name": "fz", "model": base["model"]}) + " trailing",
         json.dumps(base)]))  # valid, and taken: ALREADY_EXISTS
    return st.one_of(jobs, jobs, jobs, garbage)


def _field_strategy(f: FieldDescriptor, s: dict[str, st.SearchStrategy],
                    names: st.SearchStrategy) -> st.SearchStrategy:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        return st.dictionaries(s["text"], st.integers(-2**63, 2**63 - 1), max_size=3)
    scalar = {
        FieldDescriptor.TYPE_STRING: names if f.name in ("name", "head_node") else s["text"],
        FieldDescriptor.TYPE_BOOL: st.booleans(),
        FieldDescriptor.TYPE_INT32: st.one_of(st.sampled_from([0, -1, 2**31 - 1, -2**31]),
                                              st.integers(-2**31, 2**31 - 1)),
        FieldDescriptor.TYPE_INT64: st.one_of(st.sampled_from([0, -1, 2**63 - 1, -2**63]),
                                              st.integers(-2**63, 2**63 - 1)),
        FieldDescriptor.TYPE_DOUBLE: st.floats(),
        FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    }.get(f.type)
    if scalar is None:  # an enum or nested message in a request: leave it unset
        return st.none()
    if f.is_repeated:
        return st.lists(scalar, max_size=3)
    return scalar


def _request_strategy(method: str, s: dict, base: dict) -> st.SearchStrategy:
    desc = CONTROL.methods_by_name[method].input_type
    cls = getattr(pb, desc.name)
    names = st.one_of(st.just("fz"), st.just("nosuch"), st.just(""), s["text"])
    fields = {}
    for f in desc.fields:
        if f.name == "config_json":
            fields[f.name] = _config_strategy(base, s, force_bad_name=method == "StartShare")
        else:
            fields[f.name] = _field_strategy(f, s, names)

    def make(values: dict) -> tuple[str, object]:
        kwargs = {k: v for k, v in values.items() if v is not None}
        return method, cls(**kwargs)

    return st.fixed_dictionaries(fields).map(make)


def _all_requests(s: dict, base: dict) -> st.SearchStrategy:
    typed = st.one_of(*[_request_strategy(m, s, base) for m in METHODS])
    raw = st.tuples(st.sampled_from(METHODS), st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\x0f", b"\x0a\x02\xc3\x28",
                         b"\x0a\x05ab", b"\x08" + b"\xff" * 10 + b"\x01", b"\x12\x00" * 500]),
    )).map(lambda mb: (mb[0], bytes(mb[1])))
    oversized = st.integers(1 << 20, 3 << 20).map(
        lambda n: ("StartJob", pb.StartJobRequest(config_json="x" * n)))
    return st.one_of(typed, typed, typed, typed, raw, st.one_of(oversized, raw))


# ---- the test --------------------------------------------------------------------------------

@pytest.fixture
def fuzz_env(tmp_path, monkeypatch):
    """A real ds3dd (token, fault injection on, stand-in workers) whose working directory is
    an empty folder of the test's own, so relative paths land where they can be seen."""
    root = tmp_path
    (root / "cwd").mkdir()
    (root / "outside").mkdir()
    monkeypatch.chdir(root / "cwd")
    d = DaemonProc(root / "state", token=new_token(), worker_dir=root / "worker",
                   args=["--enable-fault-injection"])
    d.start()
    yield root, d
    d.stop()
    kill_job_processes(d.state_dir)


def _send(channel: grpc.Channel, d: DaemonProc, method: str, request: object,
          md: list[tuple[str, str]]) -> grpc.StatusCode:
    desc = CONTROL.methods_by_name[method]
    path = f"/ds3d.v1.Control/{method}"
    serialize = None if isinstance(request, bytes) else type(request).SerializeToString
    watch = request
    if method == "WatchEvents" and isinstance(request, bytes):  # raw bytes that decode
        try:
            watch = pb.WatchEventsRequest.FromString(request)
        except Exception:  # noqa: BLE001 - undecodable: refused at once
            watch = None
    follow_all = method == "WatchEvents" and isinstance(watch, pb.WatchEventsRequest) and \
        watch.follow and not watch.name
    timeout = 0.5 if follow_all else 60.0  # generous: a loaded CI machine, not a hang
    try:
        if desc.server_streaming:
            for _ in channel.unary_stream(path, request_serializer=serialize)(
                    request, timeout=timeout, metadata=md):
                pass
        else:
            channel.unary_unary(path, request_serializer=serialize)(
                request, timeout=timeout, metadata=md)
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and follow_all:
            return code  # following every job's events never ends by itself
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # a hang: say where the daemon is
            dump = subprocess.run([str(BIN / "py-spy"), "dump", "--pid", str(d.proc.pid)],
                                  capture_output=True, text=True, timeout=60)
            raise AssertionError(f"{method} hung; ds3dd threads:\n{dump.stdout[-6000:]}") from e
        assert code in ALLOWED, (method, request if not isinstance(request, bytes) else
                                 request[:80], code, e.details())
        assert "Traceback" not in (e.details() or "")
        return code
    return grpc.StatusCode.OK


def test_fuzz_every_control_rpc_against_a_real_daemon(fuzz_env):
    root, d = fuzz_env
    store = root / "store"
    base = json.loads(tiny_job_json(name="fz", checkpoint={"store": f"file://{store}"}))
    channel = grpc.insecure_channel(d.addr, options=[("grpc.max_send_message_length", 8 << 20)])
    good_md = d.md()
    # the only job that can be accepted, started (and stopped) before the fuzzing: every valid
    # configuration generated later is ALREADY_EXISTS, refused before the store is touched
    assert _send(channel, d, "StartJob", pb.StartJobRequest(config_json=json.dumps(base)),
                 good_md) == grpc.StatusCode.OK
    assert _send(channel, d, "StopJob", pb.StopJobRequest(name="fz", now=True),
                 good_md) == grpc.StatusCode.OK
    before = _walk(root, {root / "state", store})

    s = _strategies(root / "outside", store)
    requests = _all_requests(s, base)
    metadata = st.sampled_from([good_md] * 12 + [[], [("authorization", "Bearer wrong-token")]])
    seen: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    slowest: Counter[str] = Counter()
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(req=requests, md=metadata)
    def one_request(req: tuple[str, object], md: list[tuple[str, str]]) -> None:
        method, request = req
        t0 = time.monotonic()
        code = _send(channel, d, method, request, md)
        took = time.monotonic() - t0
        slowest[method] = max(slowest[method], took)
        seen[method] += 1
        codes[code.name] += 1

    one_request()
    elapsed = time.monotonic() - started
    print(f"fuzz: {sum(seen.values())} requests in {elapsed:.1f} s; codes {dict(codes)}; "
          f"slowest {[(m, round(t, 3)) for m, t in slowest.most_common(5)]}")

    assert sum(seen.values()) >= 1000, seen
    assert set(METHODS) <= set(seen), set(METHODS) - set(seen)
    assert codes["OK"] and codes["INVALID_ARGUMENT"], codes
    # a valid configuration after the fuzzing is still refused by name, before the store
    assert _send(channel, d, "StartJob", pb.StartJobRequest(config_json=json.dumps(base)),
                 good_md) == grpc.StatusCode.ALREADY_EXISTS
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    listed = pb_grpc_list(channel, good_md)
    assert [j.spec.name for j in listed] == ["fz"], [j.spec.name for j in listed]
    channel.close()

    after = _walk(root, {root / "state", store})
    assert after == before, sorted(after - before)
    assert not [p for p in Path("/tmp").iterdir() if MARK in p.name]
    assert not [p for p in Path.home().iterdir() if MARK in p.name]

    d.stop()  # and a new daemon starts on the same state directory
    d.start()
    channel = grpc.insecure_channel(d.addr)
    with channel:
        assert health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert [j.spec.name for j in pb_grpc_list(channel, good_md)] == ["fz"]


def pb_grpc_list(channel: grpc.Channel, md: list[tuple[str, str]]) -> list:
    from ds3d.v1 import control_pb2_grpc

    return list(control_pb2_grpc.ControlStub(channel).ListJobs(
        pb.ListJobsRequest(include_finished=True), timeout=10, metadata=md).jobs)
