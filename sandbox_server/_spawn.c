/* A fork server for sandbox calls, and each call's isolation, without running Python.
 *
 * Why: every page of the warm worker that is written after a fork costs a copy-on-write fault (~3 µs
 * here), and faults are most of a trivial call's CPU. Two sources are removed here:
 *   - the worker's own event loop: a process that forks write-protects all of its pages at every fork, so
 *     each page the loop then writes faults again. Calls are therefore forked by a *fork server*, a copy of
 *     the warm worker that runs only the C loop ``serve_forks`` and touches a few pages per fork. It clones
 *     each call with CLONE_PARENT, so the call is still the worker's child (reaped, timed and killed as before);
 *   - the child's set-up (namespaces, tmpfs, descriptors, rlimits, uid, prctl, seccomp): done here with
 *     system calls on a plan parsed before the fork, instead of Python code that writes ~90 pages.
 * The module is optional: without it the worker forks calls itself and sets them up in Python
 * (isolation.CallSandbox), and the tests check that both leave a call in the same state.
 *
 *   socketpair() -> (worker_end, forker_end)          SOCK_SEQPACKET, one request or reply per message
 *   serve_forks(forker_end) -> bytes | None           in the fork server: None when the worker is gone;
 *                                                     in a new call, once isolated: the request's payload
 *   request_fork(worker_end, request, sources, payload) -> pid   in the worker (blocks for the reply)
 *   use_huge_page_arenas() -> None                    in the worker, first: 2 MiB-aligned arenas and
 *                                                     program break
 *   collapse_huge_pages() -> int                      in the worker, once warm: heap onto huge pages
 *
 * ``request`` is isolation.FORK_REQUEST packed: the plan (struct wire_plan), cpu_seconds, the target
 * descriptor numbers; ``sources`` (sent with SCM_RIGHTS, one per target) become those targets in the call;
 * ``payload`` reaches the call through a memfd. The reply is the pid, or -errno if the clone failed.
 *
 * Call set-up, in order (isolation.CallSandbox._set_up does the same in Python): join the call's memory
 * cgroup; new session; unshare the namespaces; join the slot's network namespace; mount the private tmpfs on /tmp; chdir; move the targets
 * into place and close every other descriptor; rlimits with soft = hard (RLIMIT_CPU = cpu_seconds); drop to
 * uid/gid with no supplementary groups; no-new-privs, parent-death SIGKILL, not dumpable; seccomp filter;
 * exit quietly if the worker is already gone (its pidfd readable), then close that pidfd. A failing step
 * writes "sandbox setup failed: OSError: <step>: <error>" to the call's stderr and exits with status 71.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SETUP_FAILED_EXIT 71
#define MAX_TARGETS 8
#define MAX_LIMITS 8
#define TMPFS_OPTIONS_SIZE 256
#define WORKDIR_SIZE 4096

#ifndef PR_SET_NO_NEW_PRIVS
#define PR_SET_NO_NEW_PRIVS 38
#endif
#ifndef SECCOMP_MODE_FILTER
#define SECCOMP_MODE_FILTER 2
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 1U
#endif

/* Mirrored by isolation.WIRE_PLAN / FORK_REQUEST (struct formats "=..."): keep both in step. */
struct __attribute__((packed)) wire_plan {
    int32_t unshare_flags;
    int32_t new_pid_namespace; /* clone the call as init of a fresh PID namespace */
    int32_t netns_fd;          /* -1: none; a descriptor the fork server inherited from the worker */
    int32_t cgroup_fd;         /* -1: none; tasks (v1) or cgroup.procs of the call's memory cgroup (inherited) */
    int32_t cpu_cgroup_fd;     /* -1: none; tasks (v1) of the call's cpu cgroup (inherited) */
    int32_t uid;               /* -1: keep the uid */
    uint64_t seccomp_address;  /* 0: none; a sock_fprog in the (inherited) memory of the worker */
    int32_t worker_pidfd;      /* the target number the worker's pidfd arrives at */
    int32_t fd_end;            /* targets are below it; everything from it up is closed */
    int32_t n_limits;
    int32_t limit_resource[MAX_LIMITS];
    int64_t limit_value[MAX_LIMITS];
    char tmpfs_options[TMPFS_OPTIONS_SIZE]; /* "": no private tmpfs */
    char workdir[WORKDIR_SIZE];
};

struct __attribute__((packed)) fork_request {
    struct wire_plan plan;
    int64_t cpu_seconds;
    int32_t n_targets;
    int32_t target[MAX_TARGETS];
    int64_t payload_size;
};

