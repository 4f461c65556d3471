/* snowflake_server._native._core: the generator state one worker's ids come from, shared
 * by native threads (the fast path, in C, without the GIL) and Python (the slow path,
 * snowflake_server/_ids/generator.py's NativeStateIdGenerator), under one pthread mutex.
 *
 * One state per worker: the state holds exactly the fields the common path touches, plus
 * the session gate's deadline (CLOCK_BOOTTIME seconds) and an open flag. The fast path
 * serves two cases and nothing else:
 *   - the same ms with sequence left: sequence += 1;
 *   - a new ms at or below the ceiling, sequences starting at zero: the same bookkeeping
 *     as IdGenerator._advance's new-ms branch.
 * Anything else (gate closed or past its deadline, sealed, exhausted ms, a backwards step,
 * past the ceiling, random sequence starts) returns SLOW with no field touched: Python
 * resolves it in IdGenerator's order, on the same fields under the same mutex.
 *
 * The GIL: a Python thread takes the mutex with the GIL released when it is contended (a
 * native thread holding it can finish), then takes the GIL back while holding the mutex,
 * and may run Python code under it (the session gate's copy). That cannot deadlock: native
 * threads never take the GIL, and every Python thread that blocks on this mutex has let
 * the GIL go first. The cost is that a native thread may find the mutex held for up to a
 * switch interval, hence the bounded spin below.
 *
 * A native thread never blocks on the mutex: a Python thread holding it may lose the GIL
 * for a switch interval, or hold it through a clock step it waits out (long_hold). It tries
 * the lock; if held with long_hold set it gives up at once (CONTENDED), else it tries again
 * for at most SPIN_NS, then gives up (CONTENDED). Either way the call goes to Python.
 *
 * Fork: a child has a copy of every state, which its parent goes on issuing from, and whose
 * mutex a thread that does not exist in the child may hold. A child handler (pthread_atfork)
 * bumps fork_generation; a state made in an earlier generation is stale: its fast calls are
 * SLOW and every Python method that takes its mutex raises RuntimeError. States made in the
 * child after the fork are fresh.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#define SLOW ((int64_t)-1)      /* ids are never negative */
#define CONTENDED ((int64_t)-2) /* another thread holds the state: nothing touched */
/* How long a native fast call tries a mutex held without long_hold: a Python slow-path
 * call or a scrape holds it for a few µs; longer than this and the frame is better handed
 * to Python than burnt on a core. */
#define SPIN_NS 20000

/* Bumped in every child of a fork (the child handler): states of older generations are
 * stale there. Read relaxed: only a fork changes it, and the child is single-threaded. */
static unsigned long fork_generation;

static void
after_fork_in_child(void)
{
    __atomic_add_fetch(&fork_generation, 1, __ATOMIC_RELAXED);
}

int sf_listener_init(PyObject *module); /* _listener.c: the listener's parser, registry, stats */

/* The struct lives in _state.h, with what the listener (_listener.c) calls. */
#include "_state.h"

/* The fast call. Caller holds the mutex. Touches nothing when it returns SLOW. */
static inline int64_t
fast_locked(GeneratorState *s, int64_t now, double boot_now)
{
    /* !(a <= b): a NaN reading is past any deadline. */
    if (!s->gate_open || !(boot_now <= s->gate_until) || s->sealed) {
        return SLOW;
    }
    if (now == s->last_ts) {
        if (s->sequence < s->max_sequence) {
            s->sequence += 1;
            return s->base | s->sequence;
        }
        return SLOW;
    }
    if (now > s->last_ts && now <= s->ceiling && s->zero_start) {
        s->ids_before_this_ms += s->sequence - s->first_sequence + 1;
        s->last_ts = now;
        s->base = ((now - s->epoch) << s->ts_shift) | s->node;
        s->first_sequence = s->sequence = 0;
        return s->base;
    }
    return SLOW;
}

static inline int64_t
wall_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static inline double
boot_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_BOOTTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline int64_t
monotonic_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int
stale(GeneratorState *s)
{
    return s->generation != __atomic_load_n(&fork_generation, __ATOMIC_RELAXED);
}

static inline int
long_held(GeneratorState *s)
{
    return __atomic_load_n(&s->long_hold, __ATOMIC_ACQUIRE);
}

