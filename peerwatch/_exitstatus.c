/* peerwatch._exitstatus: this rank's success marker or failure record, written from the
 * exit status itself.
 *
 * Python cannot see every exit status: on Python <= 3.11 a SystemExit that reaches the
 * top (`raise SystemExit(main())`, the builtin exit(n)) is turned into exit(n) by
 * CPython's handle_system_exit after the interpreter is finalized. glibc's on_exit(3)
 * passes that very status to its callbacks. peerwatch (peerwatch/rundir/exitwatch.py) prepares
 * everything while Python runs: two open directory fds (events/ and tmp/ of the run
 * directory), the file names, the records encoded by peerwatch.core.records around the two
 * numbers only known at exit (the time and the exit code), and the pid of the rank.
 *
 * The callback runs after Python is gone: it uses only syscalls and the buffers prepared
 * here, no Python API, no malloc, no stdio. It does nothing in another process than the
 * rank (a forked DataLoader worker inherits the registration). It writes the way
 * RunDir.write does: a temp file in tmp/, then link(2) into events/, so a reader never
 * sees half a record and the first writer wins. It runs before the process becomes a
 * zombie: a peer woken by the rank's pidfd finds the record already there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_PIECE 4096 /* bytes of one prepared piece: records here are a few hundred */
#define MAX_NAME 256
#define MAX_DIGITS 24 /* a 64-bit number in decimal, with a sign */

typedef struct {
    char data[MAX_PIECE];
    size_t len;
} piece;

typedef struct {
    int armed;
    int write_success;
    pid_t pid;
    int events_fd;
    int tmp_fd;
    /* What the two fds were when armed (device, inode) and the folders' paths: the
     * application may have taken the numbers since (os.closerange, dup2 of /dev/null). */
    dev_t events_dev, tmp_dev;
    ino_t events_ino, tmp_ino;
    char events_path[PATH_MAX];
    char tmp_path[PATH_MAX];
    char success_name[MAX_NAME];
    char failure_name[MAX_NAME];
    piece success_head, success_tail;              /* head <time_ns> tail */
    piece failure_head, failure_mid, failure_tail; /* head <time_ns> mid <exit code> tail */
    piece complaint;                               /* "peerwatch: rank N could not write " */
    char out[3 * MAX_PIECE + 2 * MAX_DIGITS];
} state;

static state st;
static int registered;

/* Leaving during a teardown: the exit record (events/exit-<rank>.json) says how this
 * rank really ended, by whichever path gets there first: leave(code) (os._exit with the
 * verdict's code), the exit status at exit(), or a SIGTERM (torchrun's agent and
 * mp.spawn's main process stop their workers with one as soon as they saw the failed
 * one). The first to claim writes the record; the others step aside. */
typedef struct {
    int armed; /* a teardown began: leave() and exit() write the record too */
    int term;  /* the record is prepared: a SIGTERM writes it, from install() on */
    pid_t pid; /* the process it was prepared in (a forked child is not that rank) */
    char name[MAX_NAME];
    piece head, mid, mid2, tail; /* head <time_ns> mid <returncode> mid2 <sender pid or null> tail */
    char out[4 * MAX_PIECE + 3 * MAX_DIGITS];
} leaving_state;

static leaving_state lv;
static int claimed; /* set once, atomically, by whichever path writes the exit record */
static int term_installed; /* on_term was installed in this process (once: see arm_leaving) */

/* A SIGTERM held back: torchrun's agent and mp.spawn's main process stop the other workers
 * about 0.1 s after they see one end, and a rank acting on the verdict by then (its summary
 * of the failure not printed yet) would die silent. From hold_term(seconds) on, a SIGTERM is
 * noted instead, with its sender, and the process ends by it, as it would have at once, at
 * leave() or exit(), or when the hold runs out (a timer sends SIGTERM again), whichever
 * comes first. */
static long long hold_until_ns;    /* CLOCK_MONOTONIC; 0: no hold */
static volatile sig_atomic_t held; /* a SIGTERM came during the hold */
static long long held_sender;      /* its sender's pid, or 0 */
static timer_t hold_timer;
static int have_timer;