static void write_all(int fd, const char *text) {
    size_t left = strlen(text);
    while (left > 0) {
        ssize_t n = write(fd, text, left);
        if (n <= 0) return;
        text += n;
        left -= (size_t)n;
    }
}

/* Report a failed step on the call's stderr (``stderr_fd``) and exit: no Python runs in here. */
static void fail(int stderr_fd, const char *step) {
    int error = errno;
    write_all(stderr_fd, "sandbox setup failed: OSError: ");
    write_all(stderr_fd, step);
    write_all(stderr_fd, ": ");
    write_all(stderr_fd, strerror(error));
    write_all(stderr_fd, "\n");
    _exit(SETUP_FAILED_EXIT);
}

static int is_target(const struct fork_request *request, int fd) {
    for (int i = 0; i < request->n_targets; i++)
        if (request->target[i] == fd) return 1;
    return 0;
}

static void close_from(int first) {
#ifdef SYS_close_range
    if (syscall(SYS_close_range, (unsigned int)first, ~0U, 0) == 0) return;
#endif
    struct rlimit limit;
    long last = getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY
                    ? (long)limit.rlim_cur
                    : 1L << 20;
    for (long fd = first; fd < last; fd++) close((int)fd);
}

/* The call's stderr before the targets are in place: the source of target 2 (else the inherited fd 2). */
static int stderr_source(const struct fork_request *request, const int *sources) {
    for (int i = 0; i < request->n_targets; i++)
        if (request->target[i] == 2) return sources[i];
    return 2;
}

/* In the new call, still root: isolate it. ``sources[i]`` becomes descriptor ``request->target[i]``. */
static void set_up_call(const struct fork_request *request, const int *sources) {
    const struct wire_plan *plan = &request->plan;
    int err = stderr_source(request, sources);

    /* First, so that everything the call makes resident is charged to its own memory cgroup. */
    if (plan->cgroup_fd >= 0 && write(plan->cgroup_fd, "0", 1) != 1) fail(err, "join the memory cgroup");
    /* Before any process of the call exists but this one: all of them share the slot's CPU weight. */
    if (plan->cpu_cgroup_fd >= 0 && write(plan->cpu_cgroup_fd, "0", 1) != 1) fail(err, "join the cpu cgroup");
    if (setsid() < 0) fail(err, "setsid");
    if (plan->unshare_flags && unshare(plan->unshare_flags) != 0) fail(err, "unshare");
    if (plan->netns_fd >= 0 && setns(plan->netns_fd, CLONE_NEWNET) != 0) fail(err, "setns(network)");
    if (plan->tmpfs_options[0] &&
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, plan->tmpfs_options) != 0)
        fail(err, "mount(tmpfs on /tmp)");
    if (chdir(plan->workdir) != 0) fail(err, "chdir");

    /* Lift every source above the targets first, so no dup2 clobbers a source still needed. */
    int lifted[MAX_TARGETS];
    for (int i = 0; i < request->n_targets; i++)
        if ((lifted[i] = fcntl(sources[i], F_DUPFD, plan->fd_end)) < 0) fail(err, "fcntl(F_DUPFD)");
    for (int i = 0; i < request->n_targets; i++)
        if (dup2(lifted[i], request->target[i]) < 0) fail(err, "dup2");
    err = 2;
    for (int fd = 3; fd < plan->fd_end; fd++)
        if (!is_target(request, fd)) close(fd);
    close_from(plan->fd_end);

    for (int i = 0; i < plan->n_limits; i++) {
        struct rlimit limit = {(rlim_t)plan->limit_value[i], (rlim_t)plan->limit_value[i]};
        if (setrlimit(plan->limit_resource[i], &limit) != 0) fail(err, "setrlimit");
    }
    struct rlimit cpu = {(rlim_t)request->cpu_seconds, (rlim_t)request->cpu_seconds};
    if (setrlimit(RLIMIT_CPU, &cpu) != 0) fail(err, "setrlimit(RLIMIT_CPU)");
    if (plan->uid >= 0) {
        if (setgroups(0, NULL) != 0) fail(err, "setgroups");
        if (setresgid(plan->uid, plan->uid, plan->uid) != 0) fail(err, "setresgid");
        if (setresuid(plan->uid, plan->uid, plan->uid) != 0) fail(err, "setresuid");
    }
    /* The parent-death signal is reset by a credential change, so it is set after it. */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail(err, "prctl(PR_SET_NO_NEW_PRIVS)");
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) fail(err, "prctl(PR_SET_PDEATHSIG)");
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) fail(err, "prctl(PR_SET_DUMPABLE)");
    if (plan->seccomp_address &&
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, (unsigned long)plan->seccomp_address, 0, 0) != 0)
        fail(err, "prctl(PR_SET_SECCOMP)");
    struct pollfd worker = {plan->worker_pidfd, POLLIN, 0};
    if (poll(&worker, 1, 0) > 0) _exit(0); /* the worker died before the parent-death signal was armed */
    close(plan->worker_pidfd);
}

