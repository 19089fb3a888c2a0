/* Fork one isolated call in a single C call: the child's whole set-up runs without Python.
 *
 * Why: after fork every Python object the child touches (functions, code objects, ints, the ctypes
 * machinery) is a copy-on-write fault of the warm worker's memory. Setting up a call through
 * isolation.CallSandbox's Python steps costs ~150 such faults; here it costs none, because the set-up
 * only makes system calls on values parsed in the parent before the fork.
 *
 * This module is optional: without a C compiler the package falls back to the same steps in Python
 * (isolation.CallSandbox.enter_namespaces / drop_privileges), which the tests check behave the same.
 *
 *   spawn(spec, targets, cpu_seconds) -> pid in the worker, 0 in the isolated child
 *
 * spec (isolation.CallSandbox.native_spec, built once per plan):
 *   (oom_adj_fd, own_pidns_fd, unshare_flags, netns_fd, tmpfs_options: bytes | None, workdir: bytes,
 *    limits: ((resource, value), ...), uid, seccomp_address, worker_pidfd_target, fd_end)
 *   with -1 (0 for seccomp_address) meaning "not used".
 * targets: (target_fd, source_fd, ...): what the child's descriptors below fd_end must be.
 *
 * Child steps, in order (as the Python fallback does them): new session; unshare the namespaces; join the
 * slot's network namespace; mount the private tmpfs on /tmp; chdir; move the targets into place and close
 * every other descriptor; rlimits with soft = hard (RLIMIT_CPU = cpu_seconds); drop to uid/gid with no
 * supplementary groups; no-new-privs, parent-death SIGKILL, not dumpable; seccomp filter; exit quietly if
 * the worker is already gone (its pidfd readable), then close that pidfd. A failing step writes
 * "sandbox setup failed: <step>: <error>" to the call's stderr and exits with status 71.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SETUP_FAILED_EXIT 71
#define MAX_TARGETS 8
#define MAX_LIMITS 16

#ifndef PR_SET_NO_NEW_PRIVS
#define PR_SET_NO_NEW_PRIVS 38
#endif
#ifndef SECCOMP_MODE_FILTER
#define SECCOMP_MODE_FILTER 2
#endif

typedef struct {
    int oom_adj_fd, own_pidns_fd, unshare_flags, netns_fd;
    const char *tmpfs_options, *workdir;
    int n_limits, limit_resource[MAX_LIMITS];
    long long limit_value[MAX_LIMITS];
    int uid;
    unsigned long long seccomp_address;
    int worker_pidfd, fd_end;
    int n_targets, target[MAX_TARGETS], source[MAX_TARGETS];
    long long cpu_seconds;
} Plan;

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

static int is_target(const Plan *plan, int fd) {
    for (int i = 0; i < plan->n_targets; i++)
        if (plan->target[i] == fd) return 1;
    return 0;
}

static void close_from(int first) {
#ifdef SYS_close_range
    if (syscall(SYS_close_range, (unsigned int)first, ~0U, 0) == 0) return;
#endif
    struct rlimit limit;
    long last = getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY ? (long)limit.rlim_cur
                                                                                          : 1L << 20;
    for (long fd = first; fd < last; fd++) close((int)fd);
}

static void child_setup(const Plan *plan) {
    int err = 2;  /* the call's stderr: its source descriptor until the targets are in place */
    for (int i = 0; i < plan->n_targets; i++)
        if (plan->target[i] == 2) err = plan->source[i];

    if (setsid() < 0) fail(err, "setsid");
    if (plan->unshare_flags && unshare(plan->unshare_flags) != 0) fail(err, "unshare");
    if (plan->netns_fd >= 0 && setns(plan->netns_fd, CLONE_NEWNET) != 0) fail(err, "setns(network)");
    if (plan->tmpfs_options &&
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, plan->tmpfs_options) != 0)
        fail(err, "mount(tmpfs on /tmp)");
    if (chdir(plan->workdir) != 0) fail(err, "chdir");

    /* Lift every source above the targets first, so no dup2 clobbers a source still needed. */
    int lifted[MAX_TARGETS];
    for (int i = 0; i < plan->n_targets; i++)
        if ((lifted[i] = fcntl(plan->source[i], F_DUPFD, plan->fd_end)) < 0) fail(err, "fcntl(F_DUPFD)");
    for (int i = 0; i < plan->n_targets; i++)
        if (dup2(lifted[i], plan->target[i]) < 0) fail(err, "dup2");
    err = 2;
    for (int fd = 3; fd < plan->fd_end; fd++)
        if (!is_target(plan, fd)) close(fd);
    close_from(plan->fd_end);

    for (int i = 0; i < plan->n_limits; i++) {
        struct rlimit limit = {(rlim_t)plan->limit_value[i], (rlim_t)plan->limit_value[i]};
        if (setrlimit(plan->limit_resource[i], &limit) != 0) fail(err, "setrlimit");
    }
    struct rlimit cpu = {(rlim_t)plan->cpu_seconds, (rlim_t)plan->cpu_seconds};
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
    if (poll(&worker, 1, 0) > 0) _exit(0);  /* the worker died before the parent-death signal was armed */
    close(plan->worker_pidfd);
}