/* The fast call on the real clocks, read under the mutex (as IdGenerator reads its clock
 * under its lock). The entry point of native threads: no GIL needed, never blocks. SLOW on
 * a stale state (a fork's copy); CONTENDED if the mutex is held with long_hold set, or
 * still held after spin_ns of tries. */
static int64_t
fast_try_why(GeneratorState *s, int64_t spin_ns, int *gate)
{
    if (stale(s)) {
        if (gate != NULL) {
            *gate = 1;
        }
        return SLOW;
    }
    if (pthread_mutex_trylock(&s->mutex) != 0) {
        if (long_held(s)) {
            return CONTENDED;
        }
        __atomic_add_fetch(&s->spinning, 1, __ATOMIC_RELAXED);
        int64_t until = monotonic_ns() + spin_ns;
        int got = 0;
        for (;;) {
            cpu_relax();
            /* Set while this call tries: the holder went into a long wait, give up now. */
            if (long_held(s)) {
                break;
            }
            if (pthread_mutex_trylock(&s->mutex) == 0) {
                got = 1;
                break;
            }
            if (monotonic_ns() >= until) {
                break;
            }
        }
        __atomic_sub_fetch(&s->spinning, 1, __ATOMIC_RELAXED);
        if (!got) {
            return CONTENDED;
        }
    }
    int64_t now = wall_ms();
    double boot = boot_s();
    int64_t id = fast_locked(s, now, boot);
    if (id == SLOW && gate != NULL) {
        /* Why, read under the mutex: the gate (closed, past its deadline) or a seal stops
         * every call until Python changes it; anything else is this call's own case. */
        *gate = !s->gate_open || !(boot <= s->gate_until) || s->sealed;
    }
    pthread_mutex_unlock(&s->mutex);
    return id;
}

static int64_t
fast_try(GeneratorState *s, int64_t spin_ns)
{
    return fast_try_why(s, spin_ns, NULL);
}

int64_t
sf_fast_try(GeneratorState *s, int64_t spin_ns, int *gate, int64_t *time_ms)
{
    int64_t id = fast_try_why(s, spin_ns, gate);
    if (id >= 0 && time_ms != NULL) {
        /* The id's own ms: its timestamp bits plus the epoch (constants of the layout). */
        *time_ms = (id >> s->ts_shift) + s->epoch;
    }
    return id;
}

unsigned long
sf_fork_generation(void)
{
    return __atomic_load_n(&fork_generation, __ATOMIC_RELAXED);
}

static inline int64_t
fast_now(GeneratorState *s)
{
    return fast_try(s, SPIN_NS);
}

/* -1 with RuntimeError set if the state is a fork's inherited copy. */
static int
refuse_stale(GeneratorState *s)
{
    if (stale(s)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this generator state was inherited across a fork: its parent goes on "
                        "issuing from it, and its mutex may be held by a thread the child does "
                        "not have; make a new generator in the child");
        return -1;
    }
    return 0;
}

static inline int
held_by_this_thread(GeneratorState *s)
{
    return __atomic_load_n(&s->py_owner, __ATOMIC_RELAXED) == (unsigned long)pthread_self();
}

/* Take the mutex from Python: at once if free, else with the GIL released. -1 with
 * RuntimeError set if this thread holds it already (it would wait for itself). */
static int
lock_from_python(GeneratorState *s)
{
    if (refuse_stale(s) < 0) {
        return -1;
    }
    if (held_by_this_thread(s)) {
        PyErr_SetString(PyExc_RuntimeError, "this thread holds the generator state already");
        return -1;
    }
    int err = pthread_mutex_trylock(&s->mutex);
    if (err == EBUSY) {
        Py_BEGIN_ALLOW_THREADS
        err = pthread_mutex_lock(&s->mutex);
        Py_END_ALLOW_THREADS
    }
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_RuntimeError);
        return -1;
    }
    return 0;
}

/* -- the type ---------------------------------------------------------------------- */

