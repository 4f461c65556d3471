/* The native listener's pure-C parts (issue 27, slice 2, step 1): the get_id frame parser
 * and reply, the agent registry, per-thread counters and the audit budget. No Python here:
 * _listener.c wraps them for Python (and tests), tests/native/fuzz_frame.c drives the
 * parser without an interpreter, and the listener's threads (step 3+) call them directly.
 *
 * Every function is static: this header is included by exactly one translation unit of a
 * given binary (_listener.c in the extension, fuzz_frame.c in the fuzz driver).
 */
#ifndef SNOWFLAKE_NATIVE_LISTENER_H
#define SNOWFLAKE_NATIVE_LISTENER_H

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------
 * The frame: snowflake_server/_thrift/fastpath.py, byte for byte. A framed strict-binary
 * get_id call with L bytes of user agent:
 *
 *   length (26 + L) | 80 01 00 01 | 00 00 00 06 "get_id" | seqid (4)
 *   | 0b 00 01 | L (4) | agent (L) | 00
 */
#define SF_HEAD_END 18  /* where the seqid starts */
#define SF_FIELD_AT 22  /* 0b 00 01: field 1, a string */
#define SF_AGENT_LEN_AT 25
#define SF_AGENT_AT 29
#define SF_OVERHEAD 30  /* every byte of the frame but the agent's */
#define SF_REPLY_LEN 34 /* a get_id reply, with its 4-byte length */
/* The longest agent Python's check_user_agent lets through (_service.MAX_USER_AGENT_LENGTH;
 * agents are ASCII, so characters are bytes), and so the longest frame native serves:
 * anything longer is handed over from its length prefix, which bounds what a leased
 * connection ever buffers of one frame. */
#define SF_AGENT_MAX_LEN 128
#define SF_NATIVE_MAX_FRAME (SF_OVERHEAD + SF_AGENT_MAX_LEN)

static const uint8_t SF_REQUEST_HEAD[14] = {0x80, 0x01, 0x00, 0x01, 0x00, 0x00, 0x00,
                                            0x06, 'g',  'e',  't',  '_',  'i',  'd'};
static const uint8_t SF_AGENT_FIELD[3] = {0x0b, 0x00, 0x01};
static const uint8_t SF_REPLY_HEAD[18] = {0x00, 0x00, 0x00, 0x1e, 0x80, 0x01, 0x00, 0x02, 0x00,
                                          0x00, 0x00, 0x06, 'g',  'e',  't',  '_',  'i',  'd'};

typedef enum { SF_NEED_MORE = 0, SF_MATCH = 1, SF_HANDOVER = 2 } sf_scan_result;

/* Why a frame is not native's: the handoff reasons the parser knows (the listener adds its
 * own after them: an unregistered agent, a SLOW generator, ...). */
typedef enum {
    SF_WHY_NONE = 0,
    SF_WHY_LENGTH = 1,  /* the length prefix: <= 0, past the limit or past SF_NATIVE_MAX_FRAME */
    SF_WHY_REQUEST = 2, /* another method, protocol, field, agent length or no stop byte */
} sf_why;

typedef struct {
    uint32_t frame_len; /* the whole frame's bytes, its 4-byte length included */
    uint32_t agent_at;  /* the agent's offset from the frame's first byte */
    uint32_t agent_len;
    uint8_t seqid[4]; /* raw, as the reply echoes it */
    sf_why why;       /* for SF_HANDOVER */
} sf_frame;

static inline uint32_t
sf_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* fastpath.match_get_id, exactly: 1 and *m filled if frame[0..n) is exactly one common
 * get_id request with its length prefix equal to n - 4 and n - 4 <= limit; else 0. Reads
 * only frame[0..n). */
