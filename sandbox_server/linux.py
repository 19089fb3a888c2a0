"""Thin ctypes wrappers for the Linux calls that Python 3.11's ``os`` module lacks.

Python 3.12 added ``os.unshare``/``os.setns``; this project supports 3.11, so the namespace, mount,
``pivot_root`` and ``prctl`` calls go through libc. Every wrapper raises ``OSError`` with the real errno
so callers can degrade gracefully (and report why) when the kernel or the user does not allow a call.
"""

from __future__ import annotations

import ctypes
import os
import platform

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2

# pivot_root has no glibc wrapper; its number differs per architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(
    platform.machine()
)

# The symbols of the already loaded C library (ctypes.util.find_library would import subprocess and shutil
# into every warm worker).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.syscall.restype = ctypes.c_long
# unshare and setns take only ints, which ctypes passes as C ints without ``argtypes``; they run around every
# fork, and argtypes conversion would write ~15 more pages of the warm worker (copy-on-write faults) per call.


def _fail(what: str) -> None:
    """Raise the OSError of the libc call that just failed (the message is only built here: these wrappers
    run in every forked call, where formatting it each time would cost copy-on-write faults)."""
    errno = ctypes.get_errno()
    raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _path(value: str | bytes | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def unshare(flags: int) -> None:
    """``unshare(2)``: move the caller into new namespaces (PID: only its future children)."""
    if _libc.unshare(flags) != 0:
        _fail(f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    """``setns(2)``: join the namespace that ``fd`` (an open ``/proc/*/ns/*`` file) refers to."""
    if _libc.setns(fd, nstype) != 0:
        _fail(f"setns({nstype:#x})")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    if _libc.mount(_path(source), _path(target), _path(fstype), flags, _path(data)) != 0:
        _fail(f"mount {source!r} on {target!r}")


def umount2(target: str, flags: int = 0) -> None:
    if _libc.umount2(_path(target), flags) != 0:
        _fail(f"umount {target!r}")


def pivot_root(new_root: str, put_old: str) -> None:
    if _SYS_PIVOT_ROOT is None:
        raise OSError(38, f"pivot_root: syscall number unknown on {platform.machine()}")
    if _libc.syscall(_SYS_PIVOT_ROOT, _path(new_root), _path(put_old)) != 0:
        _fail("pivot_root")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    if _libc.prctl(option, arg2, arg3, 0, 0) != 0:
        _fail(f"prctl({option})")


# --------------------------------------------------------------------------------------------- seccomp
# A small deny-list filter. Namespaces are the point: an unprivileged process may otherwise create a user
# namespace, become "root" in it and reach mount/network code paths that the sandbox relies on being
# closed. SysV IPC and POSIX message queues are denied too: their objects outlive the process that made
# them, so without the filter each call needs a fresh IPC namespace, and creating and tearing one down
# costs 0.03-0.05 ms of CPU, ~2% of a trivial call. Denied calls fail with EPERM (clone3 with ENOSYS, which
# makes glibc fall back to clone, whose flags a filter can inspect). Calls from another ABI (i386
# ``int 0x80``, x32) are denied outright.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(platform.machine())
_DENIED_SYSCALLS = {
    # name: (x86_64, aarch64)
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    # io_uring: its own kernel attack surface, and its workers do I/O outside the call's seccomp filter
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "shmctl": (31, 195),
    "shmdt": (67, 197),
    "semget": (64, 190),
    "semop": (65, 193),
    "semctl": (66, 191),
    "semtimedop": (220, 192),
    "msgget": (68, 186),
    "msgsnd": (69, 189),
    "msgrcv": (70, 188),
    "msgctl": (71, 187),
    "mq_open": (240, 180),
    "mq_unlink": (241, 181),
    "mq_timedsend": (242, 182),
    "mq_timedreceive": (243, 183),
    "mq_notify": (244, 184),
    "mq_getsetattr": (245, 185),
    # a new session is a new scheduling group (autogroup): a call's processes share one unless it can make
    # more, and a process of its own session cannot escape a process-group kill where there is no PID ns
    "setsid": (112, 157),
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_CLONE_NAMESPACE_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_X32_SYSCALL_BIT = 0x40000000
_RET_ALLOW = 0x7FFF0000
_RET_EPERM = 0x00050000 | 1
_RET_ENOSYS = 0x00050000 | 38


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_filter() -> ctypes.Array | None:
    """The BPF program (built once, installed per call by ``install_seccomp``); None on unknown machines.

    After the architecture and x32 checks the syscall number is located by a binary search over the sorted
    ranges of ``_DENIED_SYSCALLS`` (plus clone and clone3), not by one comparison per denied call: the
    kernel walks the program once per syscall number when it is installed (to cache the numbers it always
    allows), so with a linear list that walk cost every call ~0.05 ms more CPU. The decisions are those
    of ``seccomp_action``."""
    if _AUDIT_ARCH is None:
        return None
    ld_w_abs, jeq_k, jge_k, and_k, ret_k = 0x20, 0x15, 0x35, 0x54, 0x06
    column = 0 if platform.machine() == "x86_64" else 1
    clone = _CLONE[platform.machine()]

    def op(code, k, jt=0, jf=0):
        return (code, jt, jf, k)

    program = [
        op(ld_w_abs, 4),  # seccomp_data.arch
        op(jeq_k, _AUDIT_ARCH, jt=1),
        op(ret_k, _RET_EPERM),
        op(ld_w_abs, 0),  # seccomp_data.nr
    ]
    if column == 0:
        program += [op(jge_k, _X32_SYSCALL_BIT, jf=1), op(ret_k, _RET_EPERM)]
    actions = {
        "allow": [op(ret_k, _RET_ALLOW)],
        "eperm": [op(ret_k, _RET_EPERM)],
        "enosys": [op(ret_k, _RET_ENOSYS)],
        "clone": [
            op(ld_w_abs, 16),  # low 32 bits of seccomp_data.args[0]: the clone flags
            op(and_k, _CLONE_NAMESPACE_FLAGS),
            op(jeq_k, 0, jf=1),
            op(ret_k, _RET_ALLOW),
            op(ret_k, _RET_EPERM),
        ],
    }

    def search(segments):  # [(first number, action)], sorted: jge on the middle start, left half inline
        if len(segments) == 1:
            return actions[segments[0][1]]
        middle = len(segments) // 2
        left, right = search(segments[:middle]), search(segments[middle:])
        if len(left) > 255:
            raise ValueError("seccomp filter: a jump longer than cBPF allows")
        return [op(jge_k, segments[middle][0], jt=len(left)), *left, *right]

    program += search(_segments(column, clone))
    return (_SockFilter * len(program))(*program)


def _segments(column: int, clone: int) -> list:
    """The syscall numbers as ``[(first number, action)]``, sorted: each action holds up to the next
    segment's first number; neighbouring numbers with the same action share one segment."""
    special = {numbers[column]: "eperm" for numbers in _DENIED_SYSCALLS.values()}
    special.update({_CLONE3: "enosys", clone: "clone"})
    segments = [(0, "allow")]
    for number in sorted(special):
        for start, action in ((number, special[number]), (number + 1, special.get(number + 1, "allow"))):
            if segments[-1][0] == start:
                segments[-1] = (start, action)
            elif segments[-1][1] != action:
                segments.append((start, action))
    return segments


def seccomp_action(number: int, clone_flags: int = 0, arch: int | None = None) -> str:
    """What ``seccomp_filter`` decides for a syscall (the reference its tests check the program against):
    ``"allow"``, ``"eperm"`` or ``"enosys"``."""
    column = 0 if platform.machine() == "x86_64" else 1
    if arch is not None and arch != _AUDIT_ARCH:
        return "eperm"
    if column == 0 and number >= _X32_SYSCALL_BIT:
        return "eperm"
    if number in {numbers[column] for numbers in _DENIED_SYSCALLS.values()}:
        return "eperm"
    if number == _CLONE3:
        return "enosys"
    if number == _CLONE[platform.machine()] and clone_flags & 0xFFFFFFFF & _CLONE_NAMESPACE_FLAGS:
        return "eperm"
    return "allow"


def seccomp_fprog(program: ctypes.Array) -> _SockFprog:
    """The ``sock_fprog`` for ``program``; keep both alive while its address may be used."""
    return _SockFprog(len(program), ctypes.cast(program, ctypes.POINTER(_SockFilter)))


def install_seccomp(program: ctypes.Array) -> None:
    """Install ``program`` for this process and its descendants (needs no-new-privs first)."""
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(seccomp_fprog(program)))
