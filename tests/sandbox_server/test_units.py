"""In-process unit tests: output capture, the wire schema, tier choice, config, framing, outcome records."""

from __future__ import annotations

import contextlib
import io
import json
import platform
import subprocess
import sys

import pytest

from sandbox_server import linux, schema
from sandbox_server.config import ServerConfig, build_arg_parser, choose_tier
from sandbox_server.framing import encode_frame, split_frames
from sandbox_server.metrics import Metrics
from sandbox_server.output import StreamCapture
from sandbox_server.runner import encode_record, execute, precompile
from sandbox_server.worker import _take_record

LIMITS = dict(default_timeout=10.0, max_timeout=60.0, max_code_chars=100, max_stdin_chars=10)


def test_capture_keeps_everything_under_the_limit():
    capture = StreamCapture(10)
    for chunk in (b"abc", b"de", b"fgh"):
        capture.feed(chunk)
    assert capture.text() == "abcdefgh" and capture.total == 8


def test_capture_keeps_head_and_tail_with_marker():
    capture = StreamCapture(8)
    for i in range(1000):
        capture.feed(bytes([65 + i % 26]))
    text = capture.text()
    assert text.startswith("ABCD") and text.endswith("IJKL")  # bytes 996..999 are I, J, K, L
    assert "992 bytes of output omitted" in text
    assert len(capture.head) + len(capture.tail) <= 4 + 8  # bounded however much is fed


def test_capture_replaces_undecodable_bytes():
    capture = StreamCapture(100)
    capture.feed(b"ok \xff\xfe \xe2\x82")
    assert capture.text() == "ok \ufffd\ufffd \ufffd"


def test_capture_rejects_tiny_limit():
    with pytest.raises(ValueError, match="keep_bytes"):
        StreamCapture(1)


def test_validate_request_normalises():
    request = schema.validate_run_request({"code": "print(1)"}, **LIMITS)
    assert request == {
        "code": "print(1)",
        "stdin": "",
        "timeout": 10.0,
        "session": None,
        "session_token": None,
    }
    request = schema.validate_run_request(
        {"code": "x", "stdin": None, "timeout": 3, "session": "s"}, **LIMITS
    )
    assert request["timeout"] == 3.0 and isinstance(request["timeout"], float) and request["stdin"] == ""


