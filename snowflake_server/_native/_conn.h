/* The native connection machine (issue 27, steps 3-4): connections Python adopted, each
 * owned by one native thread's level-triggered epoll loop, served natively while Python
 * grants the lease and forwarded to Python (events) otherwise. The contract is
 * notes/issue-27/native-api.md; _listener.c wraps this as _core.Listener. No Python here:
 * the generator's fast call comes in as a function pointer (sf_fast_fn).
 *
 * Locks (the only order any thread takes them in):
 *   sf_conn.mu  ->  the state's mutex (trylock only, inside the fast call: it never blocks,
 *                   at most SF_SPIN_NS of tries, so holding a connection's mutex across it
 *                   delays only commands for that one connection, by at most that)
 *               ->  sf_listener.ev_mu (the event queue) / sf_thread.audit_mu (its ring)
 *   sf_listener.slots_mu, start_mu, step_mu: never held with any other.
 * Every field of a connection is read and written under its mu, and every syscall on its fd
 * (read, send, epoll_ctl, shutdown, close) too; all are non-blocking, so mu is held briefly.
 * So any thread may run a command (write, close, abort, ...) while the owner thread loops.
 * An epoll event carries its connection's handle (slot | generation << 32): one whose
 * generation no longer matches, or whose fd is closed, is ignored.
 *
 * Native threads never take the GIL and never call Python.
 *
 * Every function is static: included by _listener.c only.
 */
#ifndef SNOWFLAKE_NATIVE_CONN_H
#define SNOWFLAKE_NATIVE_CONN_H

#include "_listener.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SF_NATIVE_READ 4096 /* one read() per connection per readiness: the fairness unit */
#define SF_IN_CAP (SF_NATIVE_READ + SF_NATIVE_MAX_FRAME)
#define SF_TICK_NS 100000000LL /* each thread's tick (readiness: ticks()) */
#define SF_MAX_EVENTS 256
#define SF_WAKE_KEY UINT64_MAX /* the thread's own eventfd in its epoll */
#define SF_FAST_SLOW ((int64_t)-1)
#define SF_FAST_CONTENDED ((int64_t)-2)
#define SF_FAST_SPIN_NS 20000

enum { SF_EV_DATA = 1, SF_EV_WRITABLE = 2, SF_EV_LOST = 3, SF_EV_THREAD_DIED = 4, SF_EV_EOF = 5 };

/* The generator's fast call: an id, SF_FAST_SLOW or SF_FAST_CONTENDED; on SLOW *gate says
 * the gate was closed (or the state sealed), on an id *time_ms is its ms. */
typedef int64_t (*sf_fast_fn)(void *state, int64_t spin_ns, int *gate, int64_t *time_ms);

typedef struct sf_event {
    struct sf_event *next;
    int kind;
    uint64_t handle; /* the connection's, or the thread's index for SF_EV_THREAD_DIED */
    int64_t value;   /* writable (0/1) or an errno */
    size_t len;
    uint8_t data[];
} sf_event;

typedef struct {
    int64_t id;
    int64_t time_ms;
    uint32_t agent;
} sf_audit_entry;

typedef struct {
    pthread_mutex_t mu;
    uint32_t slot;
    uint32_t gen; /* changes only at free, under mu */
    int in_use;   /* adopted and not yet freed */
    int fd;       /* -1 once closed */
    int thread;   /* the owner */
    int leased, reading, closing, lost, writable;
    int hup;                   /* epoll said ERR/HUP: out of epoll while nothing is wanted */
    int eof;                   /* the peer sent its last byte: nothing more is read */
    int registered;            /* in the owner's epoll */
    uint32_t mask;             /* the events registered */
    uint8_t *in;               /* SF_IN_CAP bytes; leased: at most one partial frame kept */
    size_t in_len;
    uint8_t *out;              /* every reply, native's and Python's, in order */
    size_t out_off, out_len, out_cap;
    uint64_t forwarded, consumed, served;
    int read_seen;
    const sf_agent *last_agent; /* registry entries never move or change */
} sf_conn;

struct sf_listener;

typedef struct {
    struct sf_listener *l;
    int index;
    int epfd, wakefd;
    pthread_t tid;
    int started;              /* created by start() and not joined yet */
    _Atomic int dead;         /* its epoll_wait failed: it left */
    int ticking;              /* threads mode: the 100 ms tick */
    int64_t next_tick_ns;     /* the owner's only */
    _Atomic int64_t turn_ns;  /* when its loop last turned */
    _Atomic int64_t late_max_ns;
    sf_thread_stats *stats;
    pthread_mutex_t audit_mu;
    sf_audit_entry *audit;
    size_t audit_len, audit_cap;
    uint8_t rbuf[SF_NATIVE_READ]; /* leaseless reads */
} sf_thread;