static inline int
sf_match_get_id(const uint8_t *frame, size_t n, int64_t limit, sf_frame *m)
{
    /* n < 30 can never match (fastpath's conditions imply it: the agent length, an unsigned
     * field, must equal n - 30); checking it first keeps every read below inside n. */
    if (n < SF_OVERHEAD || n - 4 > UINT32_MAX) {
        return 0;
    }
    if (memcmp(frame + 4, SF_REQUEST_HEAD, sizeof SF_REQUEST_HEAD) != 0 ||
        memcmp(frame + SF_FIELD_AT, SF_AGENT_FIELD, sizeof SF_AGENT_FIELD) != 0 ||
        frame[n - 1] != 0 || sf_be32(frame) != n - 4 || (int64_t)(n - 4) > limit ||
        sf_be32(frame + SF_AGENT_LEN_AT) != n - SF_OVERHEAD) {
        return 0;
    }
    m->frame_len = (uint32_t)n;
    m->agent_at = SF_AGENT_AT;
    m->agent_len = (uint32_t)(n - SF_OVERHEAD);
    memcpy(m->seqid, frame + SF_HEAD_END, 4);
    m->why = SF_WHY_NONE;
    return 1;
}

/* The first frame of buf[0..len) (a connection's unparsed bytes, frames back to back):
 *   SF_MATCH:     buf holds the whole first frame (m->frame_len bytes), it is
 *                 sf_match_get_id(frame, limit) and at most SF_NATIVE_MAX_FRAME long;
 *   SF_NEED_MORE: buf is a proper prefix of some frame that would be SF_MATCH (an empty
 *                 buf included: nothing to decide yet);
 *   SF_HANDOVER:  no bytes appended to buf can make its first frame SF_MATCH (m->why says
 *                 why): the listener hands everything from here on to Python.
 * So a frame that matches said NEED_MORE at every prefix, and once a prefix says HANDOVER
 * every longer one does. Reads only buf[0..len). */
static inline sf_scan_result
sf_scan_prefix(const uint8_t *buf, size_t len, int64_t limit, sf_frame *m)
{
    /* The length prefix's largest value native can serve. */
    int64_t most = SF_NATIVE_MAX_FRAME - 4;
    if (limit < most) {
        most = limit;
    }
    if (len == 0) {
        return SF_NEED_MORE;
    }
    m->why = SF_WHY_LENGTH;
    if (most < SF_OVERHEAD - 4) {
        return SF_HANDOVER;
    }
    /* most < 256: the length's first three bytes must be zero, its last in [26, most]. */
    size_t have = len < 4 ? len : 4;
    for (size_t i = 0; i < have && i < 3; i++) {
        if (buf[i] != 0) {
            return SF_HANDOVER;
        }
    }
    if (len < 4) {
        return SF_NEED_MORE;
    }
    if (buf[3] < SF_OVERHEAD - 4 || buf[3] > most) {
        return SF_HANDOVER;
    }
    size_t n = (size_t)buf[3] + 4;
    m->why = SF_WHY_REQUEST;
    size_t seen = len < n ? len : n;
    /* Byte by byte against the fixed parts, as far as they have arrived. */
    for (size_t i = 4; i < seen && i < SF_HEAD_END; i++) {
        if (buf[i] != SF_REQUEST_HEAD[i - 4]) {
            return SF_HANDOVER;
        }
    }
    for (size_t i = SF_FIELD_AT; i < seen && i < SF_AGENT_LEN_AT; i++) {
        if (buf[i] != SF_AGENT_FIELD[i - SF_FIELD_AT]) {
            return SF_HANDOVER;
        }
    }
    /* The agent length: big endian n - 30 (< 256), so three zero bytes and then n - 30. */
    for (size_t i = SF_AGENT_LEN_AT; i < seen && i < SF_AGENT_AT; i++) {
        uint8_t want = i == SF_AGENT_AT - 1 ? (uint8_t)(n - SF_OVERHEAD) : 0;
        if (buf[i] != want) {
            return SF_HANDOVER;
        }
    }
    if (len < n) {
        return SF_NEED_MORE;
    }
    if (buf[n - 1] != 0) {
        return SF_HANDOVER;
    }
    m->frame_len = (uint32_t)n;
    m->agent_at = SF_AGENT_AT;
    m->agent_len = (uint32_t)(n - SF_OVERHEAD);
    memcpy(m->seqid, buf + SF_HEAD_END, 4);
    m->why = SF_WHY_NONE;
    return SF_MATCH;
}