/* What a request must satisfy before anything is forked for it. */
static int request_is_valid(const struct fork_request *request, int n_fds) {
    const struct wire_plan *plan = &request->plan;
    if (request->n_targets < 1 || request->n_targets > MAX_TARGETS || n_fds != request->n_targets + 1) return 0;
    if (plan->n_limits < 0 || plan->n_limits > MAX_LIMITS || request->payload_size < 0) return 0;
    if (plan->fd_end < 3 || plan->fd_end > 64) return 0;
    for (int i = 0; i < request->n_targets; i++)
        if (request->target[i] < 0 || request->target[i] >= plan->fd_end) return 0;
    return memchr(plan->tmpfs_options, 0, TMPFS_OPTIONS_SIZE) && memchr(plan->workdir, 0, WORKDIR_SIZE);
}

static pid_t clone_call(int new_pid_namespace) {
    /* fork() cannot make the call a sibling; the raw clone with no new stack returns twice like fork. */
    unsigned long flags = CLONE_PARENT | SIGCHLD | (new_pid_namespace ? CLONE_NEWPID : 0);
#if defined(__s390__) || defined(__CRIS__)
    return (pid_t)syscall(SYS_clone, 0, flags, 0, 0, 0);
#else
    return (pid_t)syscall(SYS_clone, flags, 0, 0, 0, 0);
#endif
}

/* Transparent huge pages for the warm heap. A fork copies one page-table entry per 2 MiB huge page instead
 * of 512, and each exiting call has that many fewer to tear down: the warm worker's heap is most of what a
 * fork copies. CPython's small-object arenas are 1 MiB mmaps at arbitrary addresses, so
 * ``use_huge_page_arenas`` (called first thing in the worker) places later arenas in 2 MiB-aligned chunks.
 * ``collapse_huge_pages`` (in the worker, once warm) has the kernel rebuild every aligned 2 MiB window of the
 * anonymous heap as a huge page (MADV_COLLAPSE, Linux 6.1+; elsewhere nothing changes); the fork server
 * redoes it for the windows its own start-up split, then forks from huge pages. A call that writes into a
 * window splits only its own mapping of it.
 * Objects over 512 bytes come from glibc's heap (the program break), which starts at an arbitrary address;
 * both functions first move the break up to a 2 MiB boundary (``align_program_break``), so that what the
 * heap grows into afterwards lies in whole windows too. glibc's malloc takes the gap for a foreign sbrk and
 * leaves it alone. In a fork + exit loop, 4 MiB of 4 KiB pages cost 0.37 ms of CPU per child that writes 60
 * scattered pages, 0.27 ms when the 4 MiB are two huge pages. */
#define CHUNK_SIZE ((size_t)2 << 20)
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

struct chunk {
    char *base;
    unsigned used; /* one bit per arena slot */
};
static struct {
    PyObjectArenaAllocator previous; /* frees the arenas made before, and serves other sizes */
    size_t arena_size;               /* learnt from the first request (CPython uses one size) */
    size_t n_chunks, capacity;
    struct chunk *chunks;
    int maps_fd; /* /proc/self/maps, opened while the worker can still see /proc */
} arenas = {.maps_fd = -1};
static struct {
    size_t n;
    uintptr_t *start; /* aligned windows [start, start + CHUNK_SIZE) */
} windows;

