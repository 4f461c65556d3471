/* The Python surface of the native listener's pure-C parts (_listener.h): the get_id
 * parser and reply, the agent registry, per-thread counters and the audit budget, added
 * to the _core module by sf_listener_init. Nothing in the server imports them yet (issue
 * 27, slice 2, step 1): tests prove them, and the listener (step 3+) calls the C functions.
 *
 * The parser's wrappers copy their input into a buffer of exactly its size first, so that
 * under AddressSanitizer a read past the end is an error (a bytes object has a spare NUL
 * and lives inside a larger arena). The *_spin helpers run C loops without the GIL, so
 * tests can run them from several threads at once (and TSan can watch).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_conn.h"
#include "_listener.h"
#include "_state.h"

int sf_listener_init(PyObject *module);

/* A limit from any Python int: past int64 clamps (no frame is that long anyway). */
static int
limit_arg(PyObject *o, int64_t *out)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = overflow > 0 ? INT64_MAX : overflow < 0 ? INT64_MIN : (int64_t)v;
    return 0;
}

static uint8_t *
exact_copy(const Py_buffer *b)
{
    uint8_t *p = malloc(b->len ? (size_t)b->len : 1);
    if (p == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (b->len) {
        memcpy(p, b->buf, (size_t)b->len);
    }
    return p;
}

static PyObject *
py_match_get_id(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "match_get_id(frame, limit)");
        return NULL;
    }
    int64_t limit;
    if (limit_arg(args[1], &limit) < 0) {
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint8_t *p = exact_copy(&b);
    PyObject *result = NULL;
    if (p != NULL) {
        sf_frame m;
        if (sf_match_get_id(p, (size_t)b.len, limit, &m)) {
            result = Py_BuildValue("(y#y#)", (const char *)m.seqid, (Py_ssize_t)4,
                                   (const char *)p + m.agent_at, (Py_ssize_t)m.agent_len);
        } else {
            result = Py_NewRef(Py_None);
        }
        free(p);
    }
    PyBuffer_Release(&b);
    return result;
}

static PyObject *
py_scan_prefix(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "scan_prefix(buffer, limit)");
        return NULL;
    }
    int64_t limit;
    if (limit_arg(args[1], &limit) < 0) {
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint8_t *p = exact_copy(&b);
    PyObject *result = NULL;
    if (p != NULL) {
        sf_frame m;
        memset(&m, 0, sizeof m);
        sf_scan_result r = sf_scan_prefix(p, (size_t)b.len, limit, &m);
        if (r == SF_MATCH) {
            result = Py_BuildValue("(iiIy#II)", (int)r, (int)m.why, m.frame_len,
                                   (const char *)m.seqid, (Py_ssize_t)4, m.agent_at, m.agent_len);
        } else {
            result = Py_BuildValue("(iiIOII)", (int)r, (int)(r == SF_HANDOVER ? m.why : 0), 0u,
                                   Py_None, 0u, 0u);
        }
        free(p);
    }
    PyBuffer_Release(&b);
    return result;
}

static PyObject *
py_get_id_reply(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get_id_reply(seqid, id)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (b.len != 4) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "seqid must be 4 bytes");
        return NULL;
    }
    uint8_t seqid[4];
    memcpy(seqid, b.buf, 4);
    PyBuffer_Release(&b);
    long long id = PyLong_AsLongLong(args[1]);
    if (id == -1 && PyErr_Occurred()) {
        return NULL;
    }
    uint8_t out[SF_REPLY_LEN];
    sf_get_id_reply(out, seqid, (int64_t)id);
    return PyBytes_FromStringAndSize((const char *)out, SF_REPLY_LEN);
}

/* ---- AgentRegistry ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    sf_registry *r; /* separate allocation: 64 KiB of slots */
} AgentRegistry;

static PyObject *
AgentRegistry_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "AgentRegistry() takes no arguments");
        return NULL;
    }
    AgentRegistry *self = (AgentRegistry *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->r = malloc(sizeof(sf_registry));
    if (self->r == NULL || sf_registry_init(self->r) != 0) {
        free(self->r);
        self->r = NULL;
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void
AgentRegistry_dealloc(AgentRegistry *self)
{
    /* No reader is left: a lookup_spin holds a reference for as long as it runs. */
    if (self->r != NULL) {
        sf_registry_free(self->r);
        free(self->r);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
AgentRegistry_add(AgentRegistry *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add(agent, label_index)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    long label = PyLong_AsLong(args[1]);
    if (label == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&b);
        return NULL;
    }
    if (label < 0 || label > INT32_MAX) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "label_index must be in [0, 2**31)");
        return NULL;
    }
    int r = sf_registry_add(self->r, b.buf, (size_t)b.len, (int32_t)label);
    PyBuffer_Release(&b);
    switch (r) {
    case SF_ADD_TOO_LONG:
        PyErr_Format(PyExc_ValueError, "an agent of %zd bytes: native serves at most %d", b.len,
                     SF_AGENT_MAX_LEN);
        return NULL;
    case SF_ADD_RELABEL:
        PyErr_SetString(PyExc_ValueError, "agent already registered under another label");
        return NULL;
    case SF_ADD_NO_MEMORY:
        return PyErr_NoMemory();
    default:
        return PyLong_FromLong(r); /* SF_ADD_FULL is -1 */
    }
}

static PyObject *
AgentRegistry_lookup(AgentRegistry *self, PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const sf_agent *e = sf_registry_lookup(self->r, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromLong(e == NULL ? -1 : (long)e->index);
}

static PyObject *
AgentRegistry_label(AgentRegistry *self, PyObject *arg)
{
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    long result = -1;
    pthread_mutex_lock(&self->r->write_mutex);
    if (i >= 0 && (uint32_t)i < atomic_load_explicit(&self->r->count, memory_order_relaxed)) {
        result = self->r->by_index[i]->label;
    }
    pthread_mutex_unlock(&self->r->write_mutex);
    if (result < 0) {
        PyErr_SetString(PyExc_IndexError, "no agent registered at that index");
        return NULL;
    }
    return PyLong_FromLong(result);
}

static PyObject *
AgentRegistry_agent(AgentRegistry *self, PyObject *arg)
{
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const sf_agent *e = NULL;
    pthread_mutex_lock(&self->r->write_mutex);
    if (i >= 0 && (uint32_t)i < atomic_load_explicit(&self->r->count, memory_order_relaxed)) {
        e = self->r->by_index[i]; /* immutable until the registry is freed */
    }
    pthread_mutex_unlock(&self->r->write_mutex);
    if (e == NULL) {
        PyErr_SetString(PyExc_IndexError, "no agent registered at that index");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)e->bytes, (Py_ssize_t)e->len);
}

static Py_ssize_t
AgentRegistry_len(AgentRegistry *self)
{
    return (Py_ssize_t)atomic_load_explicit(&self->r->count, memory_order_acquire);
}

/* lookup_spin(agents, rounds): every agent looked up `rounds` times without the GIL.
 * Returns (hits per agent, violations): a violation is a hit after which the same agent
 * missed, or came back with another index or label, or bytes not the agent's. */
static PyObject *
AgentRegistry_lookup_spin(AgentRegistry *self, PyObject *args)
{
    PyObject *list;
    Py_ssize_t rounds;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &list, &rounds)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    uint8_t **agents = calloc((size_t)n + 1, sizeof *agents);
    size_t *lens = calloc((size_t)n + 1, sizeof *lens);
    long *hits = calloc((size_t)n + 1, sizeof *hits);
    long *index = calloc((size_t)n + 1, sizeof *index);
    long *label = calloc((size_t)n + 1, sizeof *label);
    PyObject *result = NULL;
    if (!agents || !lens || !hits || !index || !label) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyList_GET_ITEM(list, i);
        if (!PyBytes_Check(a)) {
            PyErr_SetString(PyExc_TypeError, "agents must be bytes");
            goto done;
        }
        lens[i] = (size_t)PyBytes_GET_SIZE(a);
        agents[i] = malloc(lens[i] ? lens[i] : 1);
        if (agents[i] == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(agents[i], PyBytes_AS_STRING(a), lens[i]);
        index[i] = -1;
    }
    long violations = 0;
    Py_INCREF(self);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < rounds; k++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            const sf_agent *e = sf_registry_lookup(self->r, agents[i], lens[i]);
            if (e == NULL) {
                violations += index[i] >= 0;
                continue;
            }
            if ((index[i] >= 0 && (index[i] != (long)e->index || label[i] != e->label)) ||
                e->len != lens[i] || memcmp(e->bytes, agents[i], lens[i]) != 0) {
                violations++;
            }
            index[i] = (long)e->index;
            label[i] = e->label;
            hits[i]++;
        }
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(self);
    PyObject *counts = PyList_New(n);
    if (counts == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(hits[i]);
        if (v == NULL) {
            Py_DECREF(counts);
            goto done;
        }
        PyList_SET_ITEM(counts, i, v);
    }
    result = Py_BuildValue("(Nl)", counts, violations);
