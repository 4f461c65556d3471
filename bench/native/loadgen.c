/*
 * loadgen: a closed-loop Thrift load generator for the snowflake service.
 *
 *   bench/build/loadgen --port PORT [--connections N] [--method get_id|get_ids]
 *       [--count N] [--warmup S] [--duration S] [--idle N] [--spread N]
 *       [--agent NAME] [--timeout S] [--marks]
 *
 * Why C: the Python load generator spends more CPU per call than the server it
 * measures, so on a 2-core machine the load side, not the server, set the pace.
 * This one speaks framed strict binary Thrift by hand (what Twitter's clients
 * send) with one thread and one TCP connection per connection, and reports the
 * client CPU it spent per call so that a reader can check it stayed small.
 *
 * Every reply is checked: frame length, message type, method name, seqid (one
 * per call), result field 0 (i64, or list<i64> of exactly --count), ids
 * strictly increasing within a connection, and at the end unique across all
 * connections.  Declared exceptions and EXCEPTION replies are errors with
 * their message kept.  Any error makes the exit status 1; bad flags make it 2.
 *
 * Load goes to the loopback range only (127.0.0.0/8).  The run is bounded in
 * time: warm-up + duration, each socket operation by --timeout, and the whole
 * process by an alarm.  Output: one JSON object on stdout.
 */
#define _GNU_SOURCE /* POLLRDHUP */

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

/* Thrift binary protocol (strict): the version word, message and field types. */
#define VERSION_1 0x80010000u
#define VERSION_MASK 0xffff0000u
#define T_CALL 1
#define T_REPLY 2
#define T_EXCEPTION 3
#define T_STOP 0
#define T_BOOL 2
#define T_BYTE 3
#define T_DOUBLE 4
#define T_I16 6
#define T_I32 8
#define T_I64 10
#define T_STRING 11
#define T_STRUCT 12
#define T_MAP 13
#define T_SET 14
#define T_LIST 15

#define MAX_FRAME (16u << 20) /* far above get_ids(4096)'s 32 KiB reply */
#define MAX_CONNECTIONS 1024
#define MAX_IDLE 100000
#define MAX_SECONDS 600.0
#define MAX_SKIP_DEPTH 16
#define FIRST_ERRORS 5
#define RUN_ERRORS 4
#define ERROR_TEXT 240
#define SPREAD_ATTEMPTS 200 /* reconnects per connection to find a process with room */
/* Runs of consecutive ids kept for the uniqueness check, over all connections: 16 bytes
 * each, so at most 256 MiB.  Past it, ids are still checked within their connection. */
#define MAX_ID_RUNS (16u << 20)
/* Latency histogram: the top 8 significant bits of each sample in ns, the buckets of
 * bench/loadgen.py's Histogram, so the harness merges rounds with that class. */
#define SIG_BITS 8
#define HALF_BUCKETS (1u << (SIG_BITS - 1))
#define BUCKETS (64u * HALF_BUCKETS + 2u * HALF_BUCKETS)

enum method { GET_ID, GET_IDS };
static const char *const METHOD_NAMES[] = {"get_id", "get_ids"};
/* The exceptions the IDL declares, by field id of the result struct (0 = success). */
static const char *const DECLARED[] = {
    NULL, "InvalidSystemClock", "InvalidUserAgentError", "InvalidCountError",
    "UnavailableError"};

struct options {
    struct in_addr host;
    char host_text[INET_ADDRSTRLEN];
    int port;
    int connections;
    enum method method;
    int count;
    double warmup_s;
    double duration_s;
    int idle;
    int spread;
    const char *agent;
    double timeout_s;
    bool marks;
};

struct id_run {
    int64_t first, last; /* consecutive ids first..last, one connection's, increasing */
};

struct histogram {
    uint64_t buckets[BUCKETS];
    uint64_t count, total_ns, max_ns;
};

struct conn {
    int index;
    int fd;
    uint8_t *request;
    size_t request_len;
    size_t seqid_at; /* where the seqid sits in the request */
    int32_t seqid;
    uint64_t call_number; /* for error messages: the call that failed, from 1 */
    uint8_t *buf; /* reply bytes received, [0, have) */
    size_t cap, have;
    const uint8_t *ids_at; /* the ids of the last reply, big-endian, in buf */
    bool have_last;
    int64_t last_id;
    struct id_run *runs;
    size_t nruns, runs_cap, runs_limit;
    uint64_t ids_unchecked; /* ids past runs_limit: checked within the connection only */
    uint64_t calls, ids, warmup_calls;
    bool broken; /* the byte stream can no longer be trusted: the connection stops */
    struct histogram hist;
};

static struct options opt = {
    .port = 0, .connections = 1, .method = GET_ID, .count = 4096, .warmup_s = 0.5,
    .duration_s = 2.0, .idle = 0, .spread = 0, .agent = "loadgen", .timeout_s = 5.0,
    .marks = false};

/* Measurement window on CLOCK_MONOTONIC, set by the main thread before the start. */
static uint64_t measure_start_ns, measure_end_ns;
static pthread_barrier_t connected, started;

static pthread_mutex_t errors_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_uint_fast64_t error_count;
static char first_errors[FIRST_ERRORS][ERROR_TEXT]; /* of the calls */
static int first_error_count;
static char run_errors[RUN_ERRORS][ERROR_TEXT]; /* of the whole run: always listed */
static int run_error_count;