static int claim(void)
{
    return __atomic_exchange_n(&claimed, 1, __ATOMIC_SEQ_CST) == 0;
}

static size_t put_bytes(char *out, size_t at, const piece *p)
{
    memcpy(out + at, p->data, p->len);
    return at + p->len;
}

static size_t put_number(char *out, size_t at, long long value)
{
    char digits[MAX_DIGITS];
    size_t n = 0;
    unsigned long long v = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v && n < sizeof digits);
    if (value < 0)
        out[at++] = '-';
    while (n)
        out[at++] = digits[--n];
    return at;
}

static long long now_ns(clockid_t clock)
{
    struct timespec ts;
    if (clock_gettime(clock, &ts) != 0)
        return 0;
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Who sent SIGINT, for a KeyboardInterrupt's record: the job was interrupted from outside,
 * and by whom is worth saying. The handler notes the sender and passes the signal on to the
 * handler it replaced (Python's, which raises KeyboardInterrupt), as the kernel would have;
 * installed only over such a handler (see watch_interrupts). Of a burst (Ctrl-C reaches a
 * torchrun worker, then its agent passes it on) the first is kept: the one that raised. */
#define INT_BURST_NS 1000000000LL
static struct sigaction int_prev;
static volatile sig_atomic_t int_seen;
static long long int_sender;  /* the sender's pid, or 0 (not known: a terminal's Ctrl-C) */
static long long int_time_ns; /* when it came (CLOCK_MONOTONIC) */

static void on_int(int sig, siginfo_t *info, void *ctx)
{
    int saved_errno = errno;
    long long now = now_ns(CLOCK_MONOTONIC);
    if (!int_seen || now - int_time_ns > INT_BURST_NS) {
        int_sender = info != NULL && (info->si_code == SI_USER || info->si_code == SI_QUEUE) ? (long long)info->si_pid : 0;
        int_time_ns = now;
        int_seen = 1;
    }
    errno = saved_errno;
    if (int_prev.sa_flags & SA_SIGINFO)
        int_prev.sa_sigaction(sig, info, ctx);
    else if (int_prev.sa_handler != SIG_DFL && int_prev.sa_handler != SIG_IGN)
        int_prev.sa_handler(sig);
}

/* tmp/<name>.<pid>.0.<monotonic ns>, as RunDir.write names its temp files. */
static int temp_name(char *buf, size_t size, const char *name)
{
    size_t n = strlen(name);
    if (n + 2 * MAX_DIGITS + 4 >= size)
        return -1;
    memcpy(buf, name, n);
    buf[n++] = '.';
    n = put_number(buf, n, (long long)st.pid);
    buf[n++] = '.';
    buf[n++] = '0';
    buf[n++] = '.';
    n = put_number(buf, n, now_ns(CLOCK_MONOTONIC));
    buf[n] = '\0';
    return 0;
}

/* *fd, if it still is the folder that was armed (device and inode); else that folder
 * opened again by its path (never through a symlink at its end), accepted only if it is
 * that very folder. The old number is the application's now: never closed. */
static int same_dir(int fd, dev_t dev, ino_t ino)
{
    struct stat sb;
    return fd >= 0 && fstat(fd, &sb) == 0 && S_ISDIR(sb.st_mode) && sb.st_dev == dev && sb.st_ino == ino;
}

static int checked_dir(int *fd, dev_t dev, ino_t ino, const char *path)
{
    if (same_dir(*fd, dev, ino))
        return 0;
    int fresh = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fresh < 0)
        return errno;
    if (!same_dir(fresh, dev, ino)) {
        close(fresh);
        return ESTALE; /* not the directory that was checked: not written there */
    }
    *fd = fresh;
    return 0;
}

static int check_dirs(void)
{
    int err = checked_dir(&st.tmp_fd, st.tmp_dev, st.tmp_ino, st.tmp_path);
    return err ? err : checked_dir(&st.events_fd, st.events_dev, st.events_ino, st.events_path);
}

/* Out of descriptors at exit (EMFILE: a leak, many DataLoader workers), the record of how
 * this rank ended must still be written, or its clean exit reads as a failure to its
 * peers: the soft limit is raised to the hard one (the process is ending). Returns 1 if it was. */
static int more_descriptors(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max)
        return 0;
    rl.rlim_cur = rl.rlim_max;
    return setrlimit(RLIMIT_NOFILE, &rl) == 0;
}