done:
    if (agents) {
        for (Py_ssize_t i = 0; i < n; i++) {
            free(agents[i]);
        }
    }
    free(agents);
    free(lens);
    free(hits);
    free(index);
    free(label);
    return result;
}

static PyMethodDef AgentRegistry_methods[] = {
    {"add", (PyCFunction)(void (*)(void))AgentRegistry_add, METH_FASTCALL,
     "add(agent, label_index): register an agent Python validated; its index, or -1 if full."},
    {"lookup", (PyCFunction)AgentRegistry_lookup, METH_O,
     "lookup(agent): its index, or -1 (not registered: Python serves it)."},
    {"label", (PyCFunction)AgentRegistry_label, METH_O,
     "label(index): the label index the agent at index was registered under."},
    {"agent", (PyCFunction)AgentRegistry_agent, METH_O,
     "agent(index): the agent's bytes registered at index (the audit trail names it)."},
    {"lookup_spin", (PyCFunction)AgentRegistry_lookup_spin, METH_VARARGS,
     "lookup_spin(agents, rounds): lookups without the GIL (tests)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods AgentRegistry_as_sequence = {
    .sq_length = (lenfunc)AgentRegistry_len,
};

static PyTypeObject AgentRegistryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "snowflake_server._native._core.AgentRegistry",
    .tp_basicsize = sizeof(AgentRegistry),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The agents native may serve: registered by Python once validated and labelled; "
              "bounded, append-only, lock-free lookups.",
    .tp_new = AgentRegistry_new,
    .tp_dealloc = (destructor)AgentRegistry_dealloc,
    .tp_methods = AgentRegistry_methods,
    .tp_as_sequence = &AgentRegistry_as_sequence,
};

/* ---- NativeStats --------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int threads;
    sf_thread_stats *t;
} NativeStats;

static PyObject *
NativeStats_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"threads", NULL};
    int threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &threads)) {
        return NULL;
    }
    if (threads < 1 || threads > 1024) {
        PyErr_SetString(PyExc_ValueError, "threads must be in [1, 1024]");
        return NULL;
    }
    NativeStats *self = (NativeStats *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, sizeof(sf_thread_stats) * (size_t)threads) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    memset(p, 0, sizeof(sf_thread_stats) * (size_t)threads);
    self->t = p;
    self->threads = threads;
    return (PyObject *)self;
}

static void
NativeStats_dealloc(NativeStats *self)
{
    free(self->t);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static sf_thread_stats *
stats_thread(NativeStats *self, PyObject *o)
{
    long i = PyLong_AsLong(o);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (i < 0 || i >= self->threads) {
        PyErr_SetString(PyExc_IndexError, "no such native thread");
        return NULL;
    }
    return &self->t[i];
}

static int
unsigned_arg(PyObject *o, uint64_t *out, uint64_t below)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (v >= below) {
        PyErr_SetString(PyExc_ValueError, "out of range");
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *
NativeStats_record_call(NativeStats *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t agent, ns;
    sf_thread_stats *t;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "record_call(thread, agent_index, latency_ns)");
        return NULL;
    }
    if ((t = stats_thread(self, args[0])) == NULL || unsigned_arg(args[1], &agent, SF_AGENTS_MAX) < 0 ||
        unsigned_arg(args[2], &ns, UINT64_MAX) < 0) {
        return NULL;
    }
    sf_stats_call(t, (uint32_t)agent, ns);
    Py_RETURN_NONE;
}

static PyObject *
NativeStats_record_handoff(NativeStats *self, PyObject *const *args, Py_ssize_t nargs)
{
    sf_thread_stats *t;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "record_handoff(thread, reason)");
        return NULL;
    }
    if ((t = stats_thread(self, args[0])) == NULL) {
        return NULL;
    }
    for (int i = 0; i < SF_HANDOFFS; i++) {
        if (PyUnicode_Check(args[1]) && PyUnicode_CompareWithASCIIString(args[1], SF_HANDOFF_NAMES[i]) == 0) {
            sf_stats_handoff(t, (sf_handoff)i);
            Py_RETURN_NONE;
        }
    }
    PyErr_SetString(PyExc_ValueError, "unknown handoff reason");
    return NULL;
}

static PyObject *
NativeStats_record_internal_error(NativeStats *self, PyObject *arg)
{
    sf_thread_stats *t = stats_thread(self, arg);
    if (t == NULL) {
        return NULL;
    }
    sf_stats_internal_error(t);
    Py_RETURN_NONE;
}

/* spin(thread, n, agent_index, latency_ns): n calls recorded without the GIL (tests). */
static PyObject *
NativeStats_spin(NativeStats *self, PyObject *args)
{
    int thread;
    Py_ssize_t n;
    unsigned int agent;
    unsigned long long ns;
    if (!PyArg_ParseTuple(args, "inIK", &thread, &n, &agent, &ns)) {
        return NULL;
    }
    if (thread < 0 || thread >= self->threads || agent >= SF_AGENTS_MAX) {
        PyErr_SetString(PyExc_ValueError, "no such thread or agent index");
        return NULL;
    }
    sf_thread_stats *t = &self->t[thread];
    Py_INCREF(self);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        sf_stats_call(t, agent, ns);
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(self);
    Py_RETURN_NONE;
}

