"""Kernel isolation: what a warm worker sets up once, and what each forked call applies to itself.

Worker, once (``WorkerSandbox.prepare``):
    * joins the server's memory cgroup (bounds the memory of all calls together) with oom_score_adj -1000;
    * enters a private mount namespace and ``pivot_root``s into a tmpfs holding read-only binds of the
      system and Python library paths, a minimal /etc and /dev, and an empty /tmp mount point; the host
      filesystem is then unreachable from the worker and from everything it forks;
    * creates one network namespace per slot (loopback down, no interfaces): namespaces are reused slot by
      slot because creating one costs ~0.6 ms and a finished call leaves nothing behind in it;
    * enters its own IPC namespace, so no call reaches the host's SysV IPC objects or message queues;
    * keeps its own PID-namespace handle so each fork can start a fresh PID namespace.

Call, in the forked child while still root (done in C by the fork server ``ForkServer`` when the optional
extension ``sandbox_server._spawn`` is built, else by the worker and ``CallSandbox.fork`` in Python):
    * becomes init of a fresh PID namespace, so when it exits the kernel kills every process it started,
      detached (``setsid``) grandchildren included; also a new session;
    * a fresh mount namespace, a private size-limited tmpfs on /tmp as its working directory (gone with
      the namespace), and its slot's network namespace;
    * oom_score_adj 1000, rlimits with soft = hard (address space, CPU, file size, processes, open files,
      no core dumps), a per-slot unprivileged uid/gid with no supplementary groups, no-new-privs,
      parent-death signal, not dumpable, scrubbed environment;
    * a seccomp filter (``linux.seccomp_filter``) that denies namespaces, mounts, tracing, SysV IPC and
      POSIX message queues; where it is unavailable, a fresh IPC namespace per call instead, since IPC
      objects outlive the call that made them.

Every mechanism is probed and degrades independently: without root there are no namespaces, no uid
change and no cgroup; the call then runs in a fresh directory under the server's temporary root and its
process group is killed at the end. ``Mechanisms`` records what is active and why something is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import os
import platform
import resource
import select
import signal
import struct
import sys

from sandbox_server import linux

try:  # built by setup.py where a C compiler is available; without it the worker forks calls itself, in Python
    from sandbox_server import _spawn as native_spawn

    NATIVE_UNAVAILABLE = None
except ImportError as _error:
    native_spawn = None
    NATIVE_UNAVAILABLE = f"sandbox_server._spawn is not built ({_error})"

SETUP_FAILED_EXIT = 71
SETUP_FAILED_MESSAGE = "sandbox setup failed:"
WORKER_PIDFD = 5  # where a child finds the worker's pidfd during setup
CHILD_FD_END = 6  # a child keeps fds 0..5 through setup (0-2 stdio, 3 record, 4 control, 5 worker pidfd)
# The packed forms of a call's plan and of a fork request; _spawn.c's struct wire_plan / fork_request.
MAX_TARGETS = MAX_LIMITS = 8
TMPFS_OPTIONS_SIZE, WORKDIR_SIZE = 256, 4096  # with the terminating NUL
WIRE_PLAN = struct.Struct(f"=iiiiiiQiii8i8q{TMPFS_OPTIONS_SIZE}s{WORKDIR_SIZE}s")
REQUEST_TAIL = struct.Struct("=qi8iq")  # cpu_seconds, n_targets, targets, payload size
if native_spawn is not None and getattr(native_spawn, "WIRE_PLAN_SIZE", None) != WIRE_PLAN.size:
    # A build from older sources (a checkout updated without `pip install -e .`) would misread every plan.
    native_spawn = None
    NATIVE_UNAVAILABLE = "sandbox_server._spawn is older than its Python code (rebuild: pip install -e .)"
SANDBOX_TMP = "/tmp"
SANDBOX_TMP_BYTES = SANDBOX_TMP.encode()
DEVICES = ("null", "zero", "full", "random", "urandom")
# glibc gives each new thread its own malloc arena and reserves 64 MiB of address space for it (up to 8 per
# core), so under RLIMIT_AS about 20 threads exhaust the address space before RLIMIT_NPROC can refuse one; a
# thread whose start-up allocation fails then leaves CPython 3.11's Thread.start() waiting forever.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}
SCRUBBED_ENV = {
    **MALLOC_ENV,
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
}


@dataclasses.dataclass
class Mechanisms:
    """Which isolation mechanisms are active (name -> True) or not (name -> reason)."""

    active: dict = dataclasses.field(default_factory=dict)
    inactive: dict = dataclasses.field(default_factory=dict)

    def mark(self, name: str, error: BaseException | str | None = None) -> bool:
        if error is None:
            self.active[name] = True
            self.inactive.pop(name, None)
            return True
        self.inactive[name] = str(error)
        self.active.pop(name, None)
        return False

    def __contains__(self, name: str) -> bool:
        return name in self.active

    def as_dict(self) -> dict:
        return {"active": sorted(self.active), "inactive": dict(sorted(self.inactive.items()))}


def _python_paths() -> list[str]:
    """Directories the interpreter and its packages live in (bound read-only into the sandbox)."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    return sorted(p for p in paths if os.path.isdir(p))