static pthread_mutex_t spread_lock = PTHREAD_MUTEX_INITIALIZER;
static int spread_keys[MAX_CONNECTIONS];
static int spread_taken[MAX_CONNECTIONS];
static int spread_nkeys;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t deadline_ns) {
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000u),
                          .tv_nsec = (long)(deadline_ns % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static double cpu_seconds(void) {
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    return (double)usage.ru_utime.tv_sec + (double)usage.ru_utime.tv_usec / 1e6 +
           (double)usage.ru_stime.tv_sec + (double)usage.ru_stime.tv_usec / 1e6;
}

/* "loadgen: MESSAGE" on stderr, then exit: 1 when the run failed, 2 for bad flags (with
 * a pointer to --help).  Never returns, so the caller's va_end is never reached. */
static void die(int status, const char *fmt, va_list args)
    __attribute__((format(printf, 2, 0), noreturn));
static void die(int status, const char *fmt, va_list args) {
    fputs("loadgen: ", stderr);
    vfprintf(stderr, fmt, args);
    fputs(status == 2 ? "\n(loadgen --help for usage)\n" : "\n", stderr);
    exit(status);
}

static void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fatal(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    die(1, fmt, args);
}

/* Counts an error of connection `c`'s current call, or of the whole run (c NULL); keeps
 * the text of the first few of the calls, and of every one of the run (at most a few). */
static void record_error(const struct conn *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void record_error(const struct conn *c, const char *fmt, ...) {
    if (atomic_fetch_add(&error_count, 1) >= FIRST_ERRORS && c != NULL) {
        return;
    }
    char text[ERROR_TEXT];
    int used = 0;
    if (c != NULL) {
        used = snprintf(text, sizeof text, "connection %d, call %" PRIu64 ": ", c->index,
                        c->call_number);
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(text + used, sizeof text - (size_t)used, fmt, args);
    va_end(args);
    pthread_mutex_lock(&errors_lock);
    if (c != NULL && first_error_count < FIRST_ERRORS) {
        memcpy(first_errors[first_error_count++], text, sizeof text);
    } else if (c == NULL && run_error_count < RUN_ERRORS) {
        memcpy(run_errors[run_error_count++], text, sizeof text);
    }
    pthread_mutex_unlock(&errors_lock);
}

/* -- latency histogram ---------------------------------------------------------- */

static size_t bucket_index(uint64_t ns) {
    if (ns < 2u * HALF_BUCKETS) {
        return (size_t)ns;
    }
    unsigned shift = (unsigned)(63 - __builtin_clzll(ns)) - (SIG_BITS - 1);
    return (size_t)shift * HALF_BUCKETS + (size_t)(ns >> shift);
}

/* The lower bound of a bucket: the sample with only its top SIG_BITS bits kept. */
static uint64_t bucket_key(size_t index, unsigned *shift_out) {
    if (index < 2u * HALF_BUCKETS) {
        *shift_out = 0;
        return index;
    }
    unsigned shift = (unsigned)((index - HALF_BUCKETS) / HALF_BUCKETS);
    *shift_out = shift;
    return (uint64_t)(index - (size_t)shift * HALF_BUCKETS) << shift;
}

static void hist_add(struct histogram *h, uint64_t ns) {
    if (ns >= (1ull << 62)) {
        ns = (1ull << 62) - 1;
    }
    h->buckets[bucket_index(ns)]++;
    h->count++;
    h->total_ns += ns;
    if (ns > h->max_ns) {
        h->max_ns = ns;
    }
}

static void hist_merge(struct histogram *into, const struct histogram *h) {
    for (size_t i = 0; i < BUCKETS; i++) {
        into->buckets[i] += h->buckets[i];
    }
    into->count += h->count;
    into->total_ns += h->total_ns;
    if (h->max_ns > into->max_ns) {
        into->max_ns = h->max_ns;
    }
}

/* The q quantile in ns: nearest rank, the bucket's middle, never above the maximum. */
static double hist_percentile(const struct histogram *h, double q) {
    if (h->count == 0) {
        return 0.0;
    }
    double rank_d = ceil(q * (double)h->count);
    uint64_t rank = rank_d < 1.0 ? 1 : (uint64_t)rank_d;
    uint64_t seen = 0;
    for (size_t i = 0; i < BUCKETS; i++) {
        seen += h->buckets[i];
        if (h->buckets[i] != 0 && seen >= rank) {
            unsigned shift;
            uint64_t key = bucket_key(i, &shift);
            double mid = (double)key + (shift ? (double)((1ull << shift) - 1) / 2.0 : 0.0);
            return mid < (double)h->max_ns ? mid : (double)h->max_ns;
        }
    }
    return (double)h->max_ns;
}

/* -- requests ------------------------------------------------------------------- */

static uint8_t *put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
    return p + 4;
}

static uint8_t *put_field(uint8_t *p, uint8_t type, int16_t id) {
    p[0] = type;
    p[1] = (uint8_t)((uint16_t)id >> 8);
    p[2] = (uint8_t)id;
    return p + 3;
}

/* The framed call, built once per connection; only its seqid changes per call. */
static void build_request(struct conn *c) {
    const char *name = METHOD_NAMES[opt.method];
    size_t name_len = strlen(name), agent_len = strlen(opt.agent);
    size_t body = 4 + 4 + name_len + 4 + 3 + 4 + agent_len + (opt.method == GET_IDS ? 3 + 4 : 0) + 1;
    c->request = malloc(4 + body);
    if (c->request == NULL) {
        fatal("out of memory");
    }
    uint8_t *p = put_u32(c->request, (uint32_t)body);
    p = put_u32(p, VERSION_1 | T_CALL);
    p = put_u32(p, (uint32_t)name_len);
    memcpy(p, name, name_len);
    c->seqid_at = (size_t)(p + name_len - c->request);
    p = put_u32(p + name_len, 0); /* seqid, set per call */
    p = put_field(p, T_STRING, 1);
    p = put_u32(p, (uint32_t)agent_len);
    memcpy(p, opt.agent, agent_len);
    p += agent_len;
    if (opt.method == GET_IDS) {
        p = put_field(p, T_I32, 2);
        p = put_u32(p, (uint32_t)opt.count);
    }
    *p++ = T_STOP;
    c->request_len = (size_t)(p - c->request);
}

/* -- sockets -------------------------------------------------------------------- */

static int open_connection(bool nodelay) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return -1;
    }
    struct timeval tv = {.tv_sec = (time_t)opt.timeout_s,
                         .tv_usec = (suseconds_t)((opt.timeout_s - (double)(time_t)opt.timeout_s) * 1e6)};
    /* SO_SNDTIMEO bounds connect() too, on Linux. */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (nodelay) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)opt.port),
                               .sin_addr = opt.host};
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

