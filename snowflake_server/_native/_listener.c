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

#include "_listener.h"

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

/* ---- module -------------------------------------------------------------------------- */

static PyMethodDef listener_functions[] = {
    {"match_get_id", (PyCFunction)(void (*)(void))py_match_get_id, METH_FASTCALL,
     "match_get_id(frame, limit): (seqid, agent) as fastpath.match_get_id, or None."},
    {"scan_prefix", (PyCFunction)(void (*)(void))py_scan_prefix, METH_FASTCALL,
     "scan_prefix(buffer, limit): (result, why, frame_len, seqid, agent_at, agent_len) for "
     "the buffer's first frame; result SCAN_NEED_MORE, SCAN_MATCH or SCAN_HANDOVER."},
    {"get_id_reply", (PyCFunction)(void (*)(void))py_get_id_reply, METH_FASTCALL,
     "get_id_reply(seqid, id): the 34 bytes fastpath.get_id_reply packs."},
    {NULL, NULL, 0, NULL},
};

int
sf_listener_init(PyObject *module)
{
    if (PyType_Ready(&AgentRegistryType) < 0 || PyType_Ready(&NativeStatsType) < 0 ||
        PyType_Ready(&AuditBudgetType) < 0 || PyModule_AddFunctions(module, listener_functions) < 0 ||
        PyModule_AddObjectRef(module, "AgentRegistry", (PyObject *)&AgentRegistryType) < 0 ||
        PyModule_AddObjectRef(module, "NativeStats", (PyObject *)&NativeStatsType) < 0 ||
        PyModule_AddObjectRef(module, "AuditBudget", (PyObject *)&AuditBudgetType) < 0 ||
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