typedef struct sf_listener {
    int nthreads; /* thread structs: max(1, threads) */
    int step_mode;
    sf_thread *threads;
    /* Slots: sf_conn structs allocated on first use and kept (their mutexes too) until the
     * listener is freed, so a stale handle never touches freed memory. */
    _Atomic(sf_conn *) *slots;
    uint32_t max_conns;
    pthread_mutex_t slots_mu;
    uint32_t *free_slots, free_top, next_unused, rr;
    /* The event queue: a singly linked list; evfd written on empty -> non-empty. */
    pthread_mutex_t ev_mu;
    sf_event *ev_head, *ev_tail;
    int evfd;
    _Atomic(void *) state;
    sf_fast_fn fast;
    sf_registry *registry;
    sf_audit_budget *budget;
    int64_t limit;
    size_t high, low, forward_high;
    _Atomic int stopping;
    _Atomic int stopped; /* read by adopt and step while stop runs without the GIL */
    pthread_mutex_t step_mu;
    pthread_mutex_t start_mu;
    pthread_cond_t start_cv;
    int start_go, start_abort;
} sf_listener;

static inline int64_t
sf_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline uint64_t
sf_handle(const sf_conn *c)
{
    return (uint64_t)c->slot | ((uint64_t)c->gen << 32);
}

/* ---- events ------------------------------------------------------------------------ */

static void
sf_ev_post(sf_listener *l, int kind, uint64_t handle, int64_t value, const uint8_t *data,
           size_t len)
{
    sf_event *e = malloc(sizeof *e + (len ? len : 1));
    if (e == NULL) {
        /* Out of memory with bytes of a stream in hand: dropping them would corrupt the
         * stream (replies out of order, a request lost), and there is no safe way on. */
        fputs("snowflake native listener: out of memory posting an event\n", stderr);
        abort();
    }
    e->next = NULL;
    e->kind = kind;
    e->handle = handle;
    e->value = value;
    e->len = len;
    if (len) {
        memcpy(e->data, data, len);
    }
    pthread_mutex_lock(&l->ev_mu);
    if (l->ev_tail == NULL) {
        l->ev_head = l->ev_tail = e;
        uint64_t one = 1;
        ssize_t w = write(l->evfd, &one, sizeof one);
        (void)w; /* an eventfd's counter cannot overflow from ones taken each time */
    } else {
        l->ev_tail->next = e;
        l->ev_tail = e;
    }
    pthread_mutex_unlock(&l->ev_mu);
}

/* Every queued event, oldest first (the caller frees each). */
static sf_event *
sf_ev_take(sf_listener *l)
{
    pthread_mutex_lock(&l->ev_mu);
    sf_event *e = l->ev_head;
    l->ev_head = l->ev_tail = NULL;
    uint64_t v;
    ssize_t r = read(l->evfd, &v, sizeof v);
    (void)r; /* EAGAIN: nothing was queued */
    pthread_mutex_unlock(&l->ev_mu);
    return e;
}

/* Put taken events back in front of any queued since, oldest first: the caller could not
 * hand them over (out of memory building the list) and an event lost would be a stream
 * corrupted or a connection never freed. */
static void
sf_ev_untake(sf_listener *l, sf_event *taken)
{
    if (taken == NULL) {
        return;
    }
    sf_event *last = taken;
    while (last->next != NULL) {
        last = last->next;
    }
    pthread_mutex_lock(&l->ev_mu);
    last->next = l->ev_head;
    if (l->ev_tail == NULL) {
        l->ev_tail = last;
    }
    l->ev_head = taken;
    uint64_t one = 1;
    ssize_t w = write(l->evfd, &one, sizeof one);
    (void)w; /* readable again: Python retries on its next turn */
    pthread_mutex_unlock(&l->ev_mu);
}

/* ---- one connection (its mu held) ----------------------------------------------------- */

static void
sf_conn_update(sf_listener *l, sf_conn *c)
{
    if (c->fd < 0) {
        return;
    }
    uint32_t want = 0;
    int under = c->leased ? c->out_len <= l->high
                          : c->consumed >= c->forwarded ||
                                c->forwarded - c->consumed <= l->forward_high;
    if (!c->closing && !c->eof && c->reading && under) {
        want |= EPOLLIN;
    }
    if (c->out_len) {
        want |= EPOLLOUT;
    }
    int epfd = l->threads[c->thread].epfd;
    struct epoll_event e = {.events = want, .data.u64 = sf_handle(c)};
    if (want == 0 && c->hup) {
        /* ERR/HUP are reported whatever the mask: level-triggered, they would turn the
         * loop forever. Out of epoll until a command wants something again. */
        if (c->registered && epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL) == 0) {
            c->registered = 0;
        }
        c->mask = 0;
        return;
    }
    if (!c->registered) {
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, c->fd, &e) == 0) {
            c->registered = 1;
            c->mask = want;
        }
    } else if (want != c->mask && epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &e) == 0) {
        c->mask = want;
    }
}