static int
GeneratorState_init(GeneratorState *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"epoch_ms", "timestamp_shift", "max_sequence", "zero_start", NULL};
    long long epoch, shift, max_sequence;
    int zero_start;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LLLp", kwlist, &epoch, &shift,
                                     &max_sequence, &zero_start)) {
        return -1;
    }
    if (epoch < 0 || shift < 0 || shift > 62 || max_sequence < 0 ||
        max_sequence >= ((long long)1 << 62)) {
        PyErr_SetString(PyExc_ValueError, "layout constants out of range");
        return -1;
    }
    self->epoch = epoch;
    self->ts_shift = shift;
    self->max_sequence = max_sequence;
    self->zero_start = zero_start;
    /* As a new IdGenerator: nothing issued, no ms open, no ceiling, the gate closed. */
    self->last_ts = -1;
    self->sequence = max_sequence;
    self->base = 0;
    self->first_sequence = max_sequence + 1;
    self->ids_before_this_ms = 0;
    self->ceiling = -1;
    self->node = 0;
    self->sealed = 0;
    self->gate_open = 0;
    self->gate_until = -INFINITY;
    __atomic_store_n(&self->long_hold, 0, __ATOMIC_RELEASE);
    return 0;
}

static PyObject *
GeneratorState_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds;
    GeneratorState *self = (GeneratorState *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    /* A plain mutex (the fast path's): Python's misuse is caught by py_owner instead. */
    int err = pthread_mutex_init(&self->mutex, NULL);
    if (err != 0) {
        Py_DECREF(self);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->gate_until = -INFINITY;
    self->generation = __atomic_load_n(&fork_generation, __ATOMIC_RELAXED);
    return (PyObject *)self;
}

static void
GeneratorState_dealloc(GeneratorState *self)
{
    /* A fork's copy may be locked by a thread the child does not have: left as it is. */
    if (!stale(self)) {
        pthread_mutex_destroy(&self->mutex);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* -- the lock, as threading.Lock's surface ------------------------------------------ */

static PyObject *
GeneratorState_acquire(GeneratorState *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd", kwlist, &blocking, &timeout)) {
        return NULL;
    }
    if (refuse_stale(self) < 0) {
        return NULL;
    }
    if (held_by_this_thread(self)) {
        if (!blocking) {
            Py_RETURN_FALSE;
        }
        PyErr_SetString(PyExc_RuntimeError, "this thread holds the generator state already");
        return NULL;
    }
    int err = pthread_mutex_trylock(&self->mutex);
    if (err == EBUSY && blocking) {
        if (timeout < 0) {
            Py_BEGIN_ALLOW_THREADS
            err = pthread_mutex_lock(&self->mutex);
            Py_END_ALLOW_THREADS
        } else {
            /* Monotonic, so that a wall clock stepped meanwhile does not stretch the wait.
             * gcc 12's ThreadSanitizer does not intercept pthread_mutex_clocklock (only
             * timedlock), so it would not see this lock taken and report false races: its
             * builds wait on the wall clock instead (tests only; the same lock). */
#if defined(__SANITIZE_THREAD__)
#define SF_LOCK_CLOCK CLOCK_REALTIME
#else
#define SF_LOCK_CLOCK CLOCK_MONOTONIC
#endif
            struct timespec until;
            clock_gettime(SF_LOCK_CLOCK, &until);
            double whole = floor(timeout);
            until.tv_sec += (time_t)whole;
            until.tv_nsec += (long)((timeout - whole) * 1e9);
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec += 1;
                until.tv_nsec -= 1000000000L;
            }
            Py_BEGIN_ALLOW_THREADS
#if defined(__SANITIZE_THREAD__)
            err = pthread_mutex_timedlock(&self->mutex, &until);
#else
            err = pthread_mutex_clocklock(&self->mutex, CLOCK_MONOTONIC, &until);
#endif
            Py_END_ALLOW_THREADS
        }
    }
    if (err == 0) {
        __atomic_store_n(&self->py_owner, (unsigned long)pthread_self(), __ATOMIC_RELAXED);
        Py_RETURN_TRUE;
    }
    if (err == EBUSY || err == ETIMEDOUT) {
        Py_RETURN_FALSE;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_RuntimeError);
}

static PyObject *
GeneratorState_release(GeneratorState *self, PyObject *Py_UNUSED(ignored))
{
    if (refuse_stale(self) < 0) {
        return NULL;
    }
    if (!held_by_this_thread(self)) {
        PyErr_SetString(PyExc_RuntimeError, "release of a generator state this thread does not hold");
        return NULL;
    }
    __atomic_store_n(&self->py_owner, 0UL, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&self->mutex);
    Py_RETURN_NONE;
}

static PyObject *
GeneratorState_enter(GeneratorState *self, PyObject *Py_UNUSED(ignored))
{
    if (lock_from_python(self) < 0) {
        return NULL;
    }
    __atomic_store_n(&self->py_owner, (unsigned long)pthread_self(), __ATOMIC_RELAXED);
    Py_RETURN_TRUE;
}

static PyObject *
GeneratorState_exit(GeneratorState *self, PyObject *args)
{
    (void)args;
    return GeneratorState_release(self, NULL);
}

/* -- the fast call, the gate -------------------------------------------------------- */

static PyObject *
id_or_none(int64_t id)
{
    if (id == SLOW) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(id);
}

static PyObject *
GeneratorState_next_id(GeneratorState *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "next_id(now_ms, boot_now) takes 2 arguments");
        return NULL;
    }
    long long now = PyLong_AsLongLong(args[0]);
    if (now == -1 && PyErr_Occurred()) {
        return NULL;
    }
    double boot = PyFloat_AsDouble(args[1]);
    if (boot == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (lock_from_python(self) < 0) {
        return NULL;
    }
    int64_t id = fast_locked(self, now, boot);
    pthread_mutex_unlock(&self->mutex);
    return id_or_none(id);
}