/* fastpath.get_id_reply: the 34-byte framed reply to the call with seqid returning id. */
static inline void
sf_get_id_reply(uint8_t out[SF_REPLY_LEN], const uint8_t seqid[4], int64_t id)
{
    uint64_t u = (uint64_t)id;
    memcpy(out, SF_REPLY_HEAD, sizeof SF_REPLY_HEAD);
    memcpy(out + 18, seqid, 4);
    out[22] = 0x0a; /* field 0 (success), an i64 */
    out[23] = 0x00;
    out[24] = 0x00;
    for (int i = 0; i < 8; i++) {
        out[25 + i] = (uint8_t)(u >> (56 - 8 * i));
    }
    out[33] = 0x00; /* stop */
}

/* ---------------------------------------------------------------------------------------
 * The agent registry: the agents Python validated and labelled once, so that native may
 * serve them. Bounded: at most SF_AGENTS_MAX agents; past that sf_registry_add refuses
 * (returns -1) and such an agent's lookups miss, so Python serves it (cycling agents buys
 * no native memory). Append-only: an entry never changes or moves once published, and
 * every entry is freed only by sf_registry_free, which the owner calls after every reader
 * has stopped (the listener: after joining its threads).
 *
 * Concurrency: adders serialise on write_mutex (Python only, rare); readers take no lock.
 * The table is open addressing over SF_AGENT_SLOTS atomic pointers (twice the bound, so a
 * probe always meets an empty slot): an adder fills a fresh entry, then publishes it with
 * one release store; a reader's acquire load of a non-NULL pointer therefore sees the
 * whole entry. A reader racing an add either misses (the frame goes to Python, which is
 * always correct) or finds the complete entry.
 */
#define SF_AGENTS_MAX 4096
#define SF_AGENT_SLOTS 8192

typedef struct {
    uint32_t hash;
    uint32_t index; /* the order of registration: 0 .. SF_AGENTS_MAX - 1 */
    int32_t label;  /* the label index Python gave */
    uint32_t len;
    uint8_t bytes[];
} sf_agent;

typedef struct {
    _Atomic(sf_agent *) slots[SF_AGENT_SLOTS];
    sf_agent *by_index[SF_AGENTS_MAX]; /* written under write_mutex; read by its holder */
    _Atomic uint32_t count;
    pthread_mutex_t write_mutex;
} sf_registry;

static inline uint32_t
sf_fnv1a(const uint8_t *p, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ p[i]) * 16777619u;
    }
    return h;
}

static inline int
sf_registry_init(sf_registry *r)
{
    for (size_t i = 0; i < SF_AGENT_SLOTS; i++) {
        atomic_init(&r->slots[i], NULL);
    }
    memset(r->by_index, 0, sizeof r->by_index);
    atomic_init(&r->count, 0);
    return pthread_mutex_init(&r->write_mutex, NULL);
}

/* The registered entry for agent[0..len), or NULL. Lock-free; safe from any thread while
 * another adds. */
static inline const sf_agent *
sf_registry_lookup(sf_registry *r, const uint8_t *agent, size_t len)
{
    if (len > SF_AGENT_MAX_LEN) {
        return NULL;
    }
    uint32_t h = sf_fnv1a(agent, len);
    for (uint32_t i = h & (SF_AGENT_SLOTS - 1);; i = (i + 1) & (SF_AGENT_SLOTS - 1)) {
        const sf_agent *e = atomic_load_explicit(&r->slots[i], memory_order_acquire);
        if (e == NULL) {
            return NULL;
        }
        if (e->hash == h && e->len == len && memcmp(e->bytes, agent, len) == 0) {
            return e;
        }
    }
}

#define SF_ADD_FULL (-1)
#define SF_ADD_TOO_LONG (-2)
#define SF_ADD_RELABEL (-3) /* registered before under another label */
#define SF_ADD_NO_MEMORY (-4)