static void
sf_conn_close_fd(sf_listener *l, sf_conn *c, int linger0)
{
    if (c->fd < 0) {
        return;
    }
    if (c->registered) {
        epoll_ctl(l->threads[c->thread].epfd, EPOLL_CTL_DEL, c->fd, NULL);
        c->registered = 0;
    }
    if (linger0) {
        /* As asyncio's abort: unsent bytes dropped, the peer gets a reset. */
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    close(c->fd);
    c->fd = -1;
    c->mask = 0;
    c->leased = 0;
    c->in_len = 0;
    c->out_off = c->out_len = 0;
}

static int
sf_out_reserve(sf_conn *c, size_t n)
{
    if (c->out_off + c->out_len + n <= c->out_cap) {
        return 0;
    }
    if (c->out_off && c->out_off >= c->out_len) {
        /* Compact when what moves is no more than what was sent since. */
        memmove(c->out, c->out + c->out_off, c->out_len);
        c->out_off = 0;
        if (c->out_len + n <= c->out_cap) {
            return 0;
        }
    }
    size_t need = c->out_off + c->out_len + n;
    size_t cap = c->out_cap ? c->out_cap : 4096;
    while (cap < need) {
        cap *= 2;
    }
    uint8_t *p = realloc(c->out, cap);
    if (p == NULL) {
        return -1;
    }
    c->out = p;
    c->out_cap = cap;
    return 0;
}

/* Sends what it can of out; 0, or the errno of a send that failed. */
static int
sf_conn_flush(sf_listener *l, sf_conn *c)
{
    while (c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                break;
            }
            return errno;
        }
        c->out_off += (size_t)n;
        c->out_len -= (size_t)n;
    }
    if (c->out_len == 0) {
        c->out_off = 0;
        if (c->out_cap > (1u << 20)) { /* a burst's buffer is not kept for life */
            free(c->out);
            c->out = NULL;
            c->out_cap = 0;
        }
    }
    if (!c->writable && c->out_len <= l->low) {
        c->writable = 1;
        sf_ev_post(l, SF_EV_WRITABLE, sf_handle(c), 1, NULL, 0);
    }
    return 0;
}

/* The lease back to Python at in[pos:]: those bytes as EV_DATA (after every reply to the
 * frames before pos, already in out). reason < 0: not a handoff (EOF, revoke). */
static void
sf_give_back(sf_listener *l, sf_thread *th, sf_conn *c, size_t pos, int reason)
{
    c->leased = 0;
    size_t n = c->in_len - pos;
    if (n) {
        sf_ev_post(l, SF_EV_DATA, sf_handle(c), 0, c->in + pos, n);
        c->forwarded += n;
    }
    c->in_len = 0;
    if (reason >= 0 && th != NULL) {
        sf_stats_handoff(th->stats, (sf_handoff)reason);
    }
}

/* A failed read or send (err: its errno): the lease given back (its partial frame to
 * Python), the fd closed, EV_LOST. */
static void
sf_conn_hangup(sf_listener *l, sf_conn *c, int err)
{
    if (c->leased) {
        sf_give_back(l, NULL, c, 0, -1);
    }
    sf_conn_close_fd(l, c, 0);
    c->lost = 1;
    sf_ev_post(l, SF_EV_LOST, sf_handle(c), err, NULL, 0);
}

/* The peer half-closed: the lease given back (its partial frame to Python), nothing more
 * read, EV_EOF. The connection stays open, as an asyncio transport does until its
 * protocol answers eof_received: Python serves what it received, then closes. */
static void
sf_conn_eof(sf_listener *l, sf_conn *c)
{
    if (c->leased) {
        sf_give_back(l, NULL, c, 0, -1);
    }
    c->eof = 1;
    sf_ev_post(l, SF_EV_EOF, sf_handle(c), 0, NULL, 0);
}

static void
sf_conn_finish_close(sf_listener *l, sf_conn *c)
{
    shutdown(c->fd, SHUT_WR);
    sf_conn_close_fd(l, c, 0);
    c->lost = 1;
    sf_ev_post(l, SF_EV_LOST, sf_handle(c), 0, NULL, 0);
}

static void
sf_audit_add(sf_listener *l, sf_thread *th, int64_t id, int64_t time_ms, uint32_t agent)
{
    if (l->budget == NULL || !sf_audit_reserve(l->budget, 1)) {
        return; /* a refused reservation counted itself as dropped */
    }
    pthread_mutex_lock(&th->audit_mu);
    if (th->audit_len == th->audit_cap) {
        size_t cap = th->audit_cap ? th->audit_cap * 2 : 256;
        sf_audit_entry *p = realloc(th->audit, cap * sizeof *p);
        if (p == NULL) {
            pthread_mutex_unlock(&th->audit_mu);
            sf_audit_drop(l->budget, 1);
            sf_audit_release(l->budget, 1);
            return;
        }
        th->audit = p;
        th->audit_cap = cap;
    }
    th->audit[th->audit_len++] = (sf_audit_entry){id, time_ms, agent};
    pthread_mutex_unlock(&th->audit_mu);
}