static bool send_all(struct conn *c) {
    size_t sent = 0;
    while (sent < c->request_len) {
        ssize_t n = send(c->fd, c->request + sent, c->request_len - sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            record_error(c, "send: %s", errno == EAGAIN ? "timed out" : strerror(errno));
            return false;
        }
        sent += (size_t)n;
    }
    return true;
}

/* Reads until the buffer holds at least `need` bytes (the buffer grows to fit). */
static bool fill(struct conn *c, size_t need) {
    if (need > c->cap) {
        size_t cap = c->cap;
        while (cap < need) {
            cap *= 2;
        }
        uint8_t *grown = realloc(c->buf, cap);
        if (grown == NULL) {
            fatal("out of memory");
        }
        c->buf = grown;
        c->cap = cap;
    }
    while (c->have < need) {
        ssize_t n = recv(c->fd, c->buf + c->have, c->cap - c->have, 0);
        if (n > 0) {
            c->have += (size_t)n;
        } else if (n == 0) {
            record_error(c, "the server closed the connection");
            return false;
        } else if (errno != EINTR) {
            record_error(c, "recv: %s", errno == EAGAIN ? "timed out" : strerror(errno));
            return false;
        }
    }
    return true;
}

/* -- replies -------------------------------------------------------------------- */

struct cursor {
    const uint8_t *p, *end;
    bool short_read;
};

static bool take(struct cursor *r, size_t n) {
    if ((size_t)(r->end - r->p) < n) {
        r->short_read = true;
        r->p = r->end;
        return false;
    }
    return true;
}

static uint8_t rd_u8(struct cursor *r) {
    if (!take(r, 1)) {
        return 0;
    }
    return *r->p++;
}

static uint32_t rd_u32(struct cursor *r) {
    if (!take(r, 4)) {
        return 0;
    }
    uint32_t v = (uint32_t)r->p[0] << 24 | (uint32_t)r->p[1] << 16 | (uint32_t)r->p[2] << 8 |
                 (uint32_t)r->p[3];
    r->p += 4;
    return v;
}

static int16_t rd_i16(struct cursor *r) {
    if (!take(r, 2)) {
        return 0;
    }
    uint16_t v = (uint16_t)(r->p[0] << 8 | r->p[1]);
    r->p += 2;
    return (int16_t)v;
}

static int64_t rd_i64(struct cursor *r) {
    uint64_t hi = rd_u32(r);
    uint64_t lo = rd_u32(r);
    return (int64_t)(hi << 32 | lo);
}

/* A string's bytes (not copied, not terminated); its length in *len. */
static const uint8_t *rd_string(struct cursor *r, uint32_t *len) {
    *len = rd_u32(r);
    if (*len > (uint32_t)(r->end - r->p)) {
        r->short_read = true;
        r->p = r->end;
        *len = 0;
        return r->p;
    }
    const uint8_t *s = r->p;
    r->p += *len;
    return s;
}

/* The i-th id of a reply's ids: checked to lie inside the frame by read_reply. */
static int64_t id_at(const uint8_t *ids, size_t i) {
    struct cursor r = {ids + i * 8, ids + i * 8 + 8, false};
    return rd_i64(&r);
}

static bool skip(struct cursor *r, uint8_t type, int depth);

static bool skip_n(struct cursor *r, uint8_t type, uint32_t n, int depth) {
    for (uint32_t i = 0; i < n && !r->short_read; i++) {
        if (!skip(r, type, depth)) {
            return false;
        }
    }
    return !r->short_read;
}

/* Skips one value of `type`; false on an unknown type, nesting too deep, or a short frame. */
static bool skip(struct cursor *r, uint8_t type, int depth) {
    uint32_t len;
    if (depth > MAX_SKIP_DEPTH) {
        return false;
    }
    switch (type) {
    case T_BOOL:
    case T_BYTE:
        return take(r, 1) && (r->p += 1, true);
    case T_I16:
        return take(r, 2) && (r->p += 2, true);
    case T_I32:
        return take(r, 4) && (r->p += 4, true);
    case T_DOUBLE:
    case T_I64:
        return take(r, 8) && (r->p += 8, true);
    case T_STRING:
        rd_string(r, &len);
        return !r->short_read;
    case T_STRUCT:
        for (;;) {
            uint8_t field = rd_u8(r);
            if (r->short_read) {
                return false;
            }
            if (field == T_STOP) {
                return true;
            }
            rd_i16(r);
            if (!skip(r, field, depth + 1)) {
                return false;
            }
        }
    case T_MAP: {
        uint8_t key = rd_u8(r), value = rd_u8(r);
        uint32_t n = rd_u32(r);
        for (uint32_t i = 0; i < n && !r->short_read; i++) {
            if (!skip(r, key, depth + 1) || !skip(r, value, depth + 1)) {
                return false;
            }
        }
        return !r->short_read;
    }
    case T_SET:
    case T_LIST: {
        uint8_t elem = rd_u8(r);
        uint32_t n = rd_u32(r);
        return skip_n(r, elem, n, depth + 1);
    }
    default:
        return false;
    }
}