/* Register agent[0..len) under label: its registry index (the one it already has, if it
 * is registered under the same label), or one of the SF_ADD_* errors, nothing changed. */
static inline int
sf_registry_add(sf_registry *r, const uint8_t *agent, size_t len, int32_t label)
{
    if (len > SF_AGENT_MAX_LEN) {
        return SF_ADD_TOO_LONG;
    }
    int result;
    pthread_mutex_lock(&r->write_mutex);
    const sf_agent *old = sf_registry_lookup(r, agent, len);
    uint32_t count = atomic_load_explicit(&r->count, memory_order_relaxed);
    if (old != NULL) {
        result = old->label == label ? (int)old->index : SF_ADD_RELABEL;
    } else if (count >= SF_AGENTS_MAX) {
        result = SF_ADD_FULL;
    } else {
        sf_agent *e = malloc(sizeof(sf_agent) + (len ? len : 1));
        if (e == NULL) {
            result = SF_ADD_NO_MEMORY;
        } else {
            e->hash = sf_fnv1a(agent, len);
            e->index = count;
            e->label = label;
            e->len = (uint32_t)len;
            if (len) {
                memcpy(e->bytes, agent, len);
            }
            uint32_t i = e->hash & (SF_AGENT_SLOTS - 1);
            while (atomic_load_explicit(&r->slots[i], memory_order_relaxed) != NULL) {
                i = (i + 1) & (SF_AGENT_SLOTS - 1);
            }
            r->by_index[count] = e;
            atomic_store_explicit(&r->slots[i], e, memory_order_release);
            atomic_store_explicit(&r->count, count + 1, memory_order_release);
            result = (int)count;
        }
    }
    pthread_mutex_unlock(&r->write_mutex);
    return result;
}

/* Frees every entry. Only once no thread can look up any more. */
static inline void
sf_registry_free(sf_registry *r)
{
    uint32_t count = atomic_load_explicit(&r->count, memory_order_acquire);
    for (uint32_t i = 0; i < count; i++) {
        free(r->by_index[i]);
        r->by_index[i] = NULL;
    }
    for (size_t i = 0; i < SF_AGENT_SLOTS; i++) {
        atomic_store_explicit(&r->slots[i], NULL, memory_order_relaxed);
    }
    atomic_store_explicit(&r->count, 0, memory_order_relaxed);
    pthread_mutex_destroy(&r->write_mutex);
}

/* ---------------------------------------------------------------------------------------
 * Per-thread counters. Each sf_thread_stats has exactly one writer (its native thread),
 * which bumps a counter with a relaxed load and a relaxed store (no read-modify-write: no
 * other writer); a scrape sums every thread's with relaxed loads. So a total is never
 * torn, never goes backwards and loses no increment (ConnectionStats' contract), and no
 * lock is taken per call. Each block starts on its own cache line.
 *
 * Latency buckets are _observability.metrics.LATENCY_BUCKETS_S in nanoseconds, and a call
 * of t ns counts in the first bucket whose bound is >= t (bisect_left, as
 * ConnectionStats.observe does on seconds), the last one being +Inf.
 */
#define SF_BUCKETS 12
static const uint64_t SF_BUCKET_NS[SF_BUCKETS] = {
    25000,   50000,    100000,   250000,    500000,    1000000,
    2500000, 5000000, 10000000, 25000000, 100000000, 1000000000,
};

typedef enum {
    SF_HANDOFF_LENGTH = 0,    /* sf_scan_prefix: SF_WHY_LENGTH */
    SF_HANDOFF_REQUEST = 1,   /* sf_scan_prefix: SF_WHY_REQUEST */
    SF_HANDOFF_AGENT = 2,     /* not in the registry */
    SF_HANDOFF_SLOW = 3,      /* the generator's SLOW */
    SF_HANDOFF_CONTENDED = 4, /* the state's mutex stayed busy */
    SF_HANDOFF_GATE = 5,      /* the session gate closed or past its deadline */
    SF_HANDOFFS = 6,
} sf_handoff;