/* Leased: every whole frame in `in` answered or the rest given back; a partial frame kept. */
static void
sf_serve_frames(sf_listener *l, sf_thread *th, sf_conn *c, int64_t t_read)
{
    void *state = atomic_load_explicit(&l->state, memory_order_acquire);
    size_t pos = 0;
    for (;;) {
        sf_frame m;
        sf_scan_result r = sf_scan_prefix(c->in + pos, c->in_len - pos, l->limit, &m);
        if (r == SF_NEED_MORE) {
            break;
        }
        if (r == SF_HANDOVER) {
            sf_give_back(l, th, c, pos,
                         m.why == SF_WHY_LENGTH ? SF_HANDOFF_LENGTH : SF_HANDOFF_REQUEST);
            return;
        }
        const uint8_t *agent = c->in + pos + m.agent_at;
        const sf_agent *a = c->last_agent;
        if (a == NULL || a->len != m.agent_len || memcmp(a->bytes, agent, m.agent_len) != 0) {
            a = sf_registry_lookup(l->registry, agent, m.agent_len);
            if (a == NULL) {
                sf_give_back(l, th, c, pos, SF_HANDOFF_AGENT);
                return;
            }
            c->last_agent = a;
        }
        if (state == NULL) {
            sf_give_back(l, th, c, pos, SF_HANDOFF_GATE);
            return;
        }
        /* Room first: an id taken and not sent would be wasted (never repeated, though). */
        if (sf_out_reserve(c, SF_REPLY_LEN) < 0) {
            sf_stats_internal_error(th->stats);
            sf_give_back(l, th, c, pos, SF_HANDOFF_SLOW);
            return;
        }
        int gate = 0;
        int64_t time_ms = 0;
        int64_t id = l->fast(state, SF_FAST_SPIN_NS, &gate, &time_ms);
        if (id < 0) {
            sf_give_back(l, th, c, pos,
                         id == SF_FAST_CONTENDED ? SF_HANDOFF_CONTENDED
                         : gate                  ? SF_HANDOFF_GATE
                                                 : SF_HANDOFF_SLOW);
            return;
        }
        sf_get_id_reply(c->out + c->out_off + c->out_len, m.seqid, id);
        c->out_len += SF_REPLY_LEN;
        c->served++;
        int64_t now = sf_now_ns();
        sf_stats_call(th->stats, a->index, (uint64_t)(now > t_read ? now - t_read : 0));
        sf_audit_add(l, th, id, time_ms, a->index);
        pos += m.frame_len;
    }
    if (pos) {
        memmove(c->in, c->in + pos, c->in_len - pos);
        c->in_len -= pos;
    }
}

static void
sf_conn_read(sf_listener *l, sf_thread *th, sf_conn *c)
{
    uint8_t *dst = c->leased ? c->in + c->in_len : th->rbuf;
    ssize_t n = read(c->fd, dst, SF_NATIVE_READ);
    if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            sf_conn_hangup(l, c, errno);
        }
        return;
    }
    if (n == 0) {
        sf_conn_eof(l, c);
        return;
    }
    c->read_seen = 1;
    if (!c->leased) {
        sf_ev_post(l, SF_EV_DATA, sf_handle(c), 0, th->rbuf, (size_t)n);
        c->forwarded += (size_t)n;
        return;
    }
    c->in_len += (size_t)n;
    sf_serve_frames(l, th, c, sf_now_ns());
    if (c->out_len) {
        int err = sf_conn_flush(l, c);
        if (err) {
            sf_conn_hangup(l, c, err);
            return;
        }
    }
    if (c->writable && c->out_len > l->high) {
        c->writable = 0;
        sf_ev_post(l, SF_EV_WRITABLE, sf_handle(c), 0, NULL, 0);
    }
}

/* The connection of a handle, or NULL; not locked, not checked: lock mu, then
 * sf_conn_valid. */
static inline sf_conn *
sf_conn_find(sf_listener *l, uint64_t handle)
{
    uint32_t slot = (uint32_t)(handle & 0xffffffffu);
    if (slot >= l->max_conns) {
        return NULL;
    }
    return atomic_load_explicit(&l->slots[slot], memory_order_acquire);
}

static inline int
sf_conn_valid(const sf_conn *c, uint64_t handle)
{
    return c->in_use && c->gen == (uint32_t)(handle >> 32);
}