/* Write data to events/<name>: the first writer wins (link), or, for this rank's own
 * success marker, whatever sits there is replaced (rename: garbage planted in its place
 * must not block it). Returns 0, or the errno that stopped it. */
static int write_record(const char *name, const char *data, size_t len, int replace)
{
    char tmp[MAX_NAME + 2 * MAX_DIGITS + 8];
    if (temp_name(tmp, sizeof tmp, name) != 0)
        return ENAMETOOLONG;
    int bad = check_dirs();
    if (bad)
        return bad;
    int fd = openat(st.tmp_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE) && more_descriptors())
        fd = openat(st.tmp_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return errno;
    size_t done = 0;
    int err = 0;
    while (done < len) {
        ssize_t n = write(fd, data + done, len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            err = n < 0 ? errno : EIO;
            break;
        }
        done += (size_t)n;
    }
    if (close(fd) != 0 && !err)
        err = errno;
    if (!err && replace && renameat(st.tmp_fd, tmp, st.events_fd, name) != 0)
        err = errno;
    if (!err && !replace && linkat(st.tmp_fd, tmp, st.events_fd, name, 0) != 0 && errno != EEXIST)
        err = errno; /* EEXIST: another record won */
    (void)unlinkat(st.tmp_fd, tmp, 0);
    return err;
}

/* Say on stderr (the only voice left after Python) that a record could not be written. */
static void complain(const char *name, int err)
{
    char line[MAX_PIECE + MAX_NAME + 256];
    size_t n = put_bytes(line, 0, &st.complaint);
    size_t k = strlen(name);
    memcpy(line + n, name, k);
    n += k;
    const char *why = strerror(err);
    k = strlen(why);
    if (k > 200)
        k = 200;
    line[n++] = ':';
    line[n++] = ' ';
    memcpy(line + n, why, k);
    n += k;
    line[n++] = '\n';
    ssize_t w = write(2, line, n);
    (void)w;
}

static int exists(int dir_fd, const char *name)
{
    struct stat sb;
    return fstatat(dir_fd, name, &sb, AT_SYMLINK_NOFOLLOW) == 0;
}

static void write_exit_record(long long returncode, long long sender)
{
    size_t n = put_bytes(lv.out, 0, &lv.head);
    n = put_number(lv.out, n, now_ns(CLOCK_REALTIME));
    n = put_bytes(lv.out, n, &lv.mid);
    n = put_number(lv.out, n, returncode);
    n = put_bytes(lv.out, n, &lv.mid2);
    if (sender > 0) {
        n = put_number(lv.out, n, sender);
    } else {
        memcpy(lv.out + n, "null", 4);
        n += 4;
    }
    n = put_bytes(lv.out, n, &lv.tail);
    (void)write_record(lv.name, lv.out, n, 0);
}

static void die_by(int sig);

static void default_action(int sig)
{
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    (void)sigaction(sig, &dfl, NULL);
}

static int hold(long long sender)
{
    if (held || hold_until_ns == 0 || !have_timer)
        return 0;
    long long left = hold_until_ns - now_ns(CLOCK_MONOTONIC);
    if (left <= 0)
        return 0;
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    its.it_value.tv_sec = (time_t)(left / 1000000000LL);
    its.it_value.tv_nsec = (long)(left % 1000000000LL);
    if (timer_settime(hold_timer, 0, &its, NULL) != 0)
        return 0;
    held_sender = sender;
    held = 1;
    return 1;
}

static void on_term(int sig, siginfo_t *info, void *ctx)
{
    (void)ctx;
    int saved_errno = errno;
    long long sender = info != NULL && info->si_code == SI_USER ? (long long)info->si_pid : 0;
    int ours = st.armed && lv.term && getpid() == st.pid && lv.pid == st.pid;
    if (ours && !claimed && hold(sender)) {
        errno = saved_errno;
        return; /* noted: the process ends by it at leave(), exit() or the hold's end */
    }
    if (ours && claim())
        write_exit_record(-(long long)sig, held ? held_sender : sender);
    else if (claimed && getpid() == st.pid) {
        /* leave() or exit() claimed first: the process is ending with that status now. */
        errno = saved_errno;
        return;
    }
    /* End by the signal's default action, as without us: it is delivered once we return. */
    default_action(sig);
    (void)raise(sig);
    errno = saved_errno;
}