# Each call gets a fresh tmpfs on /tmp, which would hide a Python install living under /tmp (a virtual
# environment in a checkout there, say). Such installs are bound into the root at PYTHON_STASH instead and
# bound back over each call's /tmp.
PYTHON_STASH = "/.python"
PYTHON_UNDER_TMP = tuple(p for p in _python_paths() if p.startswith(SANDBOX_TMP + "/"))
PYTHON_UNDER_TMP_UNAVAILABLE = "a Python installed under /tmp needs its bind mounts"  # no fork server


def _bind_readonly(source: str, target: str) -> None:
    linux.mount(source, target, None, linux.MS_BIND | linux.MS_REC)
    linux.mount(None, target, None, linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY | linux.MS_NOSUID)


def _write_minimal_etc(etc: str) -> None:
    os.makedirs(etc, mode=0o755)
    with open(os.path.join(etc, "passwd"), "w") as f:
        f.write(
            "root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:65534:65534:sandbox:/tmp:/usr/sbin/nologin\n"
        )
    with open(os.path.join(etc, "group"), "w") as f:
        f.write("root:x:0:\nsandbox:x:65534:\n")
    with open(os.path.join(etc, "hosts"), "w") as f:
        f.write("127.0.0.1 localhost\n::1 localhost\n")
    for name in ("ld.so.cache", "nsswitch.conf"):
        if os.path.isfile(f"/etc/{name}"):
            # Not shutil: it loads zlib, bz2 and lzma, whose six libraries would add ~30 memory mappings that
            # every fork copies and every call's exit tears down.
            with open(f"/etc/{name}", "rb") as source, open(os.path.join(etc, name), "wb") as target:
                target.write(source.read())
    if os.path.islink("/etc/localtime"):
        os.symlink(os.readlink("/etc/localtime"), os.path.join(etc, "localtime"))


def build_root(root: str) -> None:
    """Mount a tmpfs on ``root`` and fill it with read-only views of what Python needs (mount ns only)."""
    linux.mount("tmpfs", root, "tmpfs", linux.MS_NOSUID, "size=16m,mode=0755")
    for top in ("bin", "lib", "lib32", "lib64", "libx32", "sbin", "usr"):
        host = f"/{top}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, top))
        elif os.path.isdir(host):
            os.makedirs(os.path.join(root, top))
            _bind_readonly(host, os.path.join(root, top))
    for path in _python_paths():
        if path.startswith("/usr/"):
            continue
        target = root + (PYTHON_STASH + path if path in PYTHON_UNDER_TMP else path)
        os.makedirs(target, mode=0o755, exist_ok=True)
        _bind_readonly(path, target)
    _write_minimal_etc(os.path.join(root, "etc"))
    os.makedirs(os.path.join(root, "dev"), mode=0o755)
    for device in DEVICES:
        target = os.path.join(root, "dev", device)
        open(target, "w").close()
        linux.mount(f"/dev/{device}", target, None, linux.MS_BIND)
    os.makedirs(root + SANDBOX_TMP, mode=0o755)