static int
dict_add(PyObject *d, long key, uint64_t n)
{
    PyObject *k = PyLong_FromLong(key);
    if (k == NULL) {
        return -1;
    }
    PyObject *old = PyDict_GetItemWithError(d, k);
    if (old == NULL && PyErr_Occurred()) {
        Py_DECREF(k);
        return -1;
    }
    unsigned long long prev = old ? PyLong_AsUnsignedLongLong(old) : 0;
    PyObject *v = PyLong_FromUnsignedLongLong(prev + n);
    int r = v == NULL ? -1 : PyDict_SetItem(d, k, v);
    Py_XDECREF(v);
    Py_DECREF(k);
    return r;
}

/* snapshot(registry=None): every thread's counters summed, read with relaxed loads. */
static PyObject *
NativeStats_snapshot(NativeStats *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"registry", NULL};
    PyObject *reg = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &reg)) {
        return NULL;
    }
    if (reg != Py_None && !PyObject_TypeCheck(reg, &AgentRegistryType)) {
        PyErr_SetString(PyExc_TypeError, "registry must be an AgentRegistry or None");
        return NULL;
    }
    uint64_t calls = 0, errors = 0, sum = 0, buckets[SF_BUCKETS + 1] = {0},
             handoffs[SF_HANDOFFS] = {0};
    uint64_t *ids = calloc(SF_AGENTS_MAX, sizeof *ids);
    if (ids == NULL) {
        return PyErr_NoMemory();
    }
    for (int k = 0; k < self->threads; k++) {
        sf_thread_stats *t = &self->t[k];
        calls += sf_read(&t->calls);
        errors += sf_read(&t->internal_errors);
        sum += sf_read(&t->latency_sum_ns);
        for (int i = 0; i <= SF_BUCKETS; i++) {
            buckets[i] += sf_read(&t->latency[i]);
        }
        for (int i = 0; i < SF_HANDOFFS; i++) {
            handoffs[i] += sf_read(&t->handoffs[i]);
        }
        for (int i = 0; i < SF_AGENTS_MAX; i++) {
            ids[i] += sf_read(&t->ids[i]);
        }
    }
    PyObject *result = NULL, *id_map = PyDict_New(), *lat = PyList_New(SF_BUCKETS + 1),
             *hand = PyDict_New();
    if (id_map == NULL || lat == NULL || hand == NULL) {
        goto done;
    }
    sf_registry *r = reg == Py_None ? NULL : ((AgentRegistry *)reg)->r;
    if (r != NULL) {
        pthread_mutex_lock(&r->write_mutex);
    }
    int failed = 0;
    uint32_t known = r ? atomic_load_explicit(&r->count, memory_order_relaxed) : 0;
    for (uint32_t i = 0; i < SF_AGENTS_MAX && !failed; i++) {
        if (ids[i] == 0) {
            continue;
        }
        /* By label where the registry knows the index (agents sharing a label, e.g. the
         * overflow label, sum); by index otherwise (-1 - index: never a label). */
        long key = r == NULL ? (long)i : i < known ? (long)r->by_index[i]->label : -1 - (long)i;
        failed = dict_add(id_map, key, ids[i]) < 0;
    }
    if (r != NULL) {
        pthread_mutex_unlock(&r->write_mutex);
    }
    if (failed) {
        goto done;
    }
    for (int i = 0; i <= SF_BUCKETS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(buckets[i]);
        if (v == NULL) {
            goto done;
        }
        PyList_SET_ITEM(lat, i, v);
    }
    for (int i = 0; i < SF_HANDOFFS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(handoffs[i]);
        if (v == NULL || PyDict_SetItemString(hand, SF_HANDOFF_NAMES[i], v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        Py_DECREF(v);
    }
    result = Py_BuildValue("{sKsKsOsKsOsO}", "calls", (unsigned long long)calls,
                           "internal_errors", (unsigned long long)errors, "latency_counts", lat,
                           "latency_sum_ns", (unsigned long long)sum, "handoffs", hand, "ids",
                           id_map);
done:
    free(ids);
    Py_XDECREF(id_map);
    Py_XDECREF(lat);
    Py_XDECREF(hand);
    return result;
}

static PyObject *
NativeStats_threads(NativeStats *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->threads);
}