static char *map_chunk(void) {
    /* Over-allocate, then trim to a CHUNK_SIZE-aligned CHUNK_SIZE. */
    char *raw = mmap(NULL, 2 * CHUNK_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *base = (char *)(((uintptr_t)raw + CHUNK_SIZE - 1) & ~(uintptr_t)(CHUNK_SIZE - 1));
    if (base > raw) munmap(raw, (size_t)(base - raw));
    munmap(base + CHUNK_SIZE, (size_t)(raw + 2 * CHUNK_SIZE - (base + CHUNK_SIZE)));
    return base;
}

static void align_program_break(void) {
#ifdef __GLIBC__ /* other C libraries' mallocs need not tolerate a break moved under them */
    uintptr_t now = (uintptr_t)sbrk(0);
    uintptr_t aligned = (now + CHUNK_SIZE - 1) & ~(uintptr_t)(CHUNK_SIZE - 1);
    if (now != (uintptr_t)-1 && aligned > now) (void)sbrk((intptr_t)(aligned - now));
#endif
}

static void *arena_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (arenas.arena_size == 0 && size >= CHUNK_SIZE / 32 && CHUNK_SIZE % size == 0 &&
        size % (size_t)sysconf(_SC_PAGESIZE) == 0)
        arenas.arena_size = size;
    if (size != arenas.arena_size) return arenas.previous.alloc(arenas.previous.ctx, size);
    unsigned slots = (unsigned)(CHUNK_SIZE / size), full = slots == 32 ? ~0U : (1U << slots) - 1;
    for (size_t i = 0; i < arenas.n_chunks; i++) {
        struct chunk *c = &arenas.chunks[i];
        if (c->used == full) continue;
        unsigned slot = (unsigned)__builtin_ctz(~c->used);
        c->used |= 1U << slot;
        return c->base + slot * size;
    }
    if (arenas.n_chunks == arenas.capacity) {
        size_t capacity = arenas.capacity ? 2 * arenas.capacity : 64;
        struct chunk *grown = PyMem_RawRealloc(arenas.chunks, capacity * sizeof(struct chunk));
        if (grown == NULL) return arenas.previous.alloc(arenas.previous.ctx, size); /* freed as foreign */
        arenas.chunks = grown;
        arenas.capacity = capacity;
    }
    char *base = map_chunk();
    if (base == NULL) return NULL;
    arenas.chunks[arenas.n_chunks++] = (struct chunk){base, 1U};
    return base;
}

static void arena_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    char *base = (char *)((uintptr_t)ptr & ~(uintptr_t)(CHUNK_SIZE - 1));
    for (size_t i = 0; size == arenas.arena_size && i < arenas.n_chunks; i++) {
        struct chunk *c = &arenas.chunks[i];
        if (c->base != base) continue;
        c->used &= ~(1U << (unsigned)(((char *)ptr - base) / size));
        if (c->used == 0) {
            munmap(base, CHUNK_SIZE);
            *c = arenas.chunks[--arenas.n_chunks];
        }
        return;
    }
    arenas.previous.free(arenas.previous.ctx, ptr, size);
}

static PyObject *use_huge_page_arenas(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    if (arenas.previous.alloc != NULL) Py_RETURN_NONE;
    arenas.maps_fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    align_program_break();
    PyObject_GetArenaAllocator(&arenas.previous);
    PyObjectArenaAllocator allocator = {NULL, arena_alloc, arena_free};
    PyObject_SetArenaAllocator(&allocator);
    Py_RETURN_NONE;
}

/* The text of /proc/self/maps (NUL-terminated, PyMem_Raw), or NULL. */
static char *read_maps(void) {
    size_t size = 0, capacity = 1 << 16;
    char *text = PyMem_RawMalloc(capacity);
    while (text != NULL) {
        ssize_t n = pread(arenas.maps_fd, text + size, capacity - size - 1, (off_t)size);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        size += (size_t)n;
        if (capacity - size < 4096) {
            char *grown = PyMem_RawRealloc(text, capacity *= 2);
            if (grown == NULL) PyMem_RawFree(text);
            text = grown;
        }
    }
    if (text != NULL) text[size] = '\0';
    return text;
}

/* Collapse the remembered windows; the bytes now mapped by huge pages. */
static size_t collapse_windows(void) {
    size_t done = 0;
    for (size_t i = 0; i < windows.n; i++)
        if (madvise((void *)windows.start[i], CHUNK_SIZE, MADV_COLLAPSE) == 0) done += CHUNK_SIZE;
    return done;
}