@pytest.mark.parametrize(
    "obj, message",
    [
        ([], "must be an object"),
        ({}, "'code' must be a string"),
        ({"code": "x" * 101}, "limit is 100"),
        ({"code": "x", "stdin": 3}, "'stdin' must be a string"),
        ({"code": "x", "stdin": "y" * 11}, "'stdin' has 11"),
        ({"code": "x", "timeout": True}, "'timeout' must be a number"),
        ({"code": "x", "timeout": 0}, "must be in (0, 60.0]"),
        ({"code": "x", "timeout": float("nan")}, "must be in"),
        ({"code": "x", "timeout": 61}, "must be in"),
        ({"code": "x", "session": ""}, "'session' must be a non-empty string"),
        ({"code": "x", "session": "s" * 200}, "longer than"),
        ({"code": "x", "session": "s", "session_token": 5}, "'session_token' must be a non-empty string"),
        ({"code": "x", "session_token": "t"}, "without a 'session'"),
        ({"code": "x", "timeout": 10**400}, "'timeout' must be in"),  # a JSON integer past float range
        ({"code": "x", "extra": 1}, "unknown request field"),
    ],
)
def test_validate_request_errors(obj, message):
    with pytest.raises(
        schema.SchemaError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        schema.validate_run_request(obj, **LIMITS)


def test_batch_envelope():
    assert schema.validate_batch_request({"requests": [1, 2]}, max_batch=2) == [1, 2]
    with pytest.raises(schema.SchemaError, match="limit is 2"):
        schema.validate_batch_request({"requests": [1, 2, 3]}, max_batch=2)
    with pytest.raises(schema.SchemaError, match="'requests' list"):
        schema.validate_batch_request({"reqs": []}, max_batch=2)


def test_result_round_trip_and_errors():
    result = schema.make_result("ok", stdout="1\n", exit_code=0, duration=1)
    assert schema.validate_run_result(dict(result, extra=1)) == result
    with pytest.raises(schema.SchemaError, match="unknown status"):
        schema.make_result("fine")
    with pytest.raises(schema.SchemaError, match="lacks field"):
        schema.validate_run_result({"status": "ok"})
    with pytest.raises(schema.SchemaError, match="exit_code"):
        schema.validate_run_result(dict(result, exit_code="0"))


@pytest.mark.parametrize(
    "code, tier",
    [
        ("print(1)", "base"),
        ("import numpy as np", "numpy"),
        ("from sympy import symbols", "full"),
        ("import numpy, sympy", "full"),
        ("import mpmath", "full"),
        ("numpyish = 1", "base"),
    ],
)
def test_choose_tier(code, tier):
    assert choose_tier(code, ("base", "numpy", "full")) == tier
    assert choose_tier(code, ("full",)) == "full"


def test_choose_tier_falls_back_to_a_heavier_tier():
    assert choose_tier("print(1)", ("numpy", "full")) == "numpy"
    assert choose_tier("import numpy", ("base", "full")) == "full"
    assert choose_tier("import sympy", ("base", "numpy")) is None  # the full tier is restarting
    assert choose_tier("print(1)", ()) is None


def test_config_validation():
    assert ServerConfig(tiers="full,base").tier_list == ("base", "full")
    with pytest.raises(ValueError, match="includes 'full'"):
        ServerConfig(tiers="base")
    with pytest.raises(ValueError, match="slots must be positive"):
        ServerConfig(slots=0)
    with pytest.raises(ValueError, match="default_timeout"):
        ServerConfig(default_timeout=100, max_timeout=10)
    assert "token" not in ServerConfig(token="secret").worker_payload()
    with pytest.raises(ValueError, match="uid_base"):
        ServerConfig(uid_base=2**31 - 10)
    with pytest.raises(ValueError, match="precompile_max_chars must be >= 0"):
        ServerConfig(precompile_max_chars=-1)
    with pytest.raises(ValueError, match="call_setup must be 'auto' or 'python'"):
        ServerConfig(call_setup="native")


def test_automatic_uid_blocks_do_not_overlap():
    config = ServerConfig(workers=4, slots=100, max_sessions=500)  # 1700 uids -> blocks of 2000
    assert config.uid_count == 4 * 3 * 100 + 500
    first, second = config.first_uid(1234), config.first_uid(1235)
    assert second - first == 2000 >= config.uid_count
    assert ServerConfig(uid_base=5000).first_uid(1234) == 5000


def test_every_limit_has_a_documented_flag():
    help_text = build_arg_parser().format_help()
    for flag in (
        "--memory-mb",
        "--nproc",
        "--file-size-mb",
        "--max-queue",
        "--session-ttl",
        "--output-limit-bytes",
    ):
        assert flag in help_text
    args = build_arg_parser().parse_args(["--workers", "3", "--default-timeout", "2.5"])
    assert args.workers == 3 and args.default_timeout == 2.5


def test_frames_split_across_reads():
    data = encode_frame({"op": "run", "id": 1}) + encode_frame({"op": "run", "id": 2, "code": "\udcff"})
    buffer = bytearray()
    messages = []
    for i in range(0, len(data), 3):
        buffer += data[i : i + 3]
        messages += split_frames(buffer)
    assert [m["id"] for m in messages] == [1, 2] and messages[1]["code"] == "\udcff" and not buffer


def _record(**overrides):
    record = {"status": "ok", "error_type": None, "exit_code": 0, "exec_start": 1.0, "exec_end": 2.0}
    return json.dumps({**record, **overrides}).encode() + b"\n"


def test_take_record_uses_the_last_valid_record():
    forged = _record(status="ok")
    garbage = b"not json\n" + json.dumps({"status": "pwned"}).encode() + b"\n"
    buffer = bytearray(forged + garbage + _record(status="error", error_type="ValueError", exit_code=1))
    assert _take_record(buffer, None)["error_type"] == "ValueError"
    assert buffer == b""


def test_take_record_for_a_session_needs_the_call_id_and_keeps_partial_lines():
    buffer = bytearray(_record(id=1) + _record(id=2)[:10])
    assert _take_record(buffer, 2) is None
    assert buffer == _record(id=2)[:10]
    buffer += _record(id=2)[10:]
    assert _take_record(buffer, 2)["id"] == 2


@pytest.mark.parametrize(
    "record",
    [
        {"status": "ok", "error_type": None, "exit_code": 0, "exec_start": 10703.33243, "exec_end": 10703.34},
        {"status": "error", "error_type": None, "exit_code": 3, "exec_start": 1.0, "exec_end": 2.5, "id": 7},
        {"status": "error", "error_type": 'Odd"\nName', "exit_code": 1, "exec_start": 1.0, "exec_end": 2.0},
    ],
)
def test_encoded_record_is_one_json_line_the_worker_takes(record):
    line = encode_record(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == record
    assert _take_record(bytearray(line), record.get("id")) == record


CELLS = [
    "print(1 + 1)",
    "x = 3\nx * 'ab'",
    "2 ** 10;",
    "x = 1; x + 1",
    "def f(x: int): pass\nf.__annotations__",  # no __future__ flags leak in from the sandbox's modules
    "def f(x):\n    return 1 / x\nf(0)",
    "import sys\nsys.exit(3)",
    "def broken(:\n    pass",
    "x = 1\n  y = 2",
]


def _outcome(code: str, compiled: bytes | None) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        outcome = execute(code, {"__name__": "__main__"}, compiled)
    return outcome, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("code", CELLS)
def test_a_precompiled_cell_runs_like_one_compiled_in_the_call(code):
    compiled = precompile(code, max_chars=4096)
    assert (compiled is None) == (code in CELLS[-2:])  # cells that do not compile are left to the call
    assert _outcome(code, compiled) == _outcome(code, None)


def test_annotations_are_evaluated_as_in_a_python_file():
    assert _outcome("def f(x: int): pass\nprint(f.__annotations__)", None)[1] == "{'x': <class 'int'>}\n"


def test_precompile_leaves_long_or_invalid_cells_to_the_call():
    assert isinstance(precompile("x = 1", max_chars=5), bytes)
    assert precompile("x = 12", max_chars=5) is None
    assert precompile("x = 1", max_chars=0) is None
    assert precompile("x = '\0'\0", max_chars=100) is None  # a NUL byte: ValueError, not SyntaxError
    assert precompile("a" + "[0]" * 20000, max_chars=10**6) is None  # RecursionError


@pytest.mark.parametrize("exec_start", [5.0, 3.5])  # after the fork reply, or before it (fork server)
def test_phases_are_nonnegative_and_add_up_to_the_latency(exec_start):
    metrics = Metrics()
    stamps = dict(
        admitted=0.0, dispatched=1.0, received=1.5, fork_start=2.0, fork_end=4.0, exec_start=exec_start,
        exec_end=6.0, exit_seen=7.0, returned=8.0,
    )  # fmt: skip
    metrics.observe_call("ok", 8.0, stamps)
    phases = metrics.snapshot()["phase_seconds_total"]
    assert all(seconds >= 0 for seconds in phases.values()) and sum(phases.values()) == 8.0
    assert phases["fork"] + phases["child_setup"] == exec_start - 2.0


def test_rehearsal_leaves_the_process_as_it_was():
    """``runner.rehearse`` warms the call path in the worker: nothing printed, streams, fds and linecache
    as before."""
    script = (
        "import linecache, sys\n"
        "from sandbox_server import runner\n"
        "before = (sys.stdin, sys.stdout, sys.stderr, sys.__stdout__)\n"
        "print('before', flush=True)\n"
        "runner.rehearse(times=3)\n"
        "print('after', flush=True)\n"
        "after = (sys.stdin, sys.stdout, sys.stderr, sys.__stdout__)\n"
        "print(after == before, runner.CELL_FILENAME in linecache.cache)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert (run.stdout, run.stderr) == ("before\nafter\nTrue False\n", "")


def _run_cbpf(program, nr: int, arch: int, arg0: int) -> int:
    """A classic-BPF interpreter for the instructions ``linux.seccomp_filter`` uses (ld abs, jeq/jge/and
    with a constant, ret), over a ``seccomp_data`` of (nr, arch, args[0])."""
    words = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF, 20: arg0 >> 32}
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = program[pc].code, program[pc].jt, program[pc].jf, program[pc].k
        pc += 1
        if code == 0x20:
            acc = words[k]
        elif code == 0x54:
            acc &= k
        elif code in (0x15, 0x35):
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected BPF instruction {code:#x}")


@pytest.mark.skipif(linux.seccomp_filter() is None, reason="no syscall table for this machine")
def test_seccomp_filter_decides_every_syscall_as_specified():
    program = linux.seccomp_filter()
    arch = linux._AUDIT_ARCH
    codes = {"allow": linux._RET_ALLOW, "eperm": linux._RET_EPERM, "enosys": linux._RET_ENOSYS}
    clone = linux._CLONE[platform.machine()]
    numbers = [*range(1024), linux._X32_SYSCALL_BIT, linux._X32_SYSCALL_BIT + 1, 0xFFFFFFFF]
    for nr in numbers:
        for flags in (0, 0x11, linux.CLONE_NEWNET, linux.CLONE_NEWNS | 0x11, 1 << 28, 1 << 40):
            expected = codes[linux.seccomp_action(nr, flags)]
            assert _run_cbpf(program, nr, arch, flags) == expected, (nr, hex(flags))
        assert _run_cbpf(program, nr, arch ^ 1, 0) == linux._RET_EPERM
    # the reference itself: every listed call denied, namespaces denied to clone, clone3 unavailable
    column = 0 if platform.machine() == "x86_64" else 1
    assert all(linux.seccomp_action(n[column]) == "eperm" for n in linux._DENIED_SYSCALLS.values())
    assert linux.seccomp_action(clone, 0x10000000) == "eperm"  # CLONE_NEWUSER
    assert linux.seccomp_action(clone, 0x11) == "allow"
    assert linux.seccomp_action(linux._CLONE3) == "enosys"
    assert linux.seccomp_action(0) == "allow"  # read