static PyObject *
GeneratorState_next_id_now(GeneratorState *self, PyObject *Py_UNUSED(ignored))
{
    if (lock_from_python(self) < 0) {
        return NULL;
    }
    int64_t id = fast_locked(self, wall_ms(), boot_s());
    pthread_mutex_unlock(&self->mutex);
    return id_or_none(id);
}

/* fast_call(spin_s=SPIN_NS): the native threads' call (fast_now) with the GIL released,
 * trying a held mutex for spin_s (tests pass a long one to see a call give up for
 * long_hold, not for time). Returns the id, SLOW or CONTENDED. */
static PyObject *
GeneratorState_fast_call(GeneratorState *self, PyObject *args)
{
    double spin_s = SPIN_NS * 1e-9;
    if (!PyArg_ParseTuple(args, "|d", &spin_s)) {
        return NULL;
    }
    if (!(spin_s >= 0)) {
        PyErr_SetString(PyExc_ValueError, "spin_s must be at least 0");
        return NULL;
    }
    /* About three years at most: no overflow of the deadline. */
    int64_t spin_ns = spin_s > 1e17 * 1e-9 ? (int64_t)1e17 : (int64_t)(spin_s * 1e9);
    /* A fork's copy is SLOW, whoever held it when the fork was made. */
    if (!stale(self) && held_by_this_thread(self)) {
        PyErr_SetString(PyExc_RuntimeError, "this thread holds the generator state already");
        return NULL;
    }
    int64_t id;
    Py_BEGIN_ALLOW_THREADS
    id = fast_try(self, spin_ns);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(id);
}

/* set_gate and close from a Python thread that holds the mutex already write in place: a
 * clock-sequence switch writes its marks with the state held, and a write ZooKeeper refuses
 * closes the session gate from inside it. */