@dataclasses.dataclass
class WorkerSandbox:
    """Per-worker isolation state, created once before the worker starts forking calls."""

    mechanisms: Mechanisms
    slot_netns_fds: list  # one network namespace per slot, or empty
    own_pidns_fd: int | None  # to return to after each per-call CLONE_NEWPID
    uid_base: int | None  # None: calls keep the worker's uid
    calls_dir: str | None  # host directory for per-call dirs when there is no per-call tmpfs
    cgroup_oom_fd: int | None  # memory.oom_control of the server's cgroup (oom_kill counter)
    seccomp_program: object  # the BPF filter installed in every call, or None
    oom_adj_fd: int | None = None  # this worker's /proc/self/oom_score_adj, written around each fork
    seccomp_fprog: object = None
    # per slot: (join_file fd, OOM-kill counter fd) of its own memory cgroup (_make_call_cgroups)
    slot_cgroups: list = dataclasses.field(default_factory=list)
    session_cgroups: list = dataclasses.field(default_factory=list)  # the same per session index (full tier)
    session_controls: list = dataclasses.field(default_factory=list)  # SessionControl per session index
    slot_cpu_fds: list = dataclasses.field(default_factory=list)  # per slot: join_file of its cpu cgroup

    def worker_only_fds(self) -> list:
        """Descriptors only the worker reads (OOM-kill counters; a session's freezer, CPU counter and the
        cgroups it is moved into by the worker): the fork server closes them, so no call inherits them
        (each inherited descriptor costs every call a close)."""
        fds = [self.cgroup_oom_fd, *(oom for _, oom in self.slot_cgroups + self.session_cgroups)]
        for control in self.session_controls:
            fds += [*control.join_fds, control.freeze_fd, control.usage_fd]
        return [fd for fd in dict.fromkeys(fds) if fd is not None]

    @property
    def seccomp_address(self) -> int | None:
        return None if self.seccomp_fprog is None else ctypes.addressof(self.seccomp_fprog)

    @classmethod
    def prepare(
        cls,
        *,
        name: str,
        temp_root: str,
        slots: int,
        uid_base: int,
        cgroup_dir: str | None,
        call_memory_bytes: int = 0,
        sessions: int = 0,
        session_memory_bytes: int = 0,
        session_cgroup_dirs: dict | None = None,
        call_cpu_cgroups: bool = False,
    ) -> WorkerSandbox:
        mechanisms = Mechanisms()

        # Errors name the failing call; without root they are all EPERM, so say so plainly.
        def reason(error: OSError) -> str:
            return str(error) if os.geteuid() == 0 else f"needs root ({error})"

        cgroup_oom_fd = None
        if not cgroup_dir:
            mechanisms.mark("memory_cgroup", "not available")
        else:
            try:
                with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                events = (
                    "memory.oom_control"
                    if os.path.exists(f"{cgroup_dir}/memory.oom_control")
                    else "memory.events"
                )
                cgroup_oom_fd = os.open(os.path.join(cgroup_dir, events), os.O_RDONLY)
                mechanisms.mark("memory_cgroup")
            except OSError as error:
                mechanisms.mark("memory_cgroup", error)
        slot_cgroups, session_cgroups = [], []
        if cgroup_oom_fd is not None and call_memory_bytes:
            try:
                worker_key = name.rsplit(".", 1)[0]  # without the generation: reused across restarts
                slot_cgroups = _make_call_cgroups(cgroup_dir, f"{worker_key}-s", slots, call_memory_bytes)
                session_cgroups = _make_call_cgroups(
                    cgroup_dir, f"{worker_key}-session", sessions, session_memory_bytes
                )
                mechanisms.mark("call_memory_cgroup")
            except OSError as error:
                mechanisms.mark("call_memory_cgroup", error)
        else:
            why = "off (--call-memory-cgroups 0)" if cgroup_oom_fd is not None else "needs the memory cgroup"
            mechanisms.mark("call_memory_cgroup", why)
        slot_cpu_fds = []
        cpu_parent = (session_cgroup_dirs or {}).get("cpu")
        if not call_cpu_cgroups:
            mechanisms.mark("call_cpu_cgroup", "off (--call-cpu-cgroups 0)")
        elif cpu_parent is None:
            mechanisms.mark("call_cpu_cgroup", "needs root and a cpu cgroup (v1)")
        else:
            try:
                worker_key = name.rsplit(".", 1)[0]
                for slot in range(slots):
                    os.makedirs(f"{cpu_parent}/{worker_key}-s{slot}", exist_ok=True)
                    slot_cpu_fds.append(os.open(join_file(f"{cpu_parent}/{worker_key}-s{slot}"), os.O_WRONLY))
                mechanisms.mark("call_cpu_cgroup")
            except OSError as error:
                for fd in slot_cpu_fds:
                    _close_quietly(fd)
                slot_cpu_fds = []
                mechanisms.mark("call_cpu_cgroup", error)
        session_controls = []
        if sessions:
            worker_key = name.rsplit(".", 1)[0]
            memory_dirs = (
                [f"{cgroup_dir}/{worker_key}-session{i}" for i in range(sessions)] if session_cgroups else []
            )
            session_controls = SessionControl.make_all(
                f"{worker_key}-session", sessions, session_cgroup_dirs or {}, memory_dirs, mechanisms
            )
        oom_adj_fd = None
        try:  # the OOM killer should pick a call, never the worker: -1000 here, 1000 in each fork
            oom_adj_fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            os.write(oom_adj_fd, b"-1000")
            mechanisms.mark("oom_priority")
        except OSError as error:
            mechanisms.mark("oom_priority", error)
            if oom_adj_fd is not None:
                os.close(oom_adj_fd)
                oom_adj_fd = None

        own_pidns_fd = None
        try:
            own_pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY)
            _probe_pid_namespace(own_pidns_fd)
            mechanisms.mark("pid_namespace")
        except OSError as error:
            mechanisms.mark("pid_namespace", reason(error))
            if own_pidns_fd is not None:
                os.close(own_pidns_fd)
                own_pidns_fd = None

        slot_netns_fds = []
        try:
            for _ in range(slots + 1):  # the last one is the worker's own, empty, namespace
                linux.unshare(linux.CLONE_NEWNET)
                slot_netns_fds.append(os.open("/proc/self/ns/net", os.O_RDONLY))
            os.close(slot_netns_fds.pop())
            mechanisms.mark("network_namespace")
        except OSError as error:
            for fd in slot_netns_fds:
                os.close(fd)
            slot_netns_fds = []
            mechanisms.mark("network_namespace", reason(error))

        try:  # the worker's own: calls never see the host's SysV IPC objects or message queues
            linux.unshare(linux.CLONE_NEWIPC)
            mechanisms.mark("ipc_namespace")
        except OSError as error:
            mechanisms.mark("ipc_namespace", reason(error))
        try:
            _probe_in_child(lambda: linux.unshare(linux.CLONE_NEWUTS))
            mechanisms.mark("uts_namespace")
        except OSError as error:
            mechanisms.mark("uts_namespace", reason(error))

        calls_dir = None
        try:
            root = os.path.join(temp_root, name)
            os.makedirs(root, mode=0o755)
            linux.unshare(linux.CLONE_NEWNS)
            linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
            build_root(root)
            os.makedirs(os.path.join(root, "old"))
            linux.pivot_root(root, os.path.join(root, "old"))
            os.chdir("/")
            linux.umount2("/old", linux.MNT_DETACH)
            os.rmdir("/old")
            linux.mount(None, "/", None, linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY | linux.MS_NOSUID)
            mechanisms.mark("mount_namespace")
            mechanisms.mark("private_tmpfs")
        except OSError as error:
            mechanisms.mark("mount_namespace", reason(error))
            mechanisms.mark("private_tmpfs", "needs the mount namespace")
            calls_dir = os.path.join(temp_root, name + "-calls")
            os.makedirs(calls_dir, mode=0o711, exist_ok=True)

        seccomp_program = linux.seccomp_filter()
        if seccomp_program is None:
            mechanisms.mark("seccomp", f"no syscall table for {platform.machine()}")
        else:
            try:
                _probe_in_child(lambda: _probe_seccomp(seccomp_program))
                mechanisms.mark("seccomp")
            except OSError as error:
                mechanisms.mark("seccomp", error)
                seccomp_program = None

        uid = None
        try:
            _probe_in_child(lambda: _drop_to(uid_base))
            uid = uid_base
            mechanisms.mark("unprivileged_uid")
        except OSError as error:
            mechanisms.mark("unprivileged_uid", reason(error))
        for always in ("rlimits", "no_new_privs", "parent_death_signal", "new_session", "scrubbed_env"):
            mechanisms.mark(always)
        os.environ.clear()  # inherited by every call; HOME and TMPDIR are its private /tmp
        os.environ.update(SCRUBBED_ENV, HOME=SANDBOX_TMP, TMPDIR=SANDBOX_TMP)
        sandbox = cls(
            mechanisms,
            slot_netns_fds,
            own_pidns_fd,
            uid,
            calls_dir,
            cgroup_oom_fd,
            seccomp_program,
            oom_adj_fd,
        )
        sandbox.slot_cgroups, sandbox.session_cgroups = slot_cgroups, session_cgroups
        sandbox.session_controls = session_controls
        sandbox.slot_cpu_fds = slot_cpu_fds
        if seccomp_program is not None:
            sandbox.seccomp_fprog = linux.seccomp_fprog(seccomp_program)
        return sandbox

    def oom_kills(self, counter_fd: int | None = None) -> int:
        """The OOM-kill counter of the server's cgroup, or of a call's own (``counter_fd``, from
        ``slot_cgroups`` / ``session_cgroups``); 0 without a cgroup."""
        fd = self.cgroup_oom_fd if counter_fd is None else counter_fd
        if fd is None:
            return 0
        for line in os.pread(fd, 4096, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def fork_call(self, new_pid_namespace: bool = True) -> int:
        """``os.fork()``; the child is init of a fresh PID namespace (when active), oom_score_adj 1000."""
        new_pid_namespace = new_pid_namespace and self.own_pidns_fd is not None
        if self.oom_adj_fd is not None:
            os.pwrite(self.oom_adj_fd, b"1000", 0)
        if new_pid_namespace:
            linux.unshare(linux.CLONE_NEWPID)
        pid = -1
        try:
            pid = os.fork()
            return pid
        finally:
            if pid != 0:  # in the worker: back to its own PID namespace and OOM priority
                if new_pid_namespace:
                    linux.setns(self.own_pidns_fd, linux.CLONE_NEWPID)
                if self.oom_adj_fd is not None:
                    os.pwrite(self.oom_adj_fd, b"-1000", 0)

    def kill_leftovers(self, pid: int, uid: int | None) -> None:
        """Kill what a finished call left behind when there is no PID namespace to do it."""
        if self.own_pidns_fd is not None:
            return  # the kernel killed the namespace with its init
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if uid is not None:
            _kill_all_of_uid(uid)


@dataclasses.dataclass(frozen=True)
class CallSandbox:
    """What one call (or one session process) applies to itself right after the fork, as root.

    Built by the worker before it forks (``plan``), so the child does as little Python-level work as
    possible: every object a child touches is a copy-on-write page fault, the largest cost of a call. With
    ``native_plan`` the fork server (``ForkServer``) does the whole set-up in C and touches no Python object.
    """

    uid: int | None
    unshare_flags: int
    netns_fd: int | None  # join this (per-slot) network namespace
    cgroup_fd: int | None  # join_file of the call's own memory cgroup, joined first ("0" written to it)
    cpu_cgroup_fd: int | None  # join_file of the call's cpu cgroup (one CPU weight for all its processes)
    tmpfs_options: bytes | None  # mount a private tmpfs on /tmp with these options
    workdir: str  # the call's working directory (/tmp, or a host directory in degraded mode)
    limits: tuple  # ((resource, value), ...) applied with soft = hard; CPU time comes per call
    seccomp_address: int | None  # address of the worker's prepared ``sock_fprog``
    native_plan: bytes | None  # the same plan packed for the fork server (``WIRE_PLAN``); None: Python only

    @classmethod
    def plan(
        cls,
        sandbox: WorkerSandbox,
        config: dict,
        *,
        uid,
        netns_fd,
        fresh_netns,
        workdir,
        memory_mb,
        native,
        cgroup_fd=None,
        cpu_cgroup_fd=None,
    ):
        mechanisms = sandbox.mechanisms
        flags = linux.CLONE_NEWNET if fresh_netns else 0
        # SysV IPC objects outlive their call; where seccomp denies IPC (linux._DENIED_SYSCALLS) no call can
        # make one, and the worker's own IPC namespace is enough
        fresh_ipc = "ipc_namespace" in mechanisms and "seccomp" not in mechanisms
        flags |= linux.CLONE_NEWIPC if fresh_ipc else 0
        flags |= linux.CLONE_NEWUTS if "uts_namespace" in mechanisms else 0
        tmpfs_options = None
        if "private_tmpfs" in mechanisms:
            flags |= linux.CLONE_NEWNS
            owner = f",uid={uid},gid={uid}" if uid is not None else ""
            tmpfs_options = f"size={config['tmp_mb']}m,nr_inodes=16384,mode=0700{owner}".encode()
        limits = (
            (resource.RLIMIT_AS, memory_mb << 20),
            (resource.RLIMIT_FSIZE, config["file_size_mb"] << 20),
            (resource.RLIMIT_NPROC, config["nproc"]),
            (resource.RLIMIT_NOFILE, config["nofile"]),
            (resource.RLIMIT_CORE, 0),
        )
        workdir = workdir or SANDBOX_TMP
        native_plan = None
        fits = len(tmpfs_options or b"") < TMPFS_OPTIONS_SIZE and len(os.fsencode(workdir)) < WORKDIR_SIZE
        if native and fits:  # native: fork_server_unavailable() said None
            native_plan = WIRE_PLAN.pack(
                flags,
                sandbox.own_pidns_fd is not None,
                _or(netns_fd, -1),
                _or(cgroup_fd, -1),
                _or(cpu_cgroup_fd, -1),
                _or(uid, -1),
                _or(sandbox.seccomp_address, 0),
                WORKER_PIDFD,
                CHILD_FD_END,
                len(limits),
                *_padded([which for which, _ in limits], MAX_LIMITS),
                *_padded([value for _, value in limits], MAX_LIMITS),
                tmpfs_options or b"",
                os.fsencode(workdir),
            )
        seccomp = sandbox.seccomp_address
        return cls(
            uid,
            flags,
            netns_fd,
            cgroup_fd,
            cpu_cgroup_fd,
            tmpfs_options,
            workdir,
            limits,
            seccomp,
            native_plan,
        )

    def fork(self, sandbox: WorkerSandbox, targets: tuple, cpu_seconds: int) -> int:
        """Fork the call from this process and set it up in Python: its pid here; 0 in the isolated child.

        ``targets`` is ``(target_fd, source_fd, ...)``: the descriptors the child keeps (below
        ``CHILD_FD_END``; every other one is closed), ``WORKER_PIDFD`` among them. A child whose set-up
        fails writes ``SETUP_FAILED_MESSAGE`` and the error to its stderr and exits with
        ``SETUP_FAILED_EXIT``. (``ForkServer.fork`` is the fast way, where the extension is built.)
        """
        pid = sandbox.fork_call()
        if pid == 0:
            self._set_up(targets, cpu_seconds)
        return pid

    def _set_up(self, targets: tuple, cpu_seconds: int) -> None:
        """The Python steps of the set-up (``_spawn.c`` does the same ones in the same order)."""
        try:
            self._enter_namespaces()
            # Lift every source above the targets first, so no dup2 can clobber a source still needed.
            kept, sources = targets[::2], targets[1::2]
            lifted = [fcntl.fcntl(source, fcntl.F_DUPFD, CHILD_FD_END) for source in sources]
            for target, source in zip(kept, lifted, strict=True):
                os.dup2(source, target)
            for fd in range(3, CHILD_FD_END):
                if fd not in kept:
                    _close_quietly(fd)
            os.closerange(CHILD_FD_END, 2**31 - 1)  # everything else the worker had open, its socket included
            self._drop_privileges(cpu_seconds)
        except BaseException as error:
            try:
                os.write(2, f"{SETUP_FAILED_MESSAGE} {type(error).__name__}: {error}\n".encode())
            finally:
                os._exit(SETUP_FAILED_EXIT)

    def _enter_namespaces(self) -> None:
        """Namespace and mount steps; run before the inherited file descriptors are closed."""
        if self.cgroup_fd is not None:  # first: everything the call makes resident is charged to it
            os.write(self.cgroup_fd, b"0")
        if self.cpu_cgroup_fd is not None:  # before it starts any process: they all share its CPU weight
            os.write(self.cpu_cgroup_fd, b"0")
        os.setsid()
        if self.unshare_flags:
            linux.unshare(self.unshare_flags)
        if self.netns_fd is not None:
            linux.setns(self.netns_fd, linux.CLONE_NEWNET)
        if self.tmpfs_options is not None:
            linux.mount(
                b"tmpfs", SANDBOX_TMP_BYTES, b"tmpfs", linux.MS_NOSUID | linux.MS_NODEV, self.tmpfs_options
            )
            for path in PYTHON_UNDER_TMP:
                os.makedirs(path, mode=0o755, exist_ok=True)
                _bind_readonly(PYTHON_STASH + path, path)
        os.chdir(self.workdir)

    def _drop_privileges(self, cpu_seconds: int) -> None:
        """Limits and credentials; after this the process can neither raise a limit nor regain root.

        The worker's pidfd (at ``WORKER_PIDFD``, closed here) tells whether the worker died before the
        parent-death signal was armed.
        """
        for which, value in self.limits:
            resource.setrlimit(which, (value, value))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        if self.uid is not None:
            _drop_to(self.uid)
        # The parent-death signal is reset by a credential change, so it is set after it.
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        linux.prctl(linux.PR_SET_DUMPABLE, 0)
        if self.seccomp_address is not None:
            linux.prctl(linux.PR_SET_SECCOMP, linux.SECCOMP_MODE_FILTER, self.seccomp_address)
        worker_gone = select.select([WORKER_PIDFD], [], [], 0)[0]
        os.close(WORKER_PIDFD)
        if worker_gone:
            os._exit(0)


def fork_server_unavailable(sandbox: WorkerSandbox, call_setup: str) -> str | None:
    """Why this worker's calls cannot be forked and set up in C (``ForkServer``); None when they can."""
    if call_setup == "python":
        return "--call-setup python"
    if native_spawn is None:
        return NATIVE_UNAVAILABLE
    if PYTHON_UNDER_TMP and "private_tmpfs" in sandbox.mechanisms:
        return PYTHON_UNDER_TMP_UNAVAILABLE
    return None


def _or(value, default):
    return default if value is None else value


def _padded(values: list, length: int) -> list:
    return values + [0] * (length - len(values))


class ForkServer:
    """A copy of the warm worker that only forks its calls: ``_spawn.serve_forks``, a loop in C.

    A process that forks write-protects all of its memory each time, so every page the worker's event loop
    writes afterwards is a copy-on-write fault; the fork server writes a few pages per fork instead. It
    clones each call with CLONE_PARENT, so the call is the worker's child as if the worker had forked it,
    and it does the call's whole set-up in C. Forked by the worker once its warm state is complete (the
    network namespaces, the seccomp program and the streams it inherits are the worker's); it has the
    calls' OOM priority and dies with the worker.
    """

    def __init__(self, sock: int, pid: int):
        self.sock = sock
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)

    @classmethod
    def start(cls, sandbox: WorkerSandbox, worker_pidfd: int, close_in_server: tuple) -> ForkServer | bytes:
        """Start it: the ``ForkServer`` in the worker. Like ``fork()`` this returns more than once: in each
        call the server later forks, it returns that call's payload, with the call isolated."""
        worker_end, server_end = native_spawn.socketpair()
        pid = sandbox.fork_call(new_pid_namespace=False)
        if pid != 0:
            os.close(server_end)
            return cls(worker_end, pid)
        try:
            for fd in (worker_end, *close_in_server):  # the worker's channel: the front end sees it close
                os.close(fd)
            linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
            if not select.select([worker_pidfd], [], [], 0)[0]:  # else the worker died before the signal
                payload = native_spawn.serve_forks(server_end)
                if payload is not None:
                    return payload
        except BaseException as error:
            os.write(2, f"sandbox fork server: {type(error).__name__}: {error}\n".encode())
        os._exit(0)

    @staticmethod
    def collapse_heap() -> int:
        """Map the warm heap by huge pages where the kernel can (cheaper forks); the bytes mapped so."""
        return native_spawn.collapse_huge_pages()

    def fork(self, plan: CallSandbox, targets: tuple, cpu_seconds: int, payload: bytes) -> int:
        """Have a call forked and isolated (``plan.native_plan``; ``targets`` as in ``CallSandbox.fork``).

        Its pid; OSError if the clone failed, ConnectionError if the fork server is gone. The call starts
        where ``start`` returned, with ``payload``.
        """
        numbers = targets[::2]
        request = plan.native_plan + REQUEST_TAIL.pack(
            cpu_seconds, len(numbers), *_padded(list(numbers), MAX_TARGETS), len(payload)
        )
        return native_spawn.request_fork(self.sock, request, targets[1::2], payload)