static PyObject *collapse_huge_pages(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    if (arenas.maps_fd < 0) return PyLong_FromLong(0);
    align_program_break(); /* the heap's last window, partly past the break, becomes whole */
    char *text = read_maps();
    if (text == NULL) return PyLong_FromLong(0);
    size_t n = 0, capacity = 0;
    uintptr_t *start = NULL;
    int out_of_memory = 0;
    for (char *line = text, *next; *line && !out_of_memory; line = next) {
        next = strchr(line, '\n');
        next = next ? next + 1 : line + strlen(line);
        unsigned long low, high, inode;
        char perms[5];
        int path_at = 0;
        if (sscanf(line, "%lx-%lx %4s %*s %*s %lu%n", &low, &high, perms, &inode, &path_at) < 4) continue;
        const char *path = line + path_at + strspn(line + path_at, " \t");
        int anonymous = inode == 0 && (*path == '\n' || *path == '\0' || strncmp(path, "[heap]", 6) == 0);
        if (!anonymous || strcmp(perms, "rw-p") != 0) continue;
        for (uintptr_t w = (low + CHUNK_SIZE - 1) & ~(uintptr_t)(CHUNK_SIZE - 1); w + CHUNK_SIZE <= high;
             w += CHUNK_SIZE) {
            if (n == capacity) {
                size_t grown_capacity = capacity ? 2 * capacity : 256;
                uintptr_t *grown = PyMem_RawRealloc(start, grown_capacity * sizeof(*start));
                if (grown == NULL) { /* collapse the windows found so far */
                    out_of_memory = 1;
                    break;
                }
                start = grown;
                capacity = grown_capacity;
            }
            start[n++] = w;
        }
    }
    PyMem_RawFree(text);
    PyMem_RawFree(windows.start);
    windows.start = start;
    windows.n = n;
    return PyLong_FromSize_t(collapse_windows());
}

/* The request's payload from its memfd; NULL with errno set if it cannot be read. */
static PyObject *read_payload(int fd, int64_t size) {
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (payload == NULL) return NULL;
    char *data = PyBytes_AS_STRING(payload);
    for (int64_t done = 0; done < size;) {
        ssize_t n = pread(fd, data + done, (size_t)(size - done), (off_t)done);
        if (n <= 0) {
            int error = n == 0 ? EIO : errno; /* the caller reports errno; no Python error is raised */
            Py_DECREF(payload);
            errno = error;
            return NULL;
        }
        done += n;
    }
    return payload;
}

/* Up to Python 3.12, PyOS_BeforeFork/PyOS_AfterFork_Parent only run the before/after-in-parent at-fork hooks
 * and hold the import lock across the fork: nothing for a single-threaded loop that is neither importing
 * nor running Python. They also write to the import lock, which PyOS_AfterFork_Child reallocated in glibc's
 * heap when the fork server started; with every call sharing the heap's huge pages that write would split
 * one of them in the fork server at its first fork, and every later fork would copy 512 entries for it.
 * 3.13 pairs them with PyOS_AfterFork_Child (the runtime's head lock), so they stay there. */
#if PY_VERSION_HEX < 0x030D0000
#define BEFORE_FORK()
#define AFTER_FORK_PARENT()
#else
#define BEFORE_FORK() PyOS_BeforeFork()
#define AFTER_FORK_PARENT() PyOS_AfterFork_Parent()
#endif

static PyObject *serve_forks(PyObject *module, PyObject *args) {
    int sock;
    (void)module;
    if (!PyArg_ParseTuple(args, "i:serve_forks", &sock)) return NULL;
    collapse_windows(); /* again: the fork server's own start-up wrote to (and split) some windows */
    for (;;) {
        struct fork_request request;
        union {
            char buffer[CMSG_SPACE(sizeof(int) * (MAX_TARGETS + 1))];
            struct cmsghdr align;
        } control;
        struct iovec iov = {&request, sizeof(request)};
        struct msghdr message = {0};
        message.msg_iov = &iov;
        message.msg_iovlen = 1;
        message.msg_control = control.buffer;
        message.msg_controllen = sizeof(control.buffer);
        ssize_t n = recvmsg(sock, &message, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) Py_RETURN_NONE; /* the worker is gone */

        int fds[MAX_TARGETS + 1], n_fds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c != NULL; c = CMSG_NXTHDR(&message, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (n_fds <= MAX_TARGETS) fds[n_fds++] = fd;
                else close(fd);
            }
        }
        int64_t reply;
        if ((size_t)n != sizeof(request) || (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
            !request_is_valid(&request, n_fds)) {
            reply = -EINVAL;
        } else {
            BEFORE_FORK();
            pid_t pid = clone_call(request.plan.new_pid_namespace);
            if (pid == 0) {
                PyOS_AfterFork_Child();
                int payload_fd = fds[request.n_targets];
                PyObject *payload = read_payload(payload_fd, request.payload_size);
                if (payload == NULL) fail(stderr_source(&request, fds), "reading the request");
                set_up_call(&request, fds);
                return payload;
            }
            reply = pid > 0 ? (int64_t)pid : -(int64_t)errno;
            AFTER_FORK_PARENT();
        }
        for (int i = 0; i < n_fds; i++) close(fds[i]);
        while (send(sock, &reply, sizeof(reply), MSG_NOSIGNAL) < 0) {
            if (errno != EINTR) Py_RETURN_NONE;
        }
    }
}