static PyObject *
GeneratorState_set_gate(GeneratorState *self, PyObject *arg)
{
    double until = PyFloat_AsDouble(arg);
    if (until == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (isnan(until)) {
        PyErr_SetString(PyExc_ValueError, "the gate's deadline is NaN");
        return NULL;
    }
    if (refuse_stale(self) < 0) {
        return NULL;
    }
    int held = held_by_this_thread(self);
    if (!held && lock_from_python(self) < 0) {
        return NULL;
    }
    self->gate_open = 1;
    self->gate_until = until;
    if (!held) {
        pthread_mutex_unlock(&self->mutex);
    }
    Py_RETURN_NONE;
}

static PyObject *
GeneratorState_close(GeneratorState *self, PyObject *Py_UNUSED(ignored))
{
    if (refuse_stale(self) < 0) {
        return NULL;
    }
    int held = held_by_this_thread(self);
    if (!held && lock_from_python(self) < 0) {
        return NULL;
    }
    self->gate_open = 0;
    self->gate_until = -INFINITY;
    if (!held) {
        pthread_mutex_unlock(&self->mutex);
    }
    Py_RETURN_NONE;
}

/* Whether the calling Python thread holds the mutex (through acquire()). */
static PyObject *
GeneratorState_held(GeneratorState *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(held_by_this_thread(self));
}

/* The concurrent tests' native thread: `n` fast calls on the real clocks with the GIL
 * released; a SLOW or CONTENDED one lets go of the mutex, takes the GIL and calls slow(), whose int is
 * taken as the call's id (None: stop). Returns (ids in order, how many came from slow()). */
static PyObject *
GeneratorState_spin(GeneratorState *self, PyObject *args)
{
    Py_ssize_t n;
    PyObject *slow;
    if (!PyArg_ParseTuple(args, "nO", &n, &slow)) {
        return NULL;
    }
    if (n < 0 || (size_t)n > PY_SSIZE_T_MAX / sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "n out of range");
        return NULL;
    }
    int64_t *ids = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (ids == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t got = 0, slow_calls = 0;
    int failed = 0;
    while (got < n) {
        int64_t id;
        Py_BEGIN_ALLOW_THREADS
        while (got < n && (id = fast_now(self)) >= 0) {
            ids[got++] = id;
        }
        Py_END_ALLOW_THREADS
        if (got == n) {
            break;
        }
        PyObject *result = PyObject_CallNoArgs(slow);
        if (result == NULL) {
            failed = 1;
            break;
        }
        if (result == Py_None) {
            Py_DECREF(result);
            break;
        }
        long long value = PyLong_AsLongLong(result);
        Py_DECREF(result);
        if (value == -1 && PyErr_Occurred()) {
            failed = 1;
            break;
        }
        ids[got++] = value;
        slow_calls += 1;
    }
    PyObject *list = failed ? NULL : PyList_New(got);
    for (Py_ssize_t i = 0; list != NULL && i < got; i++) {
        PyObject *item = PyLong_FromLongLong(ids[i]);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, item);
    }
    PyMem_RawFree(ids);
    if (list == NULL) {
        return NULL;
    }
    return Py_BuildValue("(Nn)", list, slow_calls);
}

/* -- the fields, for Python's slow path (which holds the mutex while it uses them) ---- */

#define INT64_FIELD(name)                                                                  \
    static PyObject *get_##name(GeneratorState *self, void *closure)                      \
    {                                                                                      \
        (void)closure;                                                                     \
        return PyLong_FromLongLong(self->name);                                            \
    }                                                                                      \
    static int set_##name(GeneratorState *self, PyObject *value, void *closure)           \
    {                                                                                      \
        (void)closure;                                                                     \
        if (value == NULL) {                                                               \
            PyErr_SetString(PyExc_AttributeError, "cannot delete " #name);                 \
            return -1;                                                                     \
        }                                                                                  \
        long long v = PyLong_AsLongLong(value);                                            \
        if (v == -1 && PyErr_Occurred()) {                                                 \
            return -1;                                                                     \
        }                                                                                  \
        self->name = v;                                                                    \
        return 0;                                                                          \
    }

INT64_FIELD(last_ts)
INT64_FIELD(sequence)
INT64_FIELD(base)
INT64_FIELD(first_sequence)
INT64_FIELD(ids_before_this_ms)
INT64_FIELD(ceiling)
INT64_FIELD(node)

static PyObject *
get_sealed(GeneratorState *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->sealed);
}

static int
set_sealed(GeneratorState *self, PyObject *value, void *closure)
{
    (void)closure;
    int truth = value == NULL ? -1 : PyObject_IsTrue(value);
    if (truth < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_AttributeError, "cannot delete sealed");
        }
        return -1;
    }
    self->sealed = truth;
    return 0;
}

static PyObject *
get_long_hold(GeneratorState *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(long_held(self));
}

/* Written by the holder of the mutex (Python's slow path) around a long wait. */
static int
set_long_hold(GeneratorState *self, PyObject *value, void *closure)
{
    (void)closure;
    int truth = value == NULL ? -1 : PyObject_IsTrue(value);
    if (truth < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_AttributeError, "cannot delete long_hold");
        }
        return -1;
    }
    __atomic_store_n(&self->long_hold, truth, __ATOMIC_RELEASE);
    return 0;
}

static PyObject *
get_spinning(GeneratorState *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(__atomic_load_n(&self->spinning, __ATOMIC_RELAXED));
}

static PyObject *
get_forked(GeneratorState *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(stale(self));
}

static PyObject *
get_gate_open(GeneratorState *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->gate_open);
}