static int parse_plan(PyObject *spec, PyObject *targets, long long cpu_seconds, Plan *plan) {
    PyObject *tmpfs, *limits;
    memset(plan, 0, sizeof(*plan));
    if (!PyArg_ParseTuple(spec, "iiiiOyO!iKii;spec", &plan->oom_adj_fd, &plan->own_pidns_fd,
                          &plan->unshare_flags, &plan->netns_fd, &tmpfs, &plan->workdir, &PyTuple_Type,
                          &limits, &plan->uid, &plan->seccomp_address, &plan->worker_pidfd, &plan->fd_end))
        return -1;
    if (tmpfs != Py_None) {
        if (!PyBytes_Check(tmpfs)) {
            PyErr_SetString(PyExc_TypeError, "spec: tmpfs_options must be bytes or None");
            return -1;
        }
        plan->tmpfs_options = PyBytes_AS_STRING(tmpfs);
    }
    Py_ssize_t n_limits = PyTuple_GET_SIZE(limits);
    if (n_limits > MAX_LIMITS) {
        PyErr_SetString(PyExc_ValueError, "spec: too many limits");
        return -1;
    }
    plan->n_limits = (int)n_limits;
    for (Py_ssize_t i = 0; i < n_limits; i++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(limits, i), "iL;limit", &plan->limit_resource[i],
                              &plan->limit_value[i]))
            return -1;
    if (!PyTuple_Check(targets) || PyTuple_GET_SIZE(targets) % 2 || PyTuple_GET_SIZE(targets) > 2 * MAX_TARGETS) {
        PyErr_SetString(PyExc_ValueError, "targets must be a tuple of (target, source) descriptor pairs");
        return -1;
    }
    plan->n_targets = (int)(PyTuple_GET_SIZE(targets) / 2);
    for (int i = 0; i < plan->n_targets; i++) {
        plan->target[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(targets, 2 * i));
        plan->source[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(targets, 2 * i + 1));
        if (PyErr_Occurred()) return -1;
        if (plan->target[i] < 0 || plan->target[i] >= plan->fd_end || plan->source[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "targets: descriptors must be >= 0 and targets below fd_end");
            return -1;
        }
    }
    plan->cpu_seconds = cpu_seconds;
    return 0;
}

static PyObject *spawn(PyObject *module, PyObject *args) {
    PyObject *spec, *targets;
    long long cpu_seconds;
    Plan plan;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!OL:spawn", &PyTuple_Type, &spec, &targets, &cpu_seconds)) return NULL;
    if (parse_plan(spec, targets, cpu_seconds, &plan) != 0) return NULL;

    if (plan.oom_adj_fd >= 0 && pwrite(plan.oom_adj_fd, "1000", 4, 0) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (plan.own_pidns_fd >= 0 && unshare(CLONE_NEWPID) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (plan.oom_adj_fd >= 0) (void)pwrite(plan.oom_adj_fd, "-1000", 5, 0);
        return NULL;
    }
    PyOS_BeforeFork();
    pid_t pid = fork();
    if (pid == 0) {
        child_setup(&plan);
        PyOS_AfterFork_Child();
        return PyLong_FromLong(0);
    }
    int fork_error = errno;
    PyOS_AfterFork_Parent();
    /* Back to the worker's own PID namespace (for its future children) and OOM priority. */
    if (plan.own_pidns_fd >= 0 && setns(plan.own_pidns_fd, CLONE_NEWPID) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    if (plan.oom_adj_fd >= 0) (void)pwrite(plan.oom_adj_fd, "-1000", 5, 0);
    if (pid < 0) {
        errno = fork_error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(pid);
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS,
     "spawn(spec, targets, cpu_seconds) -> pid in the worker, 0 in the isolated child (see the module doc)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sandbox_server._spawn",
                                    "Fork an isolated sandbox call with its set-up done in C.", -1, methods};

PyMODINIT_FUNC PyInit__spawn(void) { return PyModule_Create(&module); }