static void
sf_conn_event(sf_listener *l, sf_thread *th, uint64_t key, uint32_t ev)
{
    sf_conn *c = sf_conn_find(l, key);
    if (c == NULL) {
        return;
    }
    pthread_mutex_lock(&c->mu);
    if (!sf_conn_valid(c, key) || c->fd < 0) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    if (ev & (EPOLLERR | EPOLLHUP)) {
        c->hup = 1;
    }
    if (c->out_len && (ev & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
        int err = sf_conn_flush(l, c);
        if (err) {
            sf_conn_hangup(l, c, err);
            goto done;
        }
    }
    if (c->closing) {
        if (c->out_len == 0) {
            sf_conn_finish_close(l, c);
        }
        goto done;
    }
    if ((c->mask & EPOLLIN) && (ev & (EPOLLIN | EPOLLERR | EPOLLHUP))) {
        sf_conn_read(l, th, c);
    }
done:
    sf_conn_update(l, c);
    pthread_mutex_unlock(&c->mu);
}

/* ---- commands (the connection's mu held, sf_conn_valid) --------------------------------- */

/* Appends data after every earlier reply; sends at once if out was empty. Returns out's
 * unsent bytes after it; *paused: this write took out past high from at or below it. */
static size_t
sf_cmd_write(sf_listener *l, sf_conn *c, const uint8_t *data, size_t len, int *paused)
{
    *paused = 0;
    if (c->fd < 0 || c->closing || c->lost) {
        return 0;
    }
    size_t sent = 0;
    if (c->out_len == 0) {
        while (sent < len) {
            ssize_t n = send(c->fd, data + sent, len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0) {
                if (errno == EINTR) {
                    continue;
                }
                if (errno == EAGAIN || errno == EWOULDBLOCK) {
                    break;
                }
                sf_conn_hangup(l, c, errno);
                return 0;
            }
            sent += (size_t)n;
        }
    }
    if (sent < len) {
        if (sf_out_reserve(c, len - sent) < 0) {
            /* No memory for the rest of a reply: the stream cannot go on whole. */
            sf_conn_hangup(l, c, ENOMEM);
            return 0;
        }
        memcpy(c->out + c->out_off + c->out_len, data + sent, len - sent);
        c->out_len += len - sent;
    }
    if (c->writable && c->out_len > l->high) {
        c->writable = 0;
        *paused = 1;
    }
    sf_conn_update(l, c);
    return c->out_len;
}

static int
sf_cmd_grant(sf_listener *l, sf_conn *c, uint64_t consumed, const uint8_t *prefix, size_t n)
{
    if (consumed > c->consumed) {
        c->consumed = consumed;
    }
    /* prefix: the start of a frame Python received and cannot answer yet (a client whose
     * writes end mid-frame): native keeps it as the lease's partial frame, if it could
     * lead to a frame native serves; its bytes, given back, are forwarded again. */
    int held;
    sf_frame m;
    if (n && (c->leased || n > SF_NATIVE_MAX_FRAME ||
              sf_scan_prefix(prefix, n, l->limit, &m) != SF_NEED_MORE)) {
        held = 0;
    } else if (!c->leased && c->fd >= 0 && !c->closing && !c->lost && !c->eof &&
               consumed == c->forwarded && c->in_len == 0) {
        c->leased = 1;
        if (n) {
            memcpy(c->in, prefix, n);
            c->in_len = n;
        }
        held = 1;
    } else {
        held = c->leased && consumed == c->forwarded && n == 0;
    }
    /* Granted or not, the count it recorded may let a stopped connection be read again. */
    sf_conn_update(l, c);
    return held;
}

static void
sf_cmd_revoke(sf_listener *l, sf_conn *c)
{
    if (c->leased) {
        sf_give_back(l, NULL, c, 0, -1);
        sf_conn_update(l, c);
    }
}

static void
sf_cmd_consume(sf_listener *l, sf_conn *c, uint64_t consumed)
{
    if (consumed > c->consumed) {
        c->consumed = consumed;
    }
    sf_conn_update(l, c);
}

static void
sf_cmd_reading(sf_listener *l, sf_conn *c, int on)
{
    c->reading = on;
    sf_conn_update(l, c);
}

static void
sf_cmd_close(sf_listener *l, sf_conn *c)
{
    if (c->fd < 0 || c->closing) {
        return;
    }
    c->closing = 1;
    c->leased = 0;
    c->in_len = 0; /* a kept partial frame is dropped, not posted */
    if (c->out_len == 0) {
        sf_conn_finish_close(l, c);
    } else {
        sf_conn_update(l, c);
    }
}

static void
sf_cmd_abort(sf_listener *l, sf_conn *c)
{
    if (c->fd < 0) {
        return;
    }
    sf_conn_close_fd(l, c, 1);
    c->lost = 1;
    sf_ev_post(l, SF_EV_LOST, sf_handle(c), 0, NULL, 0);
}

/* The slot free for reuse under a new generation (unlock mu, then sf_slot_release). */
static void
sf_cmd_free(sf_listener *l, sf_conn *c)
{
    sf_conn_close_fd(l, c, 1); /* freed before its EV_LOST: no event, as after stop */
    c->in_use = 0;
    c->gen = c->gen == UINT32_MAX ? 1 : c->gen + 1;
    c->last_agent = NULL;
}

static void
sf_slot_release(sf_listener *l, uint32_t slot)
{
    pthread_mutex_lock(&l->slots_mu);
    l->free_slots[l->free_top++] = slot;
    pthread_mutex_unlock(&l->slots_mu);
}

/* ---- adopt ----------------------------------------------------------------------------- */

/* A handle, or -errno (the fd is closed then: it was the listener's from the call on). */
static int64_t
sf_adopt(sf_listener *l, int fd)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        int err = errno;
        close(fd);
        return -err;
    }
    pthread_mutex_lock(&l->slots_mu);
    int thread = -1;
    for (int k = 0; k < l->nthreads; k++) {
        int t = (int)((l->rr + (uint32_t)k) % (uint32_t)l->nthreads);
        if (!atomic_load_explicit(&l->threads[t].dead, memory_order_relaxed)) {
            thread = t;
            break;
        }
    }
    if (thread >= 0) {
        l->rr = (uint32_t)thread + 1;
    }
    uint32_t slot = UINT32_MAX;
    sf_conn *c = NULL;
    int err = 0;
    if (thread < 0) {
        err = EIO;
    } else if (l->free_top) {
        slot = l->free_slots[--l->free_top];
        c = atomic_load_explicit(&l->slots[slot], memory_order_relaxed);
    } else if (l->next_unused < l->max_conns) {
        c = calloc(1, sizeof *c);
        if (c == NULL || pthread_mutex_init(&c->mu, NULL) != 0 ||
            (c->in = malloc(SF_IN_CAP)) == NULL) {
            if (c != NULL) {
                free(c);
            }
            c = NULL;
            err = ENOMEM;
        } else {
            slot = l->next_unused++;
            c->slot = slot;
            c->gen = 1;
            c->fd = -1;
            atomic_store_explicit(&l->slots[slot], c, memory_order_release);
        }
    } else {
        err = EMFILE; /* every slot taken */
    }
    pthread_mutex_unlock(&l->slots_mu);
    if (c == NULL) {
        close(fd);
        return -(err ? err : ENOMEM);
    }
    pthread_mutex_lock(&c->mu);
    c->in_use = 1;
    c->fd = fd;
    c->thread = thread;
    c->leased = c->reading = c->closing = c->lost = c->hup = c->eof = 0;
    c->writable = 1;
    c->registered = 0;
    c->mask = 0;
    c->in_len = 0;
    c->out_off = c->out_len = 0;
    c->forwarded = c->consumed = c->served = 0;
    c->read_seen = 0;
    c->last_agent = NULL;
    uint64_t handle = sf_handle(c);
    struct epoll_event e = {.events = 0, .data.u64 = handle};
    if (epoll_ctl(l->threads[thread].epfd, EPOLL_CTL_ADD, fd, &e) < 0) {
        err = errno;
        goto unadopt;
    }
    c->registered = 1;
    if (atomic_load_explicit(&l->threads[thread].dead, memory_order_acquire)) {
        /* Its thread died since it was chosen, and its sweep of the connections may have
         * passed this slot before it was in use: nobody would serve it. The sweep stores
         * dead before it takes slots_mu or any connection's mu, both of which this
         * adoption took after, so a death it missed is seen here. */
        epoll_ctl(l->threads[thread].epfd, EPOLL_CTL_DEL, fd, NULL);
        c->registered = 0;
        err = EIO;
        goto unadopt;
    }
    pthread_mutex_unlock(&c->mu);
    return (int64_t)handle;