@dataclasses.dataclass
class SessionControl:
    """One session index's freezer and CPU counter: cgroup v1 ``freezer`` and ``cpuacct`` cgroups (which
    the session process is moved into before it runs any code), or on cgroup v2 its memory cgroup's
    ``cgroup.freeze`` and ``cpu.stat``. Either covers every process the session starts, detached ones
    included: none can leave a cgroup (no access to cgroupfs, no privileges)."""

    join_fds: tuple  # cgroup.procs of the v1 cgroups to move the session process into
    freeze_fd: int | None  # freezer.state (v1) or cgroup.freeze (v2)
    usage_fd: int | None  # cpuacct.usage (v1, ns) or cpu.stat (v2, usage_usec)
    v2: bool

    @classmethod
    def make_all(cls, prefix: str, count: int, v1_dirs: dict, v2_dirs: list, mechanisms) -> list:
        """One per session index (created before the worker pivots away from /sys), marking the
        ``session_freezer`` and ``session_cpu_accounting`` mechanisms."""
        controls = []
        v2 = not v1_dirs and bool(v2_dirs) and os.path.exists(f"{v2_dirs[0]}/cgroup.freeze")
        try:
            for index in range(count):
                join, freeze, usage = [], None, None
                if v2:
                    freeze = os.open(f"{v2_dirs[index]}/cgroup.freeze", os.O_WRONLY)
                    usage = os.open(f"{v2_dirs[index]}/cpu.stat", os.O_RDONLY)
                for controller, parent in sorted(v1_dirs.items()):
                    path = os.path.join(parent, f"{prefix}{index}")
                    os.makedirs(path, exist_ok=True)
                    join.append(os.open(f"{path}/cgroup.procs", os.O_WRONLY))
                    if controller == "freezer":
                        freeze = os.open(f"{path}/freezer.state", os.O_WRONLY)
                    elif controller == "cpuacct":
                        usage = os.open(f"{path}/cpuacct.usage", os.O_RDONLY)
                control = cls(tuple(join), freeze, usage, v2)
                control.freeze(False)  # a restarted worker's frozen leftovers die of their SIGKILL now
                controls.append(control)
        except OSError as error:
            for control in controls:
                for fd in (*control.join_fds, control.freeze_fd, control.usage_fd):
                    if fd is not None:
                        _close_quietly(fd)
            mechanisms.mark("session_freezer", error)
            mechanisms.mark("session_cpu_accounting", error)
            return []
        missing = "needs root and a freezer cgroup (v1) or cgroup v2 with per-session memory cgroups"
        mechanisms.mark(
            "session_freezer", None if controls and controls[0].freeze_fd is not None else missing
        )
        missing = "needs root and a cpuacct cgroup (v1) or cgroup v2 with per-session memory cgroups"
        mechanisms.mark(
            "session_cpu_accounting", None if controls and controls[0].usage_fd is not None else missing
        )
        return controls

    def join(self, pid: int) -> None:
        for fd in self.join_fds:
            os.write(fd, str(pid).encode())

    def freeze(self, frozen: bool) -> None:
        """Stop (or resume) every process of the session at once."""
        if self.freeze_fd is not None:
            os.write(
                self.freeze_fd,
                (b"1" if frozen else b"0") if self.v2 else (b"FROZEN" if frozen else b"THAWED"),
            )

    def cpu_seconds(self) -> float | None:
        """CPU time used by all processes ever in the cgroup, exited ones included (None: not counted)."""
        if self.usage_fd is None:
            return None
        text = os.pread(self.usage_fd, 4096, 0).decode()
        if not self.v2:
            return int(text) / 1e9
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        return None