static PyGetSetDef NativeStats_getset[] = {
    {"threads", (getter)NativeStats_threads, NULL, "How many per-thread blocks.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef NativeStats_methods[] = {
    {"record_call", (PyCFunction)(void (*)(void))NativeStats_record_call, METH_FASTCALL,
     "record_call(thread, agent_index, latency_ns): one native get_id (tests; C calls "
     "sf_stats_call)."},
    {"record_handoff", (PyCFunction)(void (*)(void))NativeStats_record_handoff, METH_FASTCALL,
     "record_handoff(thread, reason): one frame handed to Python."},
    {"record_internal_error", (PyCFunction)NativeStats_record_internal_error, METH_O,
     "record_internal_error(thread)."},
    {"snapshot", (PyCFunction)(void (*)(void))NativeStats_snapshot, METH_VARARGS | METH_KEYWORDS,
     "snapshot(registry=None): the counters of every thread summed (ids by label index "
     "with a registry, else by registry index)."},
    {"spin", (PyCFunction)NativeStats_spin, METH_VARARGS,
     "spin(thread, n, agent_index, latency_ns): n calls recorded without the GIL (tests)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NativeStatsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "snowflake_server._native._core.NativeStats",
    .tp_basicsize = sizeof(NativeStats),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Per-thread native counters (one writer each), summed by snapshot().",
    .tp_new = NativeStats_new,
    .tp_dealloc = (destructor)NativeStats_dealloc,
    .tp_methods = NativeStats_methods,
    .tp_getset = NativeStats_getset,
};

/* ---- AuditBudget --------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    sf_audit_budget b;
} AuditBudget;

static PyObject *
AuditBudget_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_pending", NULL};
    long long max_pending;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L", kwlist, &max_pending)) {
        return NULL;
    }
    if (max_pending < 0) {
        PyErr_SetString(PyExc_ValueError, "max_pending must be >= 0");
        return NULL;
    }
    AuditBudget *self = (AuditBudget *)type->tp_alloc(type, 0);
    if (self != NULL) {
        sf_audit_init(&self->b, max_pending);
    }
    return (PyObject *)self;
}

static int
count_arg(PyObject *o, int64_t *n)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0) {
        PyErr_SetString(PyExc_ValueError, "a count must be >= 0");
        return -1;
    }
    *n = v;
    return 0;
}

static PyObject *
AuditBudget_reserve(AuditBudget *self, PyObject *arg)
{
    int64_t n;
    if (count_arg(arg, &n) < 0) {
        return NULL;
    }
    return PyBool_FromLong(sf_audit_reserve(&self->b, n));
}

static PyObject *
AuditBudget_release(AuditBudget *self, PyObject *arg)
{
    int64_t n;
    if (count_arg(arg, &n) < 0) {
        return NULL;
    }
    sf_audit_release(&self->b, n);
    Py_RETURN_NONE;
}

static PyObject *
AuditBudget_drop(AuditBudget *self, PyObject *arg)
{
    int64_t n;
    if (count_arg(arg, &n) < 0) {
        return NULL;
    }
    sf_audit_drop(&self->b, n);
    Py_RETURN_NONE;
}

/* spin(n): n reservations of one entry without the GIL, each released at once if taken
 * and `hold` is false; returns how many were taken (tests). */
static PyObject *
AuditBudget_spin(AuditBudget *self, PyObject *args)
{
    Py_ssize_t n;
    int hold;
    if (!PyArg_ParseTuple(args, "np", &n, &hold)) {
        return NULL;
    }
    Py_ssize_t taken = 0;
    Py_INCREF(self);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sf_audit_reserve(&self->b, 1)) {
            taken++;
            if (!hold) {
                sf_audit_release(&self->b, 1);
            }
        }
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(self);
    return PyLong_FromSsize_t(taken);
}

static PyObject *
AuditBudget_get(AuditBudget *self, void *which)
{
    switch ((intptr_t)which) {
    case 0:
        return PyLong_FromLongLong(atomic_load_explicit(&self->b.pending, memory_order_relaxed));
    case 1:
        return PyLong_FromUnsignedLongLong(
            atomic_load_explicit(&self->b.dropped, memory_order_relaxed));
    default:
        return PyLong_FromLongLong(self->b.max_pending);
    }
}

static PyGetSetDef AuditBudget_getset[] = {
    {"pending", (getter)AuditBudget_get, NULL, "Entries reserved and not yet released.",
     (void *)0},
    {"dropped", (getter)AuditBudget_get, NULL, "Entries dropped (budget full or lost).",
     (void *)1},
    {"max_pending", (getter)AuditBudget_get, NULL, "The bound.", (void *)2},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef AuditBudget_methods[] = {
    {"reserve", (PyCFunction)AuditBudget_reserve, METH_O,
     "reserve(n): True if n entries fit under max_pending (reserved), else False and the n "
     "counted as dropped."},
    {"release", (PyCFunction)AuditBudget_release, METH_O,
     "release(n): n reserved entries left memory."},
    {"drop", (PyCFunction)AuditBudget_drop, METH_O,
     "drop(n): n reserved entries were lost (a failed write); release them too."},
    {"spin", (PyCFunction)AuditBudget_spin, METH_VARARGS,
     "spin(n, hold): n one-entry reservations without the GIL (tests)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AuditBudgetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "snowflake_server._native._core.AuditBudget",
    .tp_basicsize = sizeof(AuditBudget),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The audit log's bound on entries in memory, shared by Python and native threads.",
    .tp_new = AuditBudget_new,
    .tp_methods = AuditBudget_methods,
    .tp_getset = AuditBudget_getset,
};

/* ---- Listener: the connection machine (_conn.h) ----------------------------------------- */

typedef struct {
    PyObject_HEAD
    sf_listener *l;
    int threads;         /* 0: step mode */
    int started;
    unsigned long generation; /* sf_fork_generation() when made */
    PyObject *registry, *stats, *budget;
    PyObject *states; /* every GeneratorState ever given: set_state's pointer stays valid */
} Listener;

/* An int argument (PyLong_AsInt is 3.13's): -1 with an error set, else 0. */
static int
int_arg(PyObject *o, int *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "out of an int's range");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int64_t
listener_fast(void *state, int64_t spin_ns, int *gate, int64_t *time_ms)
{
    return sf_fast_try((GeneratorState *)state, spin_ns, gate, time_ms);
}

/* -1 with RuntimeError set in a fork's child or on a listener not made. */
static int
listener_usable(Listener *self)
{
    if (self->l == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the listener was not made");
        return -1;
    }
    if (self->generation != sf_fork_generation()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this native listener was inherited across a fork: its threads and "
                        "connections are the parent's; make a new one in the child");
        return -1;
    }
    return 0;
}

static int
size_arg(PyObject *o, const char *name, size_t *out)
{
    if (o == NULL) {
        return 0;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0", name);
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

static PyObject *
Listener_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"threads", "registry", "stats", "limit", "budget", "high",
                             "low", "forward_high", "max_conns", NULL};
    int threads;
    PyObject *registry, *stats, *limit_o, *budget = Py_None;
    PyObject *high_o = NULL, *low_o = NULL, *fwd_o = NULL;
    long long max_conns = 65536;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO!O!O|$OOOOL", kwlist, &threads,
                                     &AgentRegistryType, &registry, &NativeStatsType, &stats,
                                     &limit_o, &budget, &high_o, &low_o, &fwd_o, &max_conns)) {
        return NULL;
    }
    int64_t limit;
    size_t high = 65536, low = 16384, fwd = 65536;
    if (limit_arg(limit_o, &limit) < 0 || size_arg(high_o, "high", &high) < 0 ||
        size_arg(low_o, "low", &low) < 0 || size_arg(fwd_o, "forward_high", &fwd) < 0) {
        return NULL;
    }
    if (threads < 0 || threads > 1024) {
        PyErr_SetString(PyExc_ValueError, "threads must be in [0, 1024]");
        return NULL;
    }
    if (((NativeStats *)stats)->threads < (threads ? threads : 1)) {
        PyErr_SetString(PyExc_ValueError, "stats has fewer threads than the listener");
        return NULL;
    }
    if (low > high) {
        PyErr_SetString(PyExc_ValueError, "low must be at most high");
        return NULL;
    }
    if (max_conns < 1 || max_conns > (1LL << 24)) {
        PyErr_SetString(PyExc_ValueError, "max_conns must be in [1, 2**24]");
        return NULL;
    }
    if (budget != Py_None && !PyObject_TypeCheck(budget, &AuditBudgetType)) {
        PyErr_SetString(PyExc_TypeError, "budget must be an AuditBudget or None");
        return NULL;
    }
    Listener *self = (Listener *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->states = PyList_New(0);
    if (self->states == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    sf_listener *l = sf_listener_new(threads, (uint32_t)max_conns, ((NativeStats *)stats)->t);
    if (l == NULL) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    l->fast = listener_fast;
    l->registry = ((AgentRegistry *)registry)->r;
    l->budget = budget == Py_None ? NULL : &((AuditBudget *)budget)->b;
    l->limit = limit;
    l->high = high;
    l->low = low;
    l->forward_high = fwd;
    atomic_init(&l->state, NULL);
    self->l = l;
    self->threads = threads;
    self->generation = sf_fork_generation();
    self->registry = Py_NewRef(registry);
    self->stats = Py_NewRef(stats);
    self->budget = Py_NewRef(budget);
    return (PyObject *)self;
}

/* Stops and joins with the GIL released: 1 if every thread joined by timeout_s. */
static int
listener_stop(Listener *self, double timeout_s)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    double whole = floor(timeout_s);
    deadline.tv_sec += (time_t)whole;
    deadline.tv_nsec += (long)((timeout_s - whole) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1000000000L;
    }
    int joined;
    sf_listener *l = self->l;
    Py_BEGIN_ALLOW_THREADS
    joined = sf_stop(l, &deadline);
    Py_END_ALLOW_THREADS
    return joined;
}

static void
Listener_dealloc(Listener *self)
{
    if (self->l != NULL && self->generation == sf_fork_generation()) {
        /* A thread still running over the listener keeps it (and its references). */
        if (listener_stop(self, 1.0)) {
            sf_listener_free(self->l);
            Py_CLEAR(self->states);
        } else {
            self->states = NULL;
            self->registry = self->stats = self->budget = NULL;
        }
    }
    /* In a fork's child the parent's threads and mutexes are not ours: leaked as they are. */
    Py_XDECREF(self->states);
    Py_XDECREF(self->registry);
    Py_XDECREF(self->stats);
    Py_XDECREF(self->budget);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
handle_arg(PyObject *o, uint64_t *h)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            *h = UINT64_MAX; /* no connection's: a stale handle does nothing */
            return 0;
        }
        return -1;
    }
    *h = v;
    return 0;
}