static const char *const SF_HANDOFF_NAMES[SF_HANDOFFS] = {
    "length", "request", "agent", "slow", "contended", "gate",
};

typedef struct {
    _Alignas(64) _Atomic uint64_t calls;
    _Atomic uint64_t internal_errors;
    _Atomic uint64_t latency_sum_ns;
    _Atomic uint64_t latency[SF_BUCKETS + 1];
    _Atomic uint64_t handoffs[SF_HANDOFFS];
    _Atomic uint64_t ids[SF_AGENTS_MAX]; /* by registry index */
} sf_thread_stats;

static inline void
sf_bump(_Atomic uint64_t *c, uint64_t n)
{
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

static inline int
sf_bucket(uint64_t ns)
{
    int i = 0;
    while (i < SF_BUCKETS && ns > SF_BUCKET_NS[i]) {
        i++;
    }
    return i;
}

/* One get_id answered natively for the agent of registry index agent (one id). */
static inline void
sf_stats_call(sf_thread_stats *t, uint32_t agent, uint64_t latency_ns)
{
    sf_bump(&t->calls, 1);
    if (agent < SF_AGENTS_MAX) {
        sf_bump(&t->ids[agent], 1);
    }
    sf_bump(&t->latency[sf_bucket(latency_ns)], 1);
    sf_bump(&t->latency_sum_ns, latency_ns);
}

static inline void
sf_stats_handoff(sf_thread_stats *t, sf_handoff why)
{
    if ((unsigned)why < SF_HANDOFFS) {
        sf_bump(&t->handoffs[why], 1);
    }
}

static inline void
sf_stats_internal_error(sf_thread_stats *t)
{
    sf_bump(&t->internal_errors, 1);
}

static inline uint64_t
sf_read(_Atomic uint64_t *c)
{
    return atomic_load_explicit(c, memory_order_relaxed);
}

/* ---------------------------------------------------------------------------------------
 * The audit budget: AuditLog's bound on entries waiting in memory (its _pending, dropped
 * and max_pending), shared by AuditLog.record and the native threads. A reservation is
 * a compare-and-swap loop, so it succeeds exactly when pending + n <= max_pending at the
 * moment it takes effect: the same decision the locked `if self._pending + n >
 * self._max_pending` makes, never a spurious drop from another thread's over-reservation
 * (which a fetch_add-then-give-back would cause).
 */
typedef struct {
    _Atomic int64_t pending;
    _Atomic uint64_t dropped;
    int64_t max_pending;
} sf_audit_budget;

static inline void
sf_audit_init(sf_audit_budget *b, int64_t max_pending)
{
    atomic_init(&b->pending, 0);
    atomic_init(&b->dropped, 0);
    b->max_pending = max_pending;
}

/* Reserve n entries: 1, or 0 and the n counted as dropped. */
static inline int
sf_audit_reserve(sf_audit_budget *b, int64_t n)
{
    int64_t pending = atomic_load_explicit(&b->pending, memory_order_relaxed);
    do {
        if (n > b->max_pending - pending) {
            atomic_fetch_add_explicit(&b->dropped, (uint64_t)n, memory_order_relaxed);
            return 0;
        }
    } while (!atomic_compare_exchange_weak_explicit(&b->pending, &pending, pending + n,
                                                    memory_order_relaxed, memory_order_relaxed));
    return 1;
}

/* n reserved entries left memory (written, or dropped by a failed write: then drop first). */
static inline void
sf_audit_release(sf_audit_budget *b, int64_t n)
{
    atomic_fetch_sub_explicit(&b->pending, n, memory_order_relaxed);
}

/* n reserved entries were lost (a failed write); release them too with sf_audit_release. */
static inline void
sf_audit_drop(sf_audit_budget *b, int64_t n)
{
    atomic_fetch_add_explicit(&b->dropped, (uint64_t)n, memory_order_relaxed);
}

#endif