/* The message of a struct whose field 1 is a string (a declared exception, or a
 * TApplicationException, whose field 2 is its i32 type). */
static void exception_text(struct cursor *r, char *out, size_t size, int32_t *app_type) {
    snprintf(out, size, "(no message)");
    for (;;) {
        uint8_t type = rd_u8(r);
        if (r->short_read || type == T_STOP) {
            return;
        }
        int16_t id = rd_i16(r);
        if (id == 1 && type == T_STRING) {
            uint32_t len;
            const uint8_t *s = rd_string(r, &len);
            snprintf(out, size, "%.*s", (int)(len < size ? len : size - 1), (const char *)s);
        } else if (id == 2 && type == T_I32 && app_type != NULL) {
            *app_type = (int32_t)rd_u32(r);
        } else if (!skip(r, type, 1)) {
            return;
        }
    }
}

enum outcome { REPLY_OK, REPLY_REFUSED, STREAM_BROKEN };

/* Reads and checks one reply; c->ids_at points at its ids.  REPLY_REFUSED: the server
 * answered well-formed but with an error (the connection stays usable). */
static enum outcome read_reply(struct conn *c, size_t *nids) {
    *nids = 0;
    if (!fill(c, 4)) {
        return STREAM_BROKEN;
    }
    uint32_t frame = (uint32_t)c->buf[0] << 24 | (uint32_t)c->buf[1] << 16 |
                     (uint32_t)c->buf[2] << 8 | (uint32_t)c->buf[3];
    if (frame < 12 || frame > MAX_FRAME) {
        record_error(c, "frame length %" PRIu32 " (not 12..%u)", frame, MAX_FRAME);
        return STREAM_BROKEN;
    }
    if (!fill(c, 4 + (size_t)frame)) {
        return STREAM_BROKEN;
    }
    if (c->have != 4 + (size_t)frame) {
        record_error(c, "%zu bytes past the reply frame", c->have - 4 - (size_t)frame);
        return STREAM_BROKEN;
    }
    c->have = 0; /* the whole reply is consumed below */
    struct cursor r = {c->buf + 4, c->buf + 4 + frame, false};
    uint32_t version = rd_u32(&r);
    if ((version & VERSION_MASK) != VERSION_1) {
        record_error(c, "version word %08" PRIx32 " (not strict binary)", version);
        return STREAM_BROKEN;
    }
    uint8_t type = (uint8_t)(version & 0xff);
    uint32_t name_len;
    const uint8_t *name = rd_string(&r, &name_len);
    const char *method = METHOD_NAMES[opt.method];
    if (r.short_read || name_len != strlen(method) || memcmp(name, method, name_len) != 0) {
        record_error(c, "reply to '%.*s', not '%s'", (int)(name_len > 64 ? 64 : name_len),
                     (const char *)name, method);
        return STREAM_BROKEN;
    }
    int32_t seqid = (int32_t)rd_u32(&r);
    if (seqid != c->seqid) {
        record_error(c, "seqid %" PRId32 " in the reply, %" PRId32 " sent", seqid, c->seqid);
        return STREAM_BROKEN;
    }
    if (type == T_EXCEPTION) {
        char text[160];
        int32_t app_type = -1;
        exception_text(&r, text, sizeof text, &app_type);
        record_error(c, "application exception (type %" PRId32 "): %s", app_type, text);
        return REPLY_REFUSED;
    }
    if (type != T_REPLY) {
        record_error(c, "message type %u (not REPLY)", type);
        return STREAM_BROKEN;
    }
    bool got_result = false, refused = false;
    for (;;) {
        uint8_t ftype = rd_u8(&r);
        if (r.short_read) {
            break;
        }
        if (ftype == T_STOP) {
            break;
        }
        int16_t id = rd_i16(&r);
        if (id == 0 && opt.method == GET_ID && ftype == T_I64) {
            if (!take(&r, 8)) {
                break;
            }
            c->ids_at = r.p;
            r.p += 8;
            *nids = 1;
            got_result = true;
        } else if (id == 0 && opt.method == GET_IDS && ftype == T_LIST) {
            uint8_t elem = rd_u8(&r);
            uint32_t n = rd_u32(&r);
            if (elem != T_I64 || n != (uint32_t)opt.count) {
                record_error(c, "a list of %" PRIu32 " elements of type %u, not %d i64",
                             n, elem, opt.count);
                return STREAM_BROKEN;
            }
            if (!take(&r, (size_t)n * 8)) {
                break;
            }
            c->ids_at = r.p;
            r.p += (size_t)n * 8;
            *nids = n;
            got_result = true;
        } else if (id == 0) {
            record_error(c, "result field 0 of type %u", ftype);
            return STREAM_BROKEN;
        } else if (id >= 1 && id <= 4 && ftype == T_STRUCT) {
            char text[160];
            exception_text(&r, text, sizeof text, NULL);
            record_error(c, "%s: %s", DECLARED[id], text);
            refused = true;
        } else if (!skip(&r, ftype, 1)) {
            record_error(c, "unreadable field %d of type %u in the result", id, ftype);
            return STREAM_BROKEN;
        }
    }
    if (r.short_read) {
        record_error(c, "the reply ends inside its result");
        return STREAM_BROKEN;
    }
    if (r.p != r.end) {
        record_error(c, "%zu bytes after the result", (size_t)(r.end - r.p));
        return STREAM_BROKEN;
    }
    if (refused) {
        return REPLY_REFUSED;
    }
    if (!got_result) {
        record_error(c, "the reply has no result (field 0)");
        return REPLY_REFUSED;
    }
    return REPLY_OK;
}