/* A held SIGTERM: end by it now, its record written first (unless another path claimed). */
static void die_by(int sig)
{
    if (claim())
        write_exit_record(-(long long)sig, held_sender);
    default_action(sig);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    (void)sigprocmask(SIG_UNBLOCK, &set, NULL);
    (void)raise(sig);
    _exit(128 + sig); /* not reached: the signal's default action ends the process */
}

static void at_exit(int status, void *arg)
{
    (void)arg;
    int saved_errno = errno;
    if (!st.armed || getpid() != st.pid)
        goto out;
    int code = status & 0xFF; /* what the parent will see */
    size_t n;
    if (held)
        die_by(SIGTERM); /* the SIGTERM held back ends it, as it would have at once */
    if (lv.armed && claim())
        write_exit_record(code, 0);
    if (code == 0) {
        /* A failure already recorded (by Python, or on this rank's behalf) stands. */
        if (!st.write_success || (check_dirs() == 0 && exists(st.events_fd, st.failure_name)))
            goto out;
        n = put_bytes(st.out, 0, &st.success_head);
        n = put_number(st.out, n, now_ns(CLOCK_REALTIME));
        n = put_bytes(st.out, n, &st.success_tail);
        int err = write_record(st.success_name, st.out, n, 1);
        if (err)
            complain(st.success_name, err);
    } else {
        n = put_bytes(st.out, 0, &st.failure_head);
        n = put_number(st.out, n, now_ns(CLOCK_REALTIME));
        n = put_bytes(st.out, n, &st.failure_mid);
        n = put_number(st.out, n, (long long)code);
        n = put_bytes(st.out, n, &st.failure_tail);
        int err = write_record(st.failure_name, st.out, n, 0);
        if (err)
            complain(st.failure_name, err);
    }
out:
    errno = saved_errno;
}

static int copy_piece(piece *p, Py_buffer *b)
{
    if (b->len < 0 || (size_t)b->len > sizeof p->data) {
        PyErr_SetString(PyExc_ValueError, "record piece too long");
        return -1;
    }
    memcpy(p->data, b->buf, (size_t)b->len);
    p->len = (size_t)b->len;
    return 0;
}

static int copy_name(char *dst, Py_buffer *b)
{
    if (b->len <= 0 || (size_t)b->len >= MAX_NAME || memchr(b->buf, '/', (size_t)b->len) ||
        memchr(b->buf, '\0', (size_t)b->len)) {
        PyErr_SetString(PyExc_ValueError, "bad record file name");
        return -1;
    }
    memcpy(dst, b->buf, (size_t)b->len);
    dst[b->len] = '\0';
    return 0;
}

PyDoc_STRVAR(arm_doc,
"arm(events_fd, tmp_fd, pid, success_name, success_head, success_tail, failure_name,\n"
"    failure_head, failure_mid, failure_tail, write_success, complaint, events_path, tmp_path)\n"
"\n"
"At exit of process ``pid``: status 0 -> success marker (if write_success and no failure\n"
"record is there), else the failure record. Takes ownership of the two fds; an earlier\n"
"arm's fds are closed. A fd the application took since (closed, dup2'd over) is replaced at\n"
"exit by its folder opened again by path, if that is the same directory (device, inode).\n"
"Raises OSError if on_exit cannot register the callback or an fd is not a directory.");

#define NBUFFERS 8  /* the byte arguments of arm() */

static void release_all(Py_buffer **buffers, int n)
{
    for (int i = 0; i < n; i++)
        PyBuffer_Release(buffers[i]);
}