/* The handle's connection, locked (the GIL released while its mutex is busy), or NULL:
 * stale (no error set) or an error (set). */
static sf_conn *
listener_conn(Listener *self, PyObject *handle)
{
    uint64_t h;
    if (listener_usable(self) < 0 || handle_arg(handle, &h) < 0) {
        return NULL;
    }
    sf_conn *c = sf_conn_find(self->l, h);
    if (c == NULL) {
        return NULL;
    }
    if (pthread_mutex_trylock(&c->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&c->mu);
        Py_END_ALLOW_THREADS
    }
    if (!sf_conn_valid(c, h)) {
        pthread_mutex_unlock(&c->mu);
        return NULL;
    }
    return c;
}

static int
u64_arg(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *
Listener_adopt(Listener *self, PyObject *arg)
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    int fd;
    if (int_arg(arg, &fd) < 0) {
        return NULL;
    }
    if (self->l->stopped || atomic_load(&self->l->stopping)) {
        PyErr_SetString(PyExc_RuntimeError, "the listener is stopped");
        return NULL;
    }
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must be >= 0");
        return NULL;
    }
    int64_t h = sf_adopt(self->l, fd);
    if (h < 0) {
        errno = (int)-h;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

static PyObject *
Listener_step(Listener *self, PyObject *arg)
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    int timeout;
    if (int_arg(arg, &timeout) < 0) {
        return NULL;
    }
    if (self->threads != 0) {
        PyErr_SetString(PyExc_RuntimeError, "step() is for a listener of threads=0");
        return NULL;
    }
    if (self->l->stopped) {
        PyErr_SetString(PyExc_RuntimeError, "the listener is stopped");
        return NULL;
    }
    sf_listener *l = self->l;
    int n;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&l->step_mu); /* one "thread 0" at a time: its stats, its buffer */
    n = sf_loop_once(l, &l->threads[0], timeout);
    pthread_mutex_unlock(&l->step_mu);
    Py_END_ALLOW_THREADS
    if (n < 0) {
        errno = -n;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(n);
}

static PyObject *
Listener_start(Listener *self, PyObject *Py_UNUSED(ignored))
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    if (self->threads == 0) {
        PyErr_SetString(PyExc_RuntimeError, "a listener of threads=0 runs by step()");
        return NULL;
    }
    if (self->started || self->l->stopped || atomic_load(&self->l->stopping)) {
        PyErr_SetString(PyExc_RuntimeError, "start() runs once, before stop()");
        return NULL;
    }
    int err;
    sf_listener *l = self->l;
    Py_BEGIN_ALLOW_THREADS
    err = sf_start(l);
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->started = 1;
    Py_RETURN_NONE;
}