/* Keeps an id for the uniqueness check across connections, as runs of consecutive ids. */
static void keep_id(struct conn *c, int64_t id) {
    if (c->nruns > 0 && c->runs[c->nruns - 1].last == id - 1) {
        c->runs[c->nruns - 1].last = id;
        return;
    }
    if (c->nruns == c->runs_limit) {
        c->ids_unchecked++;
        return;
    }
    if (c->nruns == c->runs_cap) {
        size_t cap = c->runs_cap ? c->runs_cap * 2 : 4096;
        if (cap > c->runs_limit) {
            cap = c->runs_limit;
        }
        struct id_run *grown = realloc(c->runs, cap * sizeof *grown);
        if (grown == NULL) {
            fatal("out of memory");
        }
        c->runs = grown;
        c->runs_cap = cap;
    }
    c->runs[c->nruns++] = (struct id_run){id, id};
}

/* One call, checked: false when the connection must stop; *nids is 0 when the server
 * refused the call (an error, counted), else the ids it handed out. */
static bool call(struct conn *c, uint64_t *latency_ns, size_t *nids) {
    c->call_number++;
    c->seqid = c->seqid == INT32_MAX ? 1 : c->seqid + 1;
    put_u32(c->request + c->seqid_at, (uint32_t)c->seqid);
    uint64_t t0 = now_ns();
    if (!send_all(c)) {
        return false;
    }
    enum outcome outcome = read_reply(c, nids);
    *latency_ns = now_ns() - t0;
    if (outcome == STREAM_BROKEN) {
        return false;
    }
    bool reported = false;
    for (size_t i = 0; i < *nids; i++) {
        int64_t id = id_at(c->ids_at, i);
        if (c->have_last && id <= c->last_id) {
            if (!reported) { /* one error per reply, not one per id */
                record_error(c, "id %" PRId64 " after %" PRId64 ": not increasing", id,
                             c->last_id);
                reported = true;
            }
            continue;
        }
        c->have_last = true;
        c->last_id = id;
        keep_id(c, id);
    }
    return true;
}

/* With --spread N: the connection keeps to a server process (told apart by the
 * datacenter and worker bits of its first id, Twitter's layout) that has fewer than
 * its share of the connections; else it reconnects. */
static bool spread_connection(struct conn *c) {
    int quota = opt.connections / opt.spread;
    for (int attempt = 0; attempt < SPREAD_ATTEMPTS; attempt++) {
        uint64_t latency;
        size_t nids;
        if (!call(c, &latency, &nids) || nids == 0) {
            return false;
        }
        int key = (int)((id_at(c->ids_at, 0) >> 12) & 0x3ff);
        bool mine = false;
        pthread_mutex_lock(&spread_lock);
        int slot = 0;
        while (slot < spread_nkeys && spread_keys[slot] != key) {
            slot++;
        }
        if (slot == spread_nkeys && spread_nkeys < opt.spread) {
            spread_keys[spread_nkeys++] = key;
        }
        if (slot < spread_nkeys && spread_taken[slot] < quota) {
            spread_taken[slot]++;
            mine = true;
        }
        pthread_mutex_unlock(&spread_lock);
        if (mine) {
            c->warmup_calls++;
            return true;
        }
        close(c->fd);
        /* Another process: its ids need not follow this one's, and the runs kept for
         * the uniqueness check must stay sorted, so the abandoned ids are dropped. */
        c->have_last = false;
        c->nruns = 0;
        c->fd = open_connection(true);
        if (c->fd < 0) {
            record_error(c, "reconnect to spread: %s", strerror(errno));
            return false;
        }
    }
    record_error(c, "no server process had room for this connection after %d connects "
                    "(--spread %d)", SPREAD_ATTEMPTS, opt.spread);
    return false;
}

static void *run_connection(void *arg) {
    struct conn *c = arg;
    c->fd = open_connection(true);
    bool ok = true;
    if (c->fd < 0) {
        record_error(c, "connect to %s:%d: %s", opt.host_text, opt.port, strerror(errno));
        ok = false;
    } else if (opt.spread > 1) {
        ok = spread_connection(c);
    }
    pthread_barrier_wait(&connected);
    pthread_barrier_wait(&started);
    while (ok) {
        uint64_t begin = now_ns();
        if (begin >= measure_end_ns) {
            break;
        }
        uint64_t latency;
        size_t nids;
        ok = call(c, &latency, &nids);
        if (!ok || nids == 0) { /* nids 0: refused, an error already counted */
            continue;
        }
        if (begin >= measure_start_ns) {
            c->calls++;
            c->ids += nids;
            hist_add(&c->hist, latency);
        } else {
            c->warmup_calls++;
        }
    }
    if (c->fd >= 0) {
        close(c->fd);
    }
    return NULL;
}

/* -- ids unique across connections ---------------------------------------------- */

/* Merges every connection's sorted runs (a heap of connections keyed by their next
 * run); an id in two runs was handed out twice.  Returns the ids seen twice. */