static PyObject *
get_gate_until(GeneratorState *self, void *closure)
{
    (void)closure;
    return PyFloat_FromDouble(self->gate_until);
}

#define INT64_CONSTANT(name)                                                               \
    static PyObject *get_##name(GeneratorState *self, void *closure)                      \
    {                                                                                      \
        (void)closure;                                                                     \
        return PyLong_FromLongLong(self->name);                                            \
    }

INT64_CONSTANT(epoch)
INT64_CONSTANT(ts_shift)
INT64_CONSTANT(max_sequence)

static PyObject *
get_zero_start(GeneratorState *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->zero_start);
}

#define RW(name) {#name, (getter)get_##name, (setter)set_##name, NULL, NULL}
#define RO(name) {#name, (getter)get_##name, NULL, NULL, NULL}

static PyGetSetDef GeneratorState_getset[] = {
    RW(last_ts), RW(sequence), RW(base), RW(first_sequence), RW(ids_before_this_ms),
    RW(ceiling), RW(node), RW(sealed), RW(long_hold), RO(spinning), RO(forked), RO(gate_open), RO(gate_until), RO(epoch),
    RO(ts_shift), RO(max_sequence), RO(zero_start), {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef GeneratorState_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))GeneratorState_acquire,
     METH_VARARGS | METH_KEYWORDS, "Take the mutex (threading.Lock.acquire's arguments)."},
    {"release", (PyCFunction)GeneratorState_release, METH_NOARGS, "Let go of the mutex."},
    {"__enter__", (PyCFunction)GeneratorState_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)GeneratorState_exit, METH_VARARGS, NULL},
    {"next_id", (PyCFunction)(void (*)(void))GeneratorState_next_id, METH_FASTCALL,
     "next_id(now_ms, boot_now): the fast call on the given clock readings; None: SLOW."},
    {"next_id_now", (PyCFunction)GeneratorState_next_id_now, METH_NOARGS,
     "The fast call on the real clocks (read under the mutex); None: SLOW."},
    {"fast_call", (PyCFunction)GeneratorState_fast_call, METH_VARARGS,
     "fast_call(spin_s=20e-6): the native threads' fast call, GIL released: the id, SLOW "
     "or CONTENDED."},
    {"set_gate", (PyCFunction)GeneratorState_set_gate, METH_O,
     "Open the gate until this boot-clock second (CLOCK_BOOTTIME)."},
    {"close", (PyCFunction)GeneratorState_close, METH_NOARGS,
     "Close the gate: every fast call is SLOW until set_gate."},
    {"held", (PyCFunction)GeneratorState_held, METH_NOARGS,
     "Whether the calling thread holds the mutex (set_gate and close then write in place)."},
    {"spin", (PyCFunction)GeneratorState_spin, METH_VARARGS,
     "spin(n, slow): n fast calls without the GIL, slow() for each SLOW or CONTENDED one (tests)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GeneratorStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "snowflake_server._native._core.GeneratorState",
    .tp_basicsize = sizeof(GeneratorState),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One worker's generator state under one mutex: the fast path's fields, the "
              "session gate's deadline and open flag.",
    .tp_new = GeneratorState_new,
    .tp_init = (initproc)GeneratorState_init,
    .tp_dealloc = (destructor)GeneratorState_dealloc,
    .tp_methods = GeneratorState_methods,
    .tp_getset = GeneratorState_getset,
};

int
sf_is_generator_state(PyObject *o)
{
    return PyObject_TypeCheck(o, &GeneratorStateType);
}

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "snowflake_server._native._core",
    .m_doc = "The native generator state (see snowflake_server/_native/__init__.py).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    if (PyType_Ready(&GeneratorStateType) < 0) {
        return NULL;
    }
    static int atfork_registered;
    if (!atfork_registered) {
        int err = pthread_atfork(NULL, NULL, after_fork_in_child);
        if (err != 0) {
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        atfork_registered = 1;
    }
    PyObject *module = PyModule_Create(&core_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "GeneratorState", (PyObject *)&GeneratorStateType) < 0 ||
        PyModule_AddIntConstant(module, "SLOW", -1) < 0 ||
        PyModule_AddIntConstant(module, "CONTENDED", -2) < 0 ||
        PyModule_AddIntConstant(module, "SPIN_NS", SPIN_NS) < 0 || sf_listener_init(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