static PyObject *arm(PyObject *self, PyObject *args)
{
    int events_fd, tmp_fd, pid, write_success;
    Py_buffer sn, sh, stl, fn, fh, fm, ft, cp;
    const char *events_path, *tmp_path;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiiy*y*y*y*y*y*y*py*yy", &events_fd, &tmp_fd, &pid, &sn, &sh, &stl, &fn, &fh,
                          &fm, &ft, &write_success, &cp, &events_path, &tmp_path))
        return NULL;
    Py_buffer *buffers[] = {&cp, &sn, &sh, &stl, &fn, &fh, &fm, &ft};
    static state next;
    struct stat esb, tsb;
    if (strlen(events_path) >= PATH_MAX || strlen(tmp_path) >= PATH_MAX || fstat(events_fd, &esb) != 0 ||
        fstat(tmp_fd, &tsb) != 0 || !S_ISDIR(esb.st_mode) || !S_ISDIR(tsb.st_mode)) {
        release_all(buffers, NBUFFERS);
        PyErr_SetString(PyExc_OSError, "bad directory fd or path");
        return NULL;
    }
    strcpy(next.events_path, events_path);
    strcpy(next.tmp_path, tmp_path);
    next.events_dev = esb.st_dev;
    next.events_ino = esb.st_ino;
    next.tmp_dev = tsb.st_dev;
    next.tmp_ino = tsb.st_ino;
    int bad = copy_name(next.success_name, &sn) || copy_piece(&next.success_head, &sh) ||
              copy_piece(&next.success_tail, &stl) || copy_name(next.failure_name, &fn) ||
              copy_piece(&next.failure_head, &fh) || copy_piece(&next.failure_mid, &fm) ||
              copy_piece(&next.failure_tail, &ft) || copy_piece(&next.complaint, &cp);
    release_all(buffers, NBUFFERS);
    if (bad)
        return NULL;
    if (!registered) {
        if (on_exit(at_exit, NULL) != 0) {
            PyErr_SetString(PyExc_OSError, "on_exit() failed");
            return NULL;
        }
        registered = 1;
    }
    /* An earlier arm's fds are closed only if they are still its folders: a number the
     * application took since is the application's. */
    int old_events = st.armed && same_dir(st.events_fd, st.events_dev, st.events_ino) ? st.events_fd : -1;
    int old_tmp = st.armed && same_dir(st.tmp_fd, st.tmp_dev, st.tmp_ino) ? st.tmp_fd : -1;
    st.armed = 0; /* a callback running meanwhile (exit() in another thread) does nothing */
    memcpy(&st, &next, sizeof st);
    st.events_fd = events_fd;
    st.tmp_fd = tmp_fd;
    st.pid = (pid_t)pid;
    st.write_success = write_success;
    st.armed = 1;
    if (old_events >= 0 && old_events != events_fd)
        close(old_events);
    if (old_tmp >= 0 && old_tmp != tmp_fd)
        close(old_tmp);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_success_doc, "set_success(flag): whether an exit status of 0 writes the success marker.");