static uint64_t count_duplicates(struct conn *conns, int n, int64_t *first_duplicate) {
    int heap[MAX_CONNECTIONS];
    size_t pos[MAX_CONNECTIONS];
    int size = 0;
#define HEAD(i) (conns[heap[i]].runs[pos[heap[i]]].first)
    for (int i = 0; i < n; i++) {
        pos[i] = 0;
        if (conns[i].nruns == 0) {
            continue;
        }
        int at = size++;
        heap[at] = i;
        while (at > 0 && HEAD(at) < HEAD((at - 1) / 2)) {
            int parent = (at - 1) / 2, t = heap[at];
            heap[at] = heap[parent];
            heap[parent] = t;
            at = parent;
        }
    }
    uint64_t duplicates = 0;
    bool any = false;
    int64_t covered = 0; /* the highest id seen so far */
    while (size > 0) {
        struct conn *c = &conns[heap[0]];
        struct id_run run = c->runs[pos[heap[0]]];
        if (any && run.first <= covered) {
            int64_t end = run.last < covered ? run.last : covered;
            if (duplicates == 0) {
                *first_duplicate = run.first;
            }
            duplicates += (uint64_t)(end - run.first) + 1;
        }
        if (!any || run.last > covered) {
            covered = run.last;
        }
        any = true;
        if (++pos[heap[0]] == c->nruns) {
            heap[0] = heap[--size];
        }
        int at = 0;
        for (;;) { /* sift down */
            int left = 2 * at + 1, right = left + 1, least = at;
            if (left < size && HEAD(left) < HEAD(least)) {
                least = left;
            }
            if (right < size && HEAD(right) < HEAD(least)) {
                least = right;
            }
            if (least == at) {
                break;
            }
            int t = heap[at];
            heap[at] = heap[least];
            heap[least] = t;
            at = least;
        }
    }
#undef HEAD
    return duplicates;
}

/* -- idle connections ----------------------------------------------------------- */

static void raise_fd_limit(long needed) {
    struct rlimit limit;
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
        fatal("getrlimit: %s", strerror(errno));
    }
    if (limit.rlim_cur != RLIM_INFINITY && (long)limit.rlim_cur < needed) {
        limit.rlim_cur = limit.rlim_max; /* this process only: soft up to hard */
        if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
            fatal("setrlimit(RLIMIT_NOFILE): %s", strerror(errno));
        }
    }
    if (limit.rlim_cur != RLIM_INFINITY && (long)limit.rlim_cur < needed) {
        fprintf(stderr,
                "loadgen: %ld file descriptors needed, the hard limit is %llu: raise it "
                "(ulimit -Hn) or ask for fewer --idle connections\n",
                needed, (unsigned long long)limit.rlim_cur);
        exit(2);
    }
}

static int *open_idle(int n) {
    int *fds = calloc((size_t)(n > 0 ? n : 1), sizeof *fds);
    if (fds == NULL) {
        fatal("out of memory");
    }
    for (int i = 0; i < n; i++) {
        fds[i] = open_connection(false);
        if (fds[i] < 0) {
            fatal("idle connection %d of %d to %s:%d: %s", i + 1, n, opt.host_text, opt.port,
                  strerror(errno));
        }
    }
    return fds;
}

/* Idle connections the server closed (or wrote to) during the run; closes them all. */
static int close_idle(int *fds, int n) {
    int lost = 0;
    for (int i = 0; i < n; i++) {
        struct pollfd p = {.fd = fds[i], .events = POLLIN | POLLRDHUP};
        if (poll(&p, 1, 0) != 0) {
            lost++;
        }
        close(fds[i]);
    }
    free(fds);
    return lost;
}

/* -- flags ---------------------------------------------------------------------- */

static void usage(FILE *out) {
    fputs(
        "usage: loadgen --port PORT [options]\n"
        "\n"
        "Closed-loop load on a snowflake Thrift server (framed, strict binary) on loopback.\n"
        "\n"
        "  --host ADDR        server address in 127.0.0.0/8 (default 127.0.0.1)\n"
        "  --port PORT        server port (required)\n"
        "  --connections N    loaded connections, one thread each (1..1024, default 1)\n"
        "  --method NAME      get_id or get_ids (default get_id)\n"
        "  --count N          ids per get_ids call (1..1000000, default 4096)\n"
        "  --warmup S         seconds of calls before the measurement (0..600, default 0.5)\n"
        "  --duration S       seconds measured (0.05..600, default 2)\n"
        "  --idle N           extra connections opened first and kept open, silent\n"
        "                     (0..100000, default 0)\n"
        "  --spread N         spread the connections evenly over N server processes\n"
        "                     (told apart by worker id; Twitter's id layout)\n"
        "  --agent NAME       user agent sent with each call (default loadgen)\n"
        "  --timeout S        bound of each connect, send and receive (0.1..60, default 5)\n"
        "  --marks            print 'loadgen: measuring' and 'loadgen: measured' on stderr\n"
        "                     as the measured period starts and ends\n"
        "\n"
        "Prints one JSON object. Exit status: 0 clean, 1 any error, 2 bad flags.\n",
        out);
}

static void bad_flag(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void bad_flag(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    die(2, fmt, args);
}

static long parse_int(const char *flag, const char *text, long low, long high) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || v < low || v > high) {
        bad_flag("%s %s: expected a whole number in %ld..%ld", flag, text, low, high);
    }
    return v;
}

static double parse_seconds(const char *flag, const char *text, double low, double high) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !(v >= low && v <= high)) {
        bad_flag("%s %s: expected seconds in %g..%g", flag, text, low, high);
    }
    return v;
}