unadopt: /* the slot free again, the fd closed (adopt owns it from the call on) */
    c->fd = -1;
    c->in_use = 0;
    pthread_mutex_unlock(&c->mu);
    close(fd);
    sf_slot_release(l, slot);
    return -err;
}

/* ---- the loop ------------------------------------------------------------------------- */

/* One iteration of thread th's loop: one epoll_wait, then the work for what it returned.
 * The number of epoll events handled, or -errno of a failed epoll_wait. */
static int
sf_loop_once(sf_listener *l, sf_thread *th, int timeout_ms)
{
    struct epoll_event evs[SF_MAX_EVENTS];
    int n = epoll_wait(th->epfd, evs, SF_MAX_EVENTS, timeout_ms);
    if (n < 0) {
        return errno == EINTR ? 0 : -errno;
    }
    int64_t now = sf_now_ns();
    atomic_store_explicit(&th->turn_ns, now, memory_order_relaxed);
    if (th->ticking && now >= th->next_tick_ns) {
        int64_t late = now - th->next_tick_ns;
        int64_t seen = atomic_load_explicit(&th->late_max_ns, memory_order_relaxed);
        while (late > seen && !atomic_compare_exchange_weak_explicit(
                                  &th->late_max_ns, &seen, late, memory_order_relaxed,
                                  memory_order_relaxed)) {
        }
        th->next_tick_ns += SF_TICK_NS;
        if (th->next_tick_ns <= now) {
            th->next_tick_ns = now + SF_TICK_NS;
        }
    }
    for (int i = 0; i < n; i++) {
        if (evs[i].data.u64 == SF_WAKE_KEY) {
            uint64_t v;
            ssize_t r = read(th->wakefd, &v, sizeof v);
            (void)r;
            continue;
        }
        sf_conn_event(l, th, evs[i].data.u64, evs[i].events);
    }
    return n;
}