static PyObject *set_success(PyObject *self, PyObject *arg)
{
    (void)self;
    int flag = PyObject_IsTrue(arg);
    if (flag < 0)
        return NULL;
    st.write_success = flag;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(armed_doc, "armed() -> the pid the callback acts for, or 0.");

static PyObject *armed(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(st.armed ? (long)st.pid : 0L);
}

PyDoc_STRVAR(arm_leaving_doc,
"arm_leaving(name, head, mid, mid2, tail, teardown=True) -> bool\n"
"\n"
"Prepare events/<name>, the record ``head <time> mid <returncode> mid2 <sender> tail``,\n"
"and from now on have a SIGTERM write it (a launcher may stop this rank before its\n"
"watcher has seen why). With teardown true, this rank is being torn down: from now on\n"
"the first of leave(code), exit(code) and a SIGTERM writes it. The record is prepared\n"
"once; a later call only arms the teardown. A SIGTERM handler is installed only where\n"
"SIGTERM's action is the default one (the application's own handler is left alone);\n"
"returns whether it was. Needs arm() first.");

static int same_piece(const piece *a, const piece *b)
{
    return a->len == b->len && memcmp(a->data, b->data, a->len) == 0;
}

static int same_record(const leaving_state *a, const leaving_state *b)
{
    return strcmp(a->name, b->name) == 0 && same_piece(&a->head, &b->head) && same_piece(&a->mid, &b->mid) &&
           same_piece(&a->mid2, &b->mid2) && same_piece(&a->tail, &b->tail);
}

static PyObject *arm_leaving(PyObject *self, PyObject *args)
{
    Py_buffer nm, h, m, m2, t;
    int teardown = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*|p", &nm, &h, &m, &m2, &t, &teardown))
        return NULL;
    static leaving_state next;
    int bad = copy_name(next.name, &nm) || copy_piece(&next.head, &h) || copy_piece(&next.mid, &m) ||
              copy_piece(&next.mid2, &m2) || copy_piece(&next.tail, &t);
    PyBuffer_Release(&nm);
    PyBuffer_Release(&h);
    PyBuffer_Release(&m);
    PyBuffer_Release(&m2);
    PyBuffer_Release(&t);
    if (bad)
        return NULL;
    if (!st.armed || getpid() != st.pid) {
        PyErr_SetString(PyExc_RuntimeError, "arm() this process first");
        return NULL;
    }
    if (!lv.armed && !claimed && (lv.pid != getpid() || !same_record(&lv, &next))) {
        /* (Re)prepared until a teardown begins: install() again, or in a forked child. Only
         * its pieces, never lv.out, and never the same record again (the teardown's call):
         * a SIGTERM's handler in another thread may be writing the record from them right
         * now. Copied whole, lv.out was zeroed under it: an exit record of NULs alone. */
        __atomic_store_n(&lv.term, 0, __ATOMIC_SEQ_CST);
        memcpy(lv.name, next.name, sizeof lv.name);
        lv.head = next.head;
        lv.mid = next.mid;
        lv.mid2 = next.mid2;
        lv.tail = next.tail;
        lv.pid = getpid();
        __atomic_store_n(&lv.term, 1, __ATOMIC_SEQ_CST);
    }
    if (teardown)
        lv.armed = 1;
    struct sigaction old, act;
    if (sigaction(SIGTERM, NULL, &old) != 0)
        Py_RETURN_FALSE;
    if ((old.sa_flags & SA_SIGINFO) && old.sa_sigaction == on_term)
        Py_RETURN_TRUE; /* ours, from an earlier call */
    /* Installed once: a SIGTERM's handler sets the default action back as it ends the
     * process by the signal. Installed again meanwhile (a teardown arming in another
     * thread), it caught the very signal it raised, and the process did not end. */
    if (term_installed || (old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL)
        Py_RETURN_FALSE;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_term;
    act.sa_flags = SA_SIGINFO;
    sigemptyset(&act.sa_mask);
    if (sigaction(SIGTERM, &act, NULL) != 0)
        Py_RETURN_FALSE;
    term_installed = 1;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(leave_doc,
"leave(code): end this process now with ``code`` (as os._exit), writing the exit record\n"
"first if arm_leaving() armed it and nothing else claimed it. If a SIGTERM claimed it\n"
"first, the process is ending by that signal: wait for it.");

static PyObject *leave(PyObject *self, PyObject *arg)
{
    (void)self;
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred())
        return NULL;
    if (held && st.armed && getpid() == st.pid)
        die_by(SIGTERM); /* the SIGTERM held back ends it, as it would have at once */
    if (lv.armed && st.armed && getpid() == st.pid) {
        if (claim()) {
            write_exit_record(code & 0xFF, 0);
        } else {
            /* The SIGTERM handler wrote the record and is ending the process by the signal. */
            struct timespec second = {1, 0};
            for (int i = 0; i < 5; i++)
                (void)nanosleep(&second, NULL);
        }
    }
    _exit((int)code);
}

PyDoc_STRVAR(hold_term_doc,
"hold_term(seconds) -> bool\n"
"\n"
"For the next ``seconds``, a SIGTERM is noted instead of ending the process at once\n"
"(its exit record still says SIGTERM and who sent it): the process ends by it at\n"
"leave(), at exit(), or when the hold runs out, whichever is first. False (nothing\n"
"held) where arm_leaving() did not install the SIGTERM handler in this process or no\n"
"timer can be made.");

static PyObject *hold_term(PyObject *self, PyObject *arg)
{
    (void)self;
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    struct sigaction cur;
    if (!st.armed || getpid() != st.pid || !lv.term || lv.pid != st.pid ||
        sigaction(SIGTERM, NULL, &cur) != 0 || !(cur.sa_flags & SA_SIGINFO) || cur.sa_sigaction != on_term)
        Py_RETURN_FALSE;
    if (!have_timer) {
        struct sigevent sev;
        memset(&sev, 0, sizeof sev);
        sev.sigev_notify = SIGEV_SIGNAL;
        sev.sigev_signo = SIGTERM;
        if (timer_create(CLOCK_MONOTONIC, &sev, &hold_timer) != 0)
            Py_RETURN_FALSE;
        have_timer = 1;
    }
    long long until = now_ns(CLOCK_MONOTONIC) + (long long)(seconds * 1e9);
    if (until > hold_until_ns)
        __atomic_store_n(&hold_until_ns, until, __ATOMIC_SEQ_CST);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(watch_interrupts_doc,
"watch_interrupts() -> bool\n"
"\n"
"From now on note who sends SIGINT (interrupt_sender()), passing the signal on to the\n"
"handler it has now. Only over a handler of Python's (the default one raises\n"
"KeyboardInterrupt): a default or ignored SIGINT is left alone. True if noted from now on.");

static PyObject *watch_interrupts(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    struct sigaction cur, act;
    if (sigaction(SIGINT, NULL, &cur) != 0)
        Py_RETURN_FALSE;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_int)
        Py_RETURN_TRUE; /* ours, from an earlier call */
    if ((cur.sa_flags & SA_SIGINFO) || cur.sa_handler == SIG_DFL || cur.sa_handler == SIG_IGN)
        Py_RETURN_FALSE;
    int_prev = cur;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_int;
    act.sa_flags = (cur.sa_flags & ~SA_RESETHAND) | SA_SIGINFO;
    act.sa_mask = cur.sa_mask;
    if (sigaction(SIGINT, &act, NULL) != 0)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(last_interrupt_doc,
"last_interrupt() -> (time, sender) or None: when the last SIGINT came (CLOCK_MONOTONIC ns; the\n"
"first of a burst within a second) and the pid that sent it (0 where not known: a terminal's\n"
"Ctrl-C comes from the kernel); None where none came since watch_interrupts().");

static PyObject *last_interrupt(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (!int_seen)
        Py_RETURN_NONE;
    return Py_BuildValue("(LL)", int_time_ns, int_sender);
}

/* -- gil_timeout's watchdog ---------------------------------------------------------------
 *
 * faulthandler's dump_traceback_later counts CLOCK_MONOTONIC, which runs on while the
 * process is stopped: a job a scheduler suspended (SIGSTOP) and resumed (SIGCONT) longer
 * than gil_timeout was ended on resume, before its watcher could feed the timer. This
 * watchdog counts only the time it was itself awake to see: it wakes every GW_SLICE_NS,
 * and a slice that took longer (the process stopped, or this thread starved) counts as
 * GW_SLICE_NS + GW_SLACK_NS at most, as peerwatch.core.awake counts a judge's gaps. When the
 * watcher has not fed it for gil_timeout of such time, it writes faulthandler's "Timeout"
 * line into the stack file, has faulthandler dump every thread there (the signal it is
 * registered on, sent to this thread: the dump is done when pthread_kill returns) and
 * ends the process with status 1, as faulthandler's exit=True does. No Python API in
 * the thread: it runs while another thread holds the GIL. */
#define GW_SLICE_NS 100000000LL  /* 0.1 s */
#define GW_SLACK_NS 100000000LL

static pthread_mutex_t gw_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gw_cond;
static int gw_started, gw_pid, gw_fd = -1, gw_signal;
static long long gw_timeout_ns; /* 0: disarmed */
static unsigned long long gw_fed; /* bumped by every feed */

static long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void gw_fire(int fd, int sig, long long timeout_ns)
{
    char line[64] = "Timeout (";
    size_t n = strlen(line);
    unsigned long long secs = (unsigned long long)(timeout_ns / 1000000000LL);
    unsigned long long us = (unsigned long long)(timeout_ns % 1000000000LL / 1000);
    /* faulthandler's own format (format_timeout): the report reads it */
    if (us)
        n += (size_t)snprintf(line + n, sizeof line - n, "%llu:%02llu:%02llu.%06llu)!\n", secs / 3600,
                              secs / 60 % 60, secs % 60, us);
    else
        n += (size_t)snprintf(line + n, sizeof line - n, "%llu:%02llu:%02llu)!\n", secs / 3600, secs / 60 % 60,
                              secs % 60);
    ssize_t unused = write(fd, line, n);
    (void)unused;
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, NULL);
    pthread_kill(pthread_self(), sig); /* faulthandler's handler dumps every thread, in this one */
    _exit(1);
}

static void *gw_main(void *arg)
{
    (void)arg;
    long long awake = 0;
    unsigned long long seen = 0;
    pthread_mutex_lock(&gw_lock);
    for (;;) {
        while (gw_timeout_ns == 0) {
            pthread_cond_wait(&gw_cond, &gw_lock);
            awake = 0;
        }
        if (gw_fed != seen) {
            seen = gw_fed;
            awake = 0;
        }
        if (awake >= gw_timeout_ns && getpid() == gw_pid) {
            int fd = gw_fd, sig = gw_signal;
            long long timeout = gw_timeout_ns;
            pthread_mutex_unlock(&gw_lock);
            gw_fire(fd, sig, timeout);
        }
        long long before = mono_ns();
        struct timespec until;
        long long at = before + GW_SLICE_NS;
        until.tv_sec = (time_t)(at / 1000000000LL);
        until.tv_nsec = (long)(at % 1000000000LL);
        while (pthread_cond_timedwait(&gw_cond, &gw_lock, &until) == 0 && gw_fed == seen && gw_timeout_ns != 0)
            ; /* woken for nothing (another thread's broadcast): wait out the slice */
        long long took = mono_ns() - before;
        awake += took < GW_SLICE_NS + GW_SLACK_NS ? took : GW_SLICE_NS + GW_SLACK_NS;
    }
    return NULL;
}

PyDoc_STRVAR(gil_watch_doc,
"gil_watch(fd, signum, timeout_s): (re-)arm the watchdog: unless fed again within timeout_s of\n"
"its own awake time, faulthandler dumps every thread into fd (registered on signum) and the\n"
"process ends with status 1. timeout_s 0 disarms it. Starts its thread on first use.");

static PyObject *gil_watch(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, sig;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "iid", &fd, &sig, &timeout_s))
        return NULL;
    pthread_mutex_lock(&gw_lock);
    if (!gw_started || gw_pid != getpid()) { /* a forked child has no thread of its own yet */
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&gw_cond, &attr);
        pthread_condattr_destroy(&attr);
        pthread_t thread;
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* no signal handler of Python's runs there */
        int err = pthread_create(&thread, NULL, gw_main, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (err) {
            pthread_mutex_unlock(&gw_lock);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        pthread_detach(thread);
        gw_started = 1;
        gw_pid = getpid();
    }
    gw_fd = fd;
    gw_signal = sig;
    gw_timeout_ns = timeout_s > 0 ? (long long)(timeout_s * 1e9) : 0;
    gw_fed++;
    pthread_cond_broadcast(&gw_cond);
    pthread_mutex_unlock(&gw_lock);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gil_watch", gil_watch, METH_VARARGS, gil_watch_doc},
    {"watch_interrupts", watch_interrupts, METH_NOARGS, watch_interrupts_doc},
    {"last_interrupt", last_interrupt, METH_NOARGS, last_interrupt_doc},
    {"hold_term", hold_term, METH_O, hold_term_doc},
    {"arm", arm, METH_VARARGS, arm_doc},
    {"arm_leaving", arm_leaving, METH_VARARGS, arm_leaving_doc},
    {"leave", leave, METH_O, leave_doc},
    {"set_success", set_success, METH_O, set_success_doc},
    {"armed", armed, METH_NOARGS, armed_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "peerwatch._exitstatus",
    "The exit status, seen by glibc's on_exit(3) after Python is finalized (see rundir/exitwatch.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__exitstatus(void)
{
    return PyModule_Create(&module);
}