static void parse_flags(int argc, char **argv) {
    enum { HOST = 256, PORT, CONNECTIONS, METHOD, COUNT, WARMUP, DURATION, IDLE, SPREAD,
           AGENT, TIMEOUT, MARKS, HELP };
    static const struct option flags[] = {
        {"host", required_argument, NULL, HOST},
        {"port", required_argument, NULL, PORT},
        {"connections", required_argument, NULL, CONNECTIONS},
        {"method", required_argument, NULL, METHOD},
        {"count", required_argument, NULL, COUNT},
        {"warmup", required_argument, NULL, WARMUP},
        {"duration", required_argument, NULL, DURATION},
        {"idle", required_argument, NULL, IDLE},
        {"spread", required_argument, NULL, SPREAD},
        {"agent", required_argument, NULL, AGENT},
        {"timeout", required_argument, NULL, TIMEOUT},
        {"marks", no_argument, NULL, MARKS},
        {"help", no_argument, NULL, HELP},
        {NULL, 0, NULL, 0}};
    const char *host = "127.0.0.1";
    opterr = 0; /* our own messages */
    int flag;
    while ((flag = getopt_long(argc, argv, ":", flags, NULL)) != -1) {
        switch (flag) {
        case HOST: host = optarg; break;
        case PORT: opt.port = (int)parse_int("--port", optarg, 1, 65535); break;
        case CONNECTIONS:
            opt.connections = (int)parse_int("--connections", optarg, 1, MAX_CONNECTIONS);
            break;
        case METHOD:
            if (strcmp(optarg, "get_id") == 0) {
                opt.method = GET_ID;
            } else if (strcmp(optarg, "get_ids") == 0) {
                opt.method = GET_IDS;
            } else {
                bad_flag("--method %s: expected get_id or get_ids", optarg);
            }
            break;
        case COUNT: opt.count = (int)parse_int("--count", optarg, 1, 1000000); break;
        case WARMUP: opt.warmup_s = parse_seconds("--warmup", optarg, 0.0, MAX_SECONDS); break;
        case DURATION:
            opt.duration_s = parse_seconds("--duration", optarg, 0.05, MAX_SECONDS);
            break;
        case IDLE: opt.idle = (int)parse_int("--idle", optarg, 0, MAX_IDLE); break;
        case SPREAD: opt.spread = (int)parse_int("--spread", optarg, 0, MAX_CONNECTIONS); break;
        case AGENT:
            if (strlen(optarg) > 255) {
                bad_flag("--agent: at most 255 bytes");
            }
            opt.agent = optarg;
            break;
        case TIMEOUT: opt.timeout_s = parse_seconds("--timeout", optarg, 0.1, 60.0); break;
        case MARKS: opt.marks = true; break;
        case HELP: usage(stdout); exit(0);
        case ':': bad_flag("%s needs a value", argv[optind - 1]);
        default: bad_flag("unknown flag %s", argv[optind - 1]);
        }
    }
    if (optind < argc) {
        bad_flag("unexpected argument %s", argv[optind]);
    }
    if (opt.port == 0) {
        bad_flag("--port is required");
    }
    if (strcmp(host, "localhost") == 0) {
        host = "127.0.0.1";
    }
    if (inet_pton(AF_INET, host, &opt.host) != 1) {
        bad_flag("--host %s: expected an IPv4 address in 127.0.0.0/8", host);
    }
    if ((ntohl(opt.host.s_addr) >> 24) != 127) {
        bad_flag("--host %s: only loopback addresses (127.0.0.0/8): load never leaves this "
                 "machine", host);
    }
    inet_ntop(AF_INET, &opt.host, opt.host_text, sizeof opt.host_text);
    if (opt.spread > 1 && opt.connections % opt.spread != 0) {
        bad_flag("--spread %d: --connections %d must be a multiple of it", opt.spread,
                 opt.connections);
    }
    if (opt.method == GET_ID) {
        opt.count = 1;
    }
}

/* -- output --------------------------------------------------------------------- */

static void json_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            printf("\\%c", *p);
        } else if (*p < 0x20 || *p >= 0x7f) { /* bytes from the server: never invalid JSON */
            printf("\\u%04x", *p);
        } else {
            putchar(*p);
        }
    }
    putchar('"');
}

static void on_alarm(int signum) {
    (void)signum;
    static const char text[] = "loadgen: the run overran its time bound; stopping\n";
    ssize_t ignored = write(STDERR_FILENO, text, sizeof text - 1);
    (void)ignored;
    _exit(1);
}

static void mark(const char *what) {
    if (opt.marks) {
        fprintf(stderr, "loadgen: %s\n", what);
        fflush(stderr);
    }
}