static PyObject *
Listener_stop(Listener *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout_s", NULL};
    double timeout_s = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", kwlist, &timeout_s)) {
        return NULL;
    }
    if (listener_usable(self) < 0) {
        return NULL;
    }
    if (!(timeout_s >= 0) || timeout_s > 1e9) {
        PyErr_SetString(PyExc_ValueError, "timeout_s must be in [0, 1e9]");
        return NULL;
    }
    return PyBool_FromLong(listener_stop(self, timeout_s));
}

static PyObject *
Listener_take_events(Listener *self, PyObject *Py_UNUSED(ignored))
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    /* All or nothing: the events are freed only once the list holds every one. */
    sf_event *taken = sf_ev_take(self->l);
    PyObject *list = PyList_New(0);
    for (sf_event *e = taken; e != NULL && list != NULL; e = e->next) {
        PyObject *item;
        switch (e->kind) {
        case SF_EV_DATA:
            item = Py_BuildValue("(iKy#)", e->kind, (unsigned long long)e->handle,
                                 (const char *)e->data, (Py_ssize_t)e->len);
            break;
        case SF_EV_WRITABLE:
            item = Py_BuildValue("(iKO)", e->kind, (unsigned long long)e->handle,
                                 e->value ? Py_True : Py_False);
            break;
        default:
            item = Py_BuildValue("(iKL)", e->kind, (unsigned long long)e->handle,
                                 (long long)e->value);
            break;
        }
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_CLEAR(list);
        }
        Py_XDECREF(item);
    }
    if (list == NULL) {
        sf_ev_untake(self->l, taken);
        return NULL;
    }
    while (taken != NULL) {
        sf_event *next = taken->next;
        free(taken);
        taken = next;
    }
    return list;
}

static PyObject *
Listener_write(Listener *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write(handle, data)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    size_t unsent = 0;
    int paused = 0;
    sf_conn *c = listener_conn(self, args[0]);
    if (c != NULL) {
        unsent = sf_cmd_write(self->l, c, b.buf, (size_t)b.len, &paused);
        pthread_mutex_unlock(&c->mu);
    }
    PyBuffer_Release(&b);
    if (PyErr_Occurred()) {
        return NULL;
    }
    return Py_BuildValue("(nO)", (Py_ssize_t)unsent, paused ? Py_True : Py_False);
}