static PyObject *request_fork(PyObject *module, PyObject *args) {
    int sock;
    Py_buffer request, payload;
    PyObject *sources;
    (void)module;
    if (!PyArg_ParseTuple(args, "iy*O!y*:request_fork", &sock, &request, &PyTuple_Type, &sources, &payload))
        return NULL;
    PyObject *result = NULL;
    int memfd = -1;
    Py_ssize_t n_sources = PyTuple_GET_SIZE(sources);
    if (request.len != (Py_ssize_t)sizeof(struct fork_request) || n_sources < 1 || n_sources > MAX_TARGETS) {
        PyErr_SetString(PyExc_ValueError, "request_fork: a packed FORK_REQUEST and 1 to 8 source descriptors");
        goto done;
    }
    int fds[MAX_TARGETS + 1];
    for (Py_ssize_t i = 0; i < n_sources; i++) {
        fds[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(sources, i));
        if (PyErr_Occurred()) goto done;
    }
    if ((memfd = (int)syscall(SYS_memfd_create, "sandbox-call", MFD_CLOEXEC)) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    for (Py_ssize_t done = 0; done < payload.len;) {
        ssize_t n = write(memfd, (char *)payload.buf + done, (size_t)(payload.len - done));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        done += n;
    }
    fds[n_sources] = memfd;

    union {
        char buffer[CMSG_SPACE(sizeof(int) * (MAX_TARGETS + 1))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof(control));
    struct iovec iov = {request.buf, (size_t)request.len};
    struct msghdr message = {0};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    message.msg_control = control.buffer;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)(n_sources + 1));
    struct cmsghdr *c = CMSG_FIRSTHDR(&message);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)(n_sources + 1));
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)(n_sources + 1));

    int64_t reply = 0;
    ssize_t n;
    Py_BEGIN_ALLOW_THREADS
    do n = sendmsg(sock, &message, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n >= 0) {
        do n = recv(sock, &reply, sizeof(reply), 0);
        while (n < 0 && errno == EINTR);
    }
    Py_END_ALLOW_THREADS
    if (n < 0) {
        PyErr_SetFromErrno(PyExc_ConnectionError);
    } else if (n != (ssize_t)sizeof(reply)) {
        PyErr_SetString(PyExc_ConnectionError, "the fork server is gone");
    } else if (reply <= 0) {
        errno = (int)-reply;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = PyLong_FromLongLong(reply);
    }
done:
    if (memfd >= 0) close(memfd);
    PyBuffer_Release(&request);
    PyBuffer_Release(&payload);
    return result;
}

static PyObject *make_socketpair(PyObject *module, PyObject *unused) {
    int fds[2];
    (void)module;
    (void)unused;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("(ii)", fds[0], fds[1]);
}

static PyMethodDef methods[] = {
    {"socketpair", make_socketpair, METH_NOARGS,
     "socketpair() -> (worker_end, forker_end): a SOCK_SEQPACKET pair for requests and replies."},
    {"serve_forks", serve_forks, METH_VARARGS,
     "serve_forks(forker_end) -> bytes | None: the fork server's loop (see the module doc)."},
    {"request_fork", request_fork, METH_VARARGS,
     "request_fork(worker_end, request, sources, payload) -> pid of the new, isolated call."},
    {"use_huge_page_arenas", use_huge_page_arenas, METH_NOARGS,
     "use_huge_page_arenas() -> None: put later small-object arenas in 2 MiB-aligned chunks and move the "
     "program break to a 2 MiB boundary (see _spawn.c)."},
    {"collapse_huge_pages", collapse_huge_pages, METH_NOARGS,
     "collapse_huge_pages() -> int: map the anonymous heap with huge pages where possible; bytes mapped so."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sandbox_server._spawn", "A fork server for isolated sandbox calls (see _spawn.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__spawn(void) {
    PyObject *m = PyModule_Create(&module);
    /* isolation.py compares it with its WIRE_PLAN: a build older than the Python code is not used. */
    if (m != NULL && PyModule_AddIntConstant(m, "WIRE_PLAN_SIZE", (long)sizeof(struct wire_plan)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