int main(int argc, char **argv) {
    parse_flags(argc, argv);
    raise_fd_limit((long)opt.idle + opt.connections + 16);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGALRM, on_alarm);
    /* A generous bound on the whole run: idle connects, connects, warm-up, measurement,
     * one more call past the end, the uniqueness check. */
    alarm((unsigned)(opt.warmup_s + opt.duration_s + 3 * opt.timeout_s + 60.0 +
                     opt.idle / 100.0));

    int *idle = open_idle(opt.idle);
    struct conn *conns = calloc((size_t)opt.connections, sizeof *conns);
    if (conns == NULL) {
        fatal("out of memory");
    }
    pthread_barrier_init(&connected, NULL, (unsigned)opt.connections + 1);
    pthread_barrier_init(&started, NULL, (unsigned)opt.connections + 1);
    pthread_t *threads = calloc((size_t)opt.connections, sizeof *threads);
    if (threads == NULL) {
        fatal("out of memory");
    }
    pthread_attr_t attr; /* small stacks: up to 1024 threads, each with little on it */
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    for (int i = 0; i < opt.connections; i++) {
        struct conn *c = &conns[i];
        c->index = i;
        c->fd = -1;
        c->cap = 64 * 1024;
        c->buf = malloc(c->cap);
        c->runs_limit = MAX_ID_RUNS / (size_t)opt.connections;
        if (c->buf == NULL) {
            fatal("out of memory");
        }
        build_request(c);
        int rc = pthread_create(&threads[i], &attr, run_connection, c);
        if (rc != 0) {
            fatal("thread for connection %d: %s", i, strerror(rc));
        }
    }
    pthread_barrier_wait(&connected);
    uint64_t t0 = now_ns();
    measure_start_ns = t0 + (uint64_t)(opt.warmup_s * 1e9);
    measure_end_ns = measure_start_ns + (uint64_t)(opt.duration_s * 1e9);
    pthread_barrier_wait(&started);

    sleep_until(measure_start_ns);
    double cpu_before = cpu_seconds();
    mark("measuring");
    sleep_until(measure_end_ns);
    double cpu_after = cpu_seconds();
    mark("measured");
    for (int i = 0; i < opt.connections; i++) {
        pthread_join(threads[i], NULL);
    }
    int idle_lost = close_idle(idle, opt.idle);
    if (idle_lost > 0) {
        record_error(NULL, "%d of the %d idle connections were closed by the server",
                     idle_lost, opt.idle);
    }

    struct histogram *all = calloc(1, sizeof *all);
    if (all == NULL) {
        fatal("out of memory");
    }
    uint64_t calls = 0, ids = 0, warmup_calls = 0, unchecked = 0, kept = 0;
    for (int i = 0; i < opt.connections; i++) {
        hist_merge(all, &conns[i].hist);
        calls += conns[i].calls;
        ids += conns[i].ids;
        warmup_calls += conns[i].warmup_calls;
        unchecked += conns[i].ids_unchecked;
        for (size_t r = 0; r < conns[i].nruns; r++) {
            kept += (uint64_t)(conns[i].runs[r].last - conns[i].runs[r].first) + 1;
        }
    }
    int64_t first_duplicate = 0;
    uint64_t duplicates = count_duplicates(conns, opt.connections, &first_duplicate);
    if (duplicates > 0) {
        record_error(NULL, "%" PRIu64 " ids were handed out on more than one connection "
                           "(the first: %" PRId64 ")", duplicates, first_duplicate);
    }
    if (calls == 0 && atomic_load(&error_count) == 0) {
        record_error(NULL, "no call completed in the measured period");
    }

    double seconds = opt.duration_s;
    uint64_t errors = atomic_load(&error_count);
    printf("{\"method\": \"%s\", \"count\": %d, \"connections\": %d, \"idle\": %d, "
           "\"idle_kept\": %d, \"spread\": %d, \"warmup_s\": %.3f, \"seconds\": %.3f, "
           "\"calls\": %" PRIu64 ", \"ids\": %" PRIu64 ", \"warmup_calls\": %" PRIu64 ", "
           "\"calls_per_s\": %.1f, \"ids_per_s\": %.1f, ",
           METHOD_NAMES[opt.method], opt.count, opt.connections, opt.idle,
           opt.idle - idle_lost, opt.spread, opt.warmup_s, seconds, calls, ids, warmup_calls,
           (double)calls / seconds, (double)ids / seconds);
    printf("\"p50_us\": %.3f, \"p99_us\": %.3f, \"p999_us\": %.3f, \"max_us\": %.3f, "
           "\"mean_us\": %.3f, ",
           hist_percentile(all, 0.5) / 1e3, hist_percentile(all, 0.99) / 1e3,
           hist_percentile(all, 0.999) / 1e3, (double)all->max_ns / 1e3,
           all->count ? (double)all->total_ns / (double)all->count / 1e3 : 0.0);
    printf("\"client_cpu_s\": %.4f, \"client_cpu_us_per_call\": %.3f, ",
           cpu_after - cpu_before, calls ? (cpu_after - cpu_before) * 1e6 / (double)calls : 0.0);
    printf("\"ids_checked_unique\": %" PRIu64 ", \"ids_unchecked\": %" PRIu64 ", ", kept,
           unchecked);
    /* Which server process each connection ended on, by its last id's datacenter and
     * worker bits (Twitter's layout): how a multi-process server shared the load. */
    printf("\"connections_by_worker\": {");
    bool first = true;
    for (int key = 0; key < 1024; key++) {
        int n = 0;
        for (int i = 0; i < opt.connections; i++) {
            n += conns[i].have_last && (int)((conns[i].last_id >> 12) & 0x3ff) == key;
        }
        if (n > 0) {
            printf("%s\"%d/%d\": %d", first ? "" : ", ", key >> 5, key & 31, n);
            first = false;
        }
    }
    printf("}, \"errors\": %" PRIu64 ", \"first_errors\": [", errors);
    for (int i = 0; i < first_error_count + run_error_count; i++) {
        if (i) {
            fputs(", ", stdout);
        }
        json_string(i < first_error_count ? first_errors[i] : run_errors[i - first_error_count]);
    }
    printf("], \"histogram\": {\"buckets\": [");
    first = true;
    for (size_t i = 0; i < BUCKETS; i++) {
        if (all->buckets[i] != 0) {
            unsigned shift;
            printf("%s[%" PRIu64 ", %" PRIu64 "]", first ? "" : ", ", bucket_key(i, &shift),
                   all->buckets[i]);
            first = false;
        }
    }
    printf("], \"count\": %" PRIu64 ", \"total_ns\": %" PRIu64 ", \"max_ns\": %" PRIu64 "}}\n",
           all->count, all->total_ns, all->max_ns);
    fflush(stdout);
    return errors ? 1 : 0;
}