static PyObject *
Listener_grant(Listener *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t consumed;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "grant(handle, consumed, prefix=b'')");
        return NULL;
    }
    if (u64_arg(args[1], &consumed) < 0) {
        return NULL;
    }
    Py_buffer b = {0};
    if (nargs == 3 && PyObject_GetBuffer(args[2], &b, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    sf_conn *c = listener_conn(self, args[0]);
    if (c == NULL) {
        if (nargs == 3) {
            PyBuffer_Release(&b);
        }
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    }
    int granted = sf_cmd_grant(self->l, c, consumed, b.buf, nargs == 3 ? (size_t)b.len : 0);
    pthread_mutex_unlock(&c->mu);
    if (nargs == 3) {
        PyBuffer_Release(&b);
    }
    return PyBool_FromLong(granted);
}

static PyObject *
Listener_consume(Listener *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t consumed;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "consume(handle, consumed)");
        return NULL;
    }
    if (u64_arg(args[1], &consumed) < 0) {
        return NULL;
    }
    sf_conn *c = listener_conn(self, args[0]);
    if (c != NULL) {
        sf_cmd_consume(self->l, c, consumed);
        pthread_mutex_unlock(&c->mu);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Listener_reading(Listener *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "reading(handle, on)");
        return NULL;
    }
    int on = PyObject_IsTrue(args[1]);
    if (on < 0) {
        return NULL;
    }
    sf_conn *c = listener_conn(self, args[0]);
    if (c != NULL) {
        sf_cmd_reading(self->l, c, on);
        pthread_mutex_unlock(&c->mu);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

enum { CMD_REVOKE, CMD_CLOSE, CMD_ABORT, CMD_FREE };

static PyObject *
listener_command(Listener *self, PyObject *handle, int which)
{
    sf_conn *c = listener_conn(self, handle);
    if (c == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    uint32_t slot = c->slot;
    switch (which) {
    case CMD_REVOKE:
        sf_cmd_revoke(self->l, c);
        break;
    case CMD_CLOSE:
        sf_cmd_close(self->l, c);
        break;
    case CMD_ABORT:
        sf_cmd_abort(self->l, c);
        break;
    default:
        sf_cmd_free(self->l, c);
        break;
    }
    pthread_mutex_unlock(&c->mu);
    if (which == CMD_FREE) {
        sf_slot_release(self->l, slot);
    }
    Py_RETURN_NONE;
}

static PyObject *
Listener_revoke(Listener *self, PyObject *h)
{
    return listener_command(self, h, CMD_REVOKE);
}

static PyObject *
Listener_close(Listener *self, PyObject *h)
{
    return listener_command(self, h, CMD_CLOSE);
}

static PyObject *
Listener_abort(Listener *self, PyObject *h)
{
    return listener_command(self, h, CMD_ABORT);
}

static PyObject *
Listener_free(Listener *self, PyObject *h)
{
    return listener_command(self, h, CMD_FREE);
}

enum { Q_READ_SEEN, Q_SERVED, Q_PARTIAL, Q_OUT_LEN, Q_FORWARDED };

static PyObject *
listener_query(Listener *self, PyObject *handle, int which)
{
    sf_conn *c = listener_conn(self, handle);
    if (c == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        return which == Q_READ_SEEN ? Py_NewRef(Py_False) : PyLong_FromLong(0);
    }
    uint64_t v;
    switch (which) {
    case Q_READ_SEEN:
        v = (uint64_t)c->read_seen;
        c->read_seen = 0;
        break;
    case Q_SERVED:
        v = c->served;
        break;
    case Q_PARTIAL:
        v = c->leased ? c->in_len : 0;
        break;
    case Q_OUT_LEN:
        v = c->out_len;
        break;
    default:
        v = c->forwarded;
        break;
    }
    pthread_mutex_unlock(&c->mu);
    if (which == Q_READ_SEEN) {
        return PyBool_FromLong(v != 0);
    }
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *
Listener_take_read_seen(Listener *self, PyObject *h)
{
    return listener_query(self, h, Q_READ_SEEN);
}

static PyObject *
Listener_served(Listener *self, PyObject *h)
{
    return listener_query(self, h, Q_SERVED);
}

static PyObject *
Listener_partial(Listener *self, PyObject *h)
{
    return listener_query(self, h, Q_PARTIAL);
}

static PyObject *
Listener_out_len(Listener *self, PyObject *h)
{
    return listener_query(self, h, Q_OUT_LEN);
}

static PyObject *
Listener_forwarded(Listener *self, PyObject *h)
{
    return listener_query(self, h, Q_FORWARDED);
}

static PyObject *
Listener_set_state(Listener *self, PyObject *state)
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    if (state != Py_None) {
        if (!sf_is_generator_state(state)) {
            PyErr_SetString(PyExc_TypeError, "state must be a GeneratorState or None");
            return NULL;
        }
        /* Kept for the listener's life: a native thread may hold the pointer it loaded. */
        if (PyList_Append(self->states, state) < 0) {
            return NULL;
        }
    }
    atomic_store_explicit(&self->l->state, state == Py_None ? NULL : (void *)state,
                          memory_order_release);
    Py_RETURN_NONE;
}

static PyObject *
Listener_take_audit(Listener *self, PyObject *Py_UNUSED(ignored))
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    PyObject *list = PyList_New(0);
    for (int i = 0; i < self->l->nthreads && list != NULL; i++) {
        sf_thread *th = &self->l->threads[i];
        pthread_mutex_lock(&th->audit_mu);
        sf_audit_entry *entries = th->audit;
        size_t n = th->audit_len;
        th->audit = NULL;
        th->audit_len = th->audit_cap = 0;
        pthread_mutex_unlock(&th->audit_mu);
        for (size_t k = 0; k < n && list != NULL; k++) {
            PyObject *item = Py_BuildValue("(LLI)", (long long)entries[k].id,
                                           (long long)entries[k].time_ms, entries[k].agent);
            if (item == NULL || PyList_Append(list, item) < 0) {
                Py_CLEAR(list);
            }
            Py_XDECREF(item);
        }
        free(entries);
    }
    return list;
}

static PyObject *
Listener_ticks(Listener *self, PyObject *Py_UNUSED(ignored))
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    PyObject *list = PyList_New(self->l->nthreads);
    int64_t now = sf_now_ns();
    for (int i = 0; list != NULL && i < self->l->nthreads; i++) {
        sf_thread *th = &self->l->threads[i];
        int64_t turn = atomic_load_explicit(&th->turn_ns, memory_order_relaxed);
        int64_t late = atomic_exchange_explicit(&th->late_max_ns, 0, memory_order_relaxed);
        PyObject *item = Py_BuildValue("(dd)", (double)(now > turn ? now - turn : 0) * 1e-9,
                                       (double)late * 1e-9);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* break_epoll(thread): a test seam: the thread's epoll fd is replaced by /dev/null's (its
 * waiting epoll_wait is woken), so its next epoll_wait fails with EINVAL, as a thread whose
 * epoll broke: EV_LOST for each of its connections, then EV_THREAD_DIED. */
static PyObject *
Listener_break_epoll(Listener *self, PyObject *arg)
{
    int t;
    if (listener_usable(self) < 0 || int_arg(arg, &t) < 0) {
        return NULL;
    }
    if (t < 0 || t >= self->l->nthreads) {
        PyErr_SetString(PyExc_IndexError, "no such native thread");
        return NULL;
    }
    sf_thread *th = &self->l->threads[t];
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null < 0 || dup3(null, th->epfd, O_CLOEXEC) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (null >= 0) {
            close(null);
        }
        return NULL;
    }
    close(null);
    uint64_t one = 1;
    if (write(th->wakefd, &one, sizeof one) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *
Listener_events_fd(Listener *self, void *Py_UNUSED(closure))
{
    if (listener_usable(self) < 0) {
        return NULL;
    }
    return PyLong_FromLong(self->l->evfd);
}

static PyObject *
Listener_get_threads(Listener *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->threads);
}

static PyGetSetDef Listener_getset[] = {
    {"events_fd", (getter)Listener_events_fd, NULL,
     "An eventfd, readable while events are queued (take_events reads it).", NULL},
    {"threads", (getter)Listener_get_threads, NULL, "Native threads (0: step mode).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

static PyMethodDef Listener_methods[] = {
    {"adopt", (PyCFunction)Listener_adopt, METH_O,
     "adopt(fd): own a connected socket (detached by Python): its handle. OSError (the fd "
     "closed) when no slot is free."},
    {"step", (PyCFunction)Listener_step, METH_O,
     "step(timeout_ms): one iteration of thread 0's loop, GIL released (threads=0 only)."},
    {"start", (PyCFunction)Listener_start, METH_NOARGS,
     "start(): every thread, held at a barrier until all started; OSError if one cannot."},
    {"stop", (PyCFunction)(void (*)(void))Listener_stop, METH_VARARGS | METH_KEYWORDS,
     "stop(timeout_s=1.0): stop and join every thread, then close every connection left."},
    {"take_events", (PyCFunction)Listener_take_events, METH_NOARGS,
     "take_events(): every queued event, oldest first."},
    {"write", FASTCALL(Listener_write),
     "write(handle, data): (unsent bytes in out, became_paused)."},
    {"grant", FASTCALL(Listener_grant),
     "grant(handle, consumed, prefix=b''): the lease, iff consumed == forwarded, not closing, "
     "in empty; prefix: a frame's start Python holds, kept natively if it can lead to one "
     "native serves (else no lease)."},
    {"consume", FASTCALL(Listener_consume), "consume(handle, consumed): Python took these."},
    {"reading", FASTCALL(Listener_reading), "reading(handle, on): want reads or not."},
    {"revoke", (PyCFunction)Listener_revoke, METH_O,
     "revoke(handle): the lease back; a kept partial frame posted as EV_DATA."},
    {"close", (PyCFunction)Listener_close, METH_O,
     "close(handle): read nothing more, flush out, close, EV_LOST(0)."},
    {"abort", (PyCFunction)Listener_abort, METH_O,
     "abort(handle): close at once (SO_LINGER 0), EV_LOST(0)."},
    {"free", (PyCFunction)Listener_free, METH_O,
     "free(handle): Python is done with it; the slot may be reused."},
    {"take_read_seen", (PyCFunction)Listener_take_read_seen, METH_O,
     "take_read_seen(handle): whether native read bytes since the last call."},
    {"served", (PyCFunction)Listener_served, METH_O, "served(handle): frames answered natively."},
    {"partial", (PyCFunction)Listener_partial, METH_O,
     "partial(handle): bytes of an unfinished frame kept natively."},
    {"out_len", (PyCFunction)Listener_out_len, METH_O, "out_len(handle): bytes not yet sent."},
    {"forwarded", (PyCFunction)Listener_forwarded, METH_O,
     "forwarded(handle): bytes posted to Python in total."},
    {"set_state", (PyCFunction)Listener_set_state, METH_O,
     "set_state(state): the GeneratorState native issues from (None: every match handed over)."},
    {"take_audit", (PyCFunction)Listener_take_audit, METH_NOARGS,
     "take_audit(): (id, time_ms, agent_index) of every native id since the last call."},
    {"break_epoll", (PyCFunction)Listener_break_epoll, METH_O,
     "break_epoll(thread): that thread's next epoll_wait fails (a test seam)."},
    {"ticks", (PyCFunction)Listener_ticks, METH_NOARGS,
     "ticks(): per thread (seconds since its loop turned, its tick's most lateness since the "
     "last call)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ListenerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "snowflake_server._native._core.Listener",
    .tp_basicsize = sizeof(Listener),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native connection machine: adopted sockets served by native threads under "
              "Python's lease (notes/issue-27/native-api.md).",
    .tp_new = Listener_new,
    .tp_dealloc = (destructor)Listener_dealloc,
    .tp_methods = Listener_methods,
    .tp_getset = Listener_getset,
};

/* fail_thread_start(n): a test seam: the next start() fails to create its thread n
 * (0-based) as pthread_create does at pids.max (EAGAIN), once; -1 clears it. */
static PyObject *
py_fail_thread_start(PyObject *Py_UNUSED(module), PyObject *arg)
{
    int n;
    if (int_arg(arg, &n) < 0) {
        return NULL;
    }
    sf_fail_thread_start = n;
    Py_RETURN_NONE;
}

/* ---- module -------------------------------------------------------------------------- */

static PyMethodDef listener_functions[] = {
    {"match_get_id", (PyCFunction)(void (*)(void))py_match_get_id, METH_FASTCALL,
     "match_get_id(frame, limit): (seqid, agent) as fastpath.match_get_id, or None."},
    {"scan_prefix", (PyCFunction)(void (*)(void))py_scan_prefix, METH_FASTCALL,
     "scan_prefix(buffer, limit): (result, why, frame_len, seqid, agent_at, agent_len) for "
     "the buffer's first frame; result SCAN_NEED_MORE, SCAN_MATCH or SCAN_HANDOVER."},
    {"get_id_reply", (PyCFunction)(void (*)(void))py_get_id_reply, METH_FASTCALL,
     "get_id_reply(seqid, id): the 34 bytes fastpath.get_id_reply packs."},
    {"fail_thread_start", (PyCFunction)py_fail_thread_start, METH_O,
     "fail_thread_start(n): the next Listener.start() fails to create thread n (a test "
     "seam; -1 clears it)."},
    {NULL, NULL, 0, NULL},
};

int
sf_listener_init(PyObject *module)
{
    if (PyType_Ready(&AgentRegistryType) < 0 || PyType_Ready(&NativeStatsType) < 0 ||
        PyType_Ready(&AuditBudgetType) < 0 || PyType_Ready(&ListenerType) < 0 ||
        PyModule_AddFunctions(module, listener_functions) < 0 ||
        PyModule_AddObjectRef(module, "AgentRegistry", (PyObject *)&AgentRegistryType) < 0 ||
        PyModule_AddObjectRef(module, "NativeStats", (PyObject *)&NativeStatsType) < 0 ||
        PyModule_AddObjectRef(module, "AuditBudget", (PyObject *)&AuditBudgetType) < 0 ||
        PyModule_AddObjectRef(module, "Listener", (PyObject *)&ListenerType) < 0 ||
        PyModule_AddIntConstant(module, "EV_DATA", SF_EV_DATA) < 0 ||
        PyModule_AddIntConstant(module, "EV_WRITABLE", SF_EV_WRITABLE) < 0 ||
        PyModule_AddIntConstant(module, "EV_LOST", SF_EV_LOST) < 0 ||
        PyModule_AddIntConstant(module, "EV_THREAD_DIED", SF_EV_THREAD_DIED) < 0 ||
        PyModule_AddIntConstant(module, "EV_EOF", SF_EV_EOF) < 0 ||
        PyModule_AddIntConstant(module, "NATIVE_READ", SF_NATIVE_READ) < 0 ||
        PyModule_AddIntConstant(module, "NATIVE_MAX_FRAME", SF_NATIVE_MAX_FRAME) < 0 ||
        PyModule_AddIntConstant(module, "NATIVE_AGENTS_MAX", SF_AGENTS_MAX) < 0 ||
        PyModule_AddIntConstant(module, "SCAN_NEED_MORE", SF_NEED_MORE) < 0 ||
        PyModule_AddIntConstant(module, "SCAN_MATCH", SF_MATCH) < 0 ||
        PyModule_AddIntConstant(module, "SCAN_HANDOVER", SF_HANDOVER) < 0 ||
        PyModule_AddIntConstant(module, "WHY_LENGTH", SF_WHY_LENGTH) < 0 ||
        PyModule_AddIntConstant(module, "WHY_REQUEST", SF_WHY_REQUEST) < 0) {
        return -1;
    }
    PyObject *buckets = PyTuple_New(SF_BUCKETS);
    PyObject *reasons = PyTuple_New(SF_HANDOFFS);
    if (buckets == NULL || reasons == NULL) {
        Py_XDECREF(buckets);
        Py_XDECREF(reasons);
        return -1;
    }
    for (int i = 0; i < SF_BUCKETS; i++) {
        PyTuple_SET_ITEM(buckets, i, PyLong_FromUnsignedLongLong(SF_BUCKET_NS[i]));
    }
    for (int i = 0; i < SF_HANDOFFS; i++) {
        PyTuple_SET_ITEM(reasons, i, PyUnicode_FromString(SF_HANDOFF_NAMES[i]));
    }
    if (PyErr_Occurred() || PyModule_AddObject(module, "LATENCY_BUCKETS_NS", buckets) < 0) {
        Py_DECREF(buckets);
        Py_DECREF(reasons);
        return -1;
    }
    if (PyModule_AddObject(module, "HANDOFF_REASONS", reasons) < 0) {
        Py_DECREF(reasons);
        return -1;
    }
    return 0;
}