/* Its epoll failed: its connections are aborted (EV_LOST each), then EV_THREAD_DIED. */
static void
sf_thread_died(sf_listener *l, sf_thread *th, int err)
{
    atomic_store_explicit(&th->dead, 1, memory_order_relaxed);
    pthread_mutex_lock(&l->slots_mu);
    uint32_t used = l->next_unused;
    pthread_mutex_unlock(&l->slots_mu);
    for (uint32_t i = 0; i < used; i++) {
        sf_conn *c = atomic_load_explicit(&l->slots[i], memory_order_acquire);
        if (c == NULL) {
            continue;
        }
        pthread_mutex_lock(&c->mu);
        if (c->in_use && c->thread == th->index && c->fd >= 0) {
            sf_conn_close_fd(l, c, 1);
            c->lost = 1;
            sf_ev_post(l, SF_EV_LOST, sf_handle(c), err, NULL, 0);
        }
        pthread_mutex_unlock(&c->mu);
    }
    sf_ev_post(l, SF_EV_THREAD_DIED, (uint64_t)th->index, err, NULL, 0);
}

static void *
sf_thread_main(void *arg)
{
    sf_thread *th = arg;
    sf_listener *l = th->l;
    pthread_mutex_lock(&l->start_mu);
    while (!l->start_go && !l->start_abort) {
        pthread_cond_wait(&l->start_cv, &l->start_mu);
    }
    int go = l->start_go && !l->start_abort;
    pthread_mutex_unlock(&l->start_mu);
    if (!go) {
        return NULL;
    }
    th->next_tick_ns = sf_now_ns() + SF_TICK_NS;
    while (!atomic_load_explicit(&l->stopping, memory_order_acquire)) {
        int64_t wait = th->next_tick_ns - sf_now_ns();
        int timeout = wait <= 0 ? 0 : (int)((wait + 999999) / 1000000);
        int r = sf_loop_once(l, th, timeout);
        if (r < 0) {
            sf_thread_died(l, th, -r);
            break;
        }
    }
    return NULL;
}

/* A test seam (_core.fail_thread_start): the next start() fails to create this thread. */
static int sf_fail_thread_start = -1;

/* Starts every thread, held until all are: 0, or the errno of the one that could not start
 * (those that did are joined then, none left running). */
static int
sf_start(sf_listener *l)
{
    int fail = sf_fail_thread_start;
    sf_fail_thread_start = -1;
    l->start_go = l->start_abort = 0;
    for (int i = 0; i < l->nthreads; i++) {
        sf_thread *th = &l->threads[i];
        th->ticking = 1;
        int err = i == fail ? EAGAIN : pthread_create(&th->tid, NULL, sf_thread_main, th);
        if (err) {
            pthread_mutex_lock(&l->start_mu);
            l->start_abort = 1;
            pthread_cond_broadcast(&l->start_cv);
            pthread_mutex_unlock(&l->start_mu);
            for (int k = 0; k < i; k++) {
                pthread_join(l->threads[k].tid, NULL);
                l->threads[k].started = 0;
            }
            return err;
        }
        th->started = 1;
    }
    int64_t now = sf_now_ns();
    for (int i = 0; i < l->nthreads; i++) {
        atomic_store_explicit(&l->threads[i].turn_ns, now, memory_order_relaxed);
    }
    pthread_mutex_lock(&l->start_mu);
    l->start_go = 1;
    pthread_cond_broadcast(&l->start_cv);
    pthread_mutex_unlock(&l->start_mu);
    return 0;
}

/* Stops and joins every thread (by deadline_ns on CLOCK_REALTIME: pthread_timedjoin_np's),
 * then closes every connection left and frees its slot (no event). 1 if all joined; 0
 * leaves the connections alone (a thread still runs over them). */