def _make_call_cgroups(parent: str, prefix: str, slots: int, limit_bytes: int) -> list:
    """One memory cgroup per slot under the server's, limited to ``limit_bytes``: a call joins its slot's
    first thing after the clone, so anonymous memory, memfd and tmpfs pages, pipe and socket buffers and
    page cache it makes resident are charged to it and an OOM kill stays inside it. Reused slot by slot
    (and across a worker's restarts); the server removes them at stop and its next start sweeps what a
    killed one left. Returns ``[(join_file fd, OOM-kill counter fd), ...]``."""
    events = "memory.oom_control" if os.path.exists(f"{parent}/memory.oom_control") else "memory.events"
    limit_file = "memory.limit_in_bytes" if events == "memory.oom_control" else "memory.max"
    fds = []
    for slot in range(slots):
        path = os.path.join(parent, f"{prefix}{slot}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(limit_bytes))
        if limit_file == "memory.limit_in_bytes":  # cgroup v1: no swap beyond the limit either
            with contextlib.suppress(OSError), open(f"{path}/memory.memsw.limit_in_bytes", "w") as f:
                f.write(str(limit_bytes))
        fds.append((os.open(join_file(path), os.O_WRONLY), os.open(f"{path}/{events}", os.O_RDONLY)))
    return fds


def join_file(cgroup: str) -> str:
    """The file a freshly cloned (single-threaded) call writes "0" to, to join ``cgroup``: on cgroup v1
    ``tasks``, which moves the writing thread, i.e. the whole call, without the kernel's global threadgroup
    lock, whose write side waits for an RCU grace period (measured: ~11 ms of wall time per join when joins
    are 20 ms apart, stalling every fork on the host meanwhile, against ~0.5 ms through ``tasks``); on v2
    ``cgroup.procs``."""
    tasks = os.path.join(cgroup, "tasks")
    return tasks if os.path.exists(tasks) else os.path.join(cgroup, "cgroup.procs")


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _probe_in_child(action) -> None:
    """Run ``action`` in a forked child; raise OSError if it failed there."""
    pid = os.fork()
    if pid == 0:
        try:
            action()
            os._exit(0)
        except OSError as error:
            os._exit(min(error.errno or 1, 255))
        except BaseException:
            os._exit(255)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise OSError(code, f"probe failed: {os.strerror(code) if 0 < code < 255 else code}")


def _probe_pid_namespace(own_pidns_fd: int) -> None:
    linux.unshare(linux.CLONE_NEWPID)
    try:
        _probe_in_child(lambda: None if os.getpid() == 1 else os._exit(1))
    finally:
        linux.setns(own_pidns_fd, linux.CLONE_NEWPID)


def _probe_seccomp(program) -> None:
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    linux.install_seccomp(program)
    try:
        linux.unshare(0x10000000)  # CLONE_NEWUSER
    except PermissionError:
        pid = os.fork()  # plain fork (clone without namespace flags) must still work
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        return
    raise OSError(1, "the filter did not block unshare(CLONE_NEWUSER)")


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _kill_all_of_uid(uid: int) -> None:
    """``kill(-1, SIGKILL)`` as ``uid``: reaches exactly the processes of that uid (degraded mode only)."""
    pid = os.fork()
    if pid == 0:
        try:
            _drop_to(uid)
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