static int
sf_stop(sf_listener *l, const struct timespec *deadline)
{
    atomic_store_explicit(&l->stopping, 1, memory_order_release);
    int joined = 1;
    for (int i = 0; i < l->nthreads; i++) {
        sf_thread *th = &l->threads[i];
        if (th->started) {
            uint64_t one = 1;
            ssize_t w = write(th->wakefd, &one, sizeof one);
            (void)w;
        }
    }
    for (int i = 0; i < l->nthreads; i++) {
        sf_thread *th = &l->threads[i];
        if (!th->started) {
            continue;
        }
        if (pthread_timedjoin_np(th->tid, NULL, deadline) == 0) {
            th->started = 0;
        } else {
            joined = 0;
        }
    }
    if (!joined) {
        return 0;
    }
    if (!l->stopped) {
        pthread_mutex_lock(&l->slots_mu);
        uint32_t used = l->next_unused;
        pthread_mutex_unlock(&l->slots_mu);
        for (uint32_t i = 0; i < used; i++) {
            sf_conn *c = atomic_load_explicit(&l->slots[i], memory_order_acquire);
            pthread_mutex_lock(&c->mu);
            int was = c->in_use;
            if (was) {
                sf_conn_close_fd(l, c, 0);
                c->in_use = 0;
                c->gen = c->gen == UINT32_MAX ? 1 : c->gen + 1;
                c->last_agent = NULL;
            }
            pthread_mutex_unlock(&c->mu);
            if (was) {
                sf_slot_release(l, i);
            }
        }
        l->stopped = 1;
    }
    return 1;
}

/* A listener with threads thread structs (max(1, threads)); NULL and errno on failure. */
static sf_listener *
sf_listener_new(int threads, uint32_t max_conns, sf_thread_stats *stats)
{
    sf_listener *l = calloc(1, sizeof *l);
    if (l == NULL) {
        return NULL;
    }
    l->step_mode = threads == 0;
    l->nthreads = threads ? threads : 1;
    l->max_conns = max_conns;
    l->evfd = -1;
    l->threads = calloc((size_t)l->nthreads, sizeof *l->threads);
    l->slots = calloc(max_conns, sizeof *l->slots);
    l->free_slots = calloc(max_conns, sizeof *l->free_slots);
    if (l->threads == NULL || l->slots == NULL || l->free_slots == NULL) {
        goto fail;
    }
    for (int i = 0; i < l->nthreads; i++) {
        l->threads[i].epfd = l->threads[i].wakefd = -1;
    }
    pthread_mutex_init(&l->slots_mu, NULL);
    pthread_mutex_init(&l->ev_mu, NULL);
    pthread_mutex_init(&l->step_mu, NULL);
    pthread_mutex_init(&l->start_mu, NULL);
    pthread_cond_init(&l->start_cv, NULL);
    if ((l->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        goto fail;
    }
    int64_t now = sf_now_ns();
    for (int i = 0; i < l->nthreads; i++) {
        sf_thread *th = &l->threads[i];
        th->l = l;
        th->index = i;
        th->stats = &stats[i];
        pthread_mutex_init(&th->audit_mu, NULL);
        atomic_init(&th->turn_ns, now);
        atomic_init(&th->late_max_ns, 0);
        if ((th->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
            (th->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
            goto fail;
        }
        struct epoll_event e = {.events = EPOLLIN, .data.u64 = SF_WAKE_KEY};
        if (epoll_ctl(th->epfd, EPOLL_CTL_ADD, th->wakefd, &e) < 0) {
            goto fail;
        }
    }
    return l;
fail:;
    int err = errno ? errno : ENOMEM;
    if (l->threads) {
        for (int i = 0; i < l->nthreads; i++) {
            if (l->threads[i].epfd >= 0) {
                close(l->threads[i].epfd);
            }
            if (l->threads[i].wakefd >= 0) {
                close(l->threads[i].wakefd);
            }
        }
    }
    if (l->evfd >= 0) {
        close(l->evfd);
    }
    free(l->threads);
    free(l->slots);
    free(l->free_slots);
    free(l);
    errno = err;
    return NULL;
}

/* Frees everything: only after sf_stop returned 1 (no thread left). */
static void
sf_listener_free(sf_listener *l)
{
    for (uint32_t i = 0; i < l->next_unused; i++) {
        sf_conn *c = atomic_load_explicit(&l->slots[i], memory_order_relaxed);
        if (c->fd >= 0) {
            close(c->fd);
        }
        pthread_mutex_destroy(&c->mu);
        free(c->in);
        free(c->out);
        free(c);
    }
    for (sf_event *e = l->ev_head; e != NULL;) {
        sf_event *next = e->next;
        free(e);
        e = next;
    }
    for (int i = 0; i < l->nthreads; i++) {
        sf_thread *th = &l->threads[i];
        close(th->epfd);
        close(th->wakefd);
        pthread_mutex_destroy(&th->audit_mu);
        free(th->audit);
    }
    close(l->evfd);
    pthread_mutex_destroy(&l->slots_mu);
    pthread_mutex_destroy(&l->ev_mu);
    pthread_mutex_destroy(&l->step_mu);
    pthread_mutex_destroy(&l->start_mu);
    pthread_cond_destroy(&l->start_cv);
    free(l->threads);
    free(l->slots);
    free(l->free_slots);
    free(l);
}

#endif
