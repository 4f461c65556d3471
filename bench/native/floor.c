/*
 * floor: the machine's floor for get_id, a C epoll server with no Python in it.
 *
 *   bench/build/floor [--host 127.0.0.1] [--port 0] [--threads N] [--worker-id N]
 *       [--datacenter-id N] [--max-frame-size BYTES]
 *
 * An anchor for the benchmark, not a server: it answers exactly the request that
 * snowflake_server/_thrift/fastpath.py matches (a framed, strict binary get_id call
 * with its one string field and nothing else, at most --max-frame-size bytes) with
 * the same 34-byte reply, and closes any connection that sends anything else.  No
 * user agent check, no metrics, no limits: what is left is the kernel's TCP work
 * and a few hundred instructions, which no server of ours can go below.
 *
 * Ids come from one generator with the default layout (41 bits of milliseconds
 * since 1288834974657, 5 of datacenter, 5 of worker, 12 of sequence) under one
 * mutex, as the native path's generator state is: the same millisecond takes the
 * next sequence number, a spent millisecond is waited out, and a clock that went
 * back is treated as not having moved (an anchor never repeats an id, and never
 * fails a call).
 *
 * Threads: --threads (default: the CPUs this process may run on), each with its
 * own epoll.  Thread 0 also owns the one listening socket and hands each new
 * connection to the threads in turn, so that 4 connections on 2 threads are
 * always 2 and 2.  SO_REUSEPORT listeners would spare that hand-off, but the
 * kernel spreads connections over them by a hash of their ports, which puts 3
 * of 4 (or all 4) on one thread in some runs: the floor would move from run to
 * run.  Accepting is rare here (the benchmark's connections live for a whole
 * run), so one acceptor costs nothing measurable.
 *
 * Prints "native-floor ready thrift=HOST:PORT" on stdout once it listens; runs
 * until a signal ends it.  Bad flags: exit status 2.
 */
#define _GNU_SOURCE /* accept4, sched_getaffinity */

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define READY_PREFIX "native-floor ready"
#define MAX_THREADS 64
#define EVENTS 256
#define INITIAL_BUFFER 4096u

/* The request: frame length | 80 01 00 01 | 00 00 00 06 "get_id" | seqid (4)
 * | 0b 00 01 | agent length (4) | agent | 00.  Offsets are in the whole frame. */
static const uint8_t REQUEST_HEAD[14] = {0x80, 0x01, 0x00, 0x01, 0x00, 0x00, 0x00,
                                         0x06, 'g',  'e',  't',  '_',  'i',  'd'};
static const uint8_t AGENT_FIELD[3] = {0x0b, 0x00, 0x01};
#define HEAD_AT 4u
#define SEQID_AT 18u
#define FIELD_AT 22u
#define AGENT_LENGTH_AT 25u
#define OVERHEAD 30u /* every byte of a request but the agent's */

/* The reply: frame length 30 | 80 01 00 02 | 00 00 00 06 "get_id" | seqid
 * | 0a 00 00 (field 0, i64) | id (8) | 00. */
#define REPLY_SIZE 34u
static const uint8_t REPLY_HEAD[18] = {0x00, 0x00, 0x00, 0x1e, 0x80, 0x01, 0x00, 0x02, 0x00,
                                       0x00, 0x00, 0x06, 'g',  'e',  't',  '_',  'i',  'd'};
#define REPLY_SEQID_AT 18u
#define REPLY_FIELD_AT 22u
#define REPLY_ID_AT 25u

/* The default layout (snowflake_server/_ids/layouts.py). */
#define EPOCH_MS 1288834974657LL
#define SEQUENCE_BITS 12
#define WORKER_BITS 5
#define DATACENTER_BITS 5
#define MAX_SEQUENCE ((1 << SEQUENCE_BITS) - 1)

struct generator {
    pthread_mutex_t lock;
    int64_t last_ms;
    int64_t sequence;
    int64_t node; /* datacenter and worker, already shifted into place */
};

static struct generator gen = {PTHREAD_MUTEX_INITIALIZER, -1, 0, 0};

struct conn {
    int fd;
    uint8_t *buf;
    size_t have, cap;
    uint8_t *out; /* replies not yet written: [out_at, out_have) */
    size_t out_at, out_have, out_cap;
    bool writing; /* waiting for EPOLLOUT, not reading */
};

struct worker {
    pthread_t thread;
    int epoll;
};

static struct worker workers[MAX_THREADS];
static int nthreads;
static int listener = -1;
static uint32_t max_frame = 64u * 1024u; /* the server's --max-frame-size default */

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t next_id(void) {
    pthread_mutex_lock(&gen.lock);
    int64_t now = now_ms();
    if (now < gen.last_ms)
        now = gen.last_ms; /* back in time: as if the clock had stood still */
    if (now == gen.last_ms) {
        if (gen.sequence < MAX_SEQUENCE) {
            gen.sequence++;
        } else {
            while ((now = now_ms()) <= gen.last_ms) {
            } /* the millisecond is spent: wait for the next */
            gen.sequence = 0;
        }
    } else {
        gen.sequence = 0;
    }
    gen.last_ms = now;
    int64_t id = ((now - EPOCH_MS) << (SEQUENCE_BITS + WORKER_BITS + DATACENTER_BITS)) |
                 gen.node | gen.sequence;
    pthread_mutex_unlock(&gen.lock);
    return id;
}

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static void put_be64(uint8_t *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        p[i] = (uint8_t)(v & 0xffu);
        v >>= 8;
    }
}

/* fastpath.match_get_id on one whole frame of n bytes (its length included). */
static bool is_get_id(const uint8_t *frame, size_t n) {
    return n >= OVERHEAD && memcmp(frame + HEAD_AT, REQUEST_HEAD, sizeof REQUEST_HEAD) == 0 &&
           memcmp(frame + FIELD_AT, AGENT_FIELD, sizeof AGENT_FIELD) == 0 &&
           frame[n - 1] == 0 && be32(frame + AGENT_LENGTH_AT) == n - OVERHEAD;
}

static void conn_close(struct conn *c) {
    close(c->fd); /* also leaves the epoll set */
    free(c->buf);
    free(c->out);
    free(c);
}

static bool reserve(uint8_t **buf, size_t *cap, size_t need) {
    if (need <= *cap)
        return true;
    size_t size = *cap ? *cap : INITIAL_BUFFER;
    while (size < need)
        size *= 2;
    uint8_t *grown = realloc(*buf, size);
    if (!grown)
        return false;
    *buf = grown;
    *cap = size;
    return true;
}

/* Writes what is pending; false if the connection is lost.  Leaves the connection
 * waiting for EPOLLOUT (and not reading) while the socket is full. */
static bool flush_out(int epoll, struct conn *c) {
    while (c->out_at < c->out_have) {
        ssize_t sent = send(c->fd, c->out + c->out_at, c->out_have - c->out_at, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return false;
            if (!c->writing) {
                struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = c};
                if (epoll_ctl(epoll, EPOLL_CTL_MOD, c->fd, &ev) < 0)
                    return false;
                c->writing = true;
            }
            return true;
        }
        c->out_at += (size_t)sent;
    }
    c->out_at = c->out_have = 0;
    if (c->writing) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(epoll, EPOLL_CTL_MOD, c->fd, &ev) < 0)
            return false;
        c->writing = false;
    }
    return true;
}

/* Answers every whole frame received; false: close the connection (a request it
 * does not serve, or the peer gone).  What was answered before such a request is
 * sent first, best effort. */
static bool serve(int epoll, struct conn *c) {
    size_t at = 0;
    bool ok = true;
    while (c->have - at >= 4) {
        uint32_t size = be32(c->buf + at);
        if (size == 0 || size > max_frame) {
            ok = false;
            break;
        }
        size_t n = 4u + size;
        if (c->have - at < n) {
            if (!reserve(&c->buf, &c->cap, n))
                ok = false;
            break;
        }
        const uint8_t *frame = c->buf + at;
        if (!is_get_id(frame, n) || !reserve(&c->out, &c->out_cap, c->out_have + REPLY_SIZE)) {
            ok = false;
            break;
        }
        uint8_t *reply = c->out + c->out_have;
        memcpy(reply, REPLY_HEAD, sizeof REPLY_HEAD);
        memcpy(reply + REPLY_SEQID_AT, frame + SEQID_AT, 4);
        reply[REPLY_FIELD_AT] = 0x0a;
        reply[REPLY_FIELD_AT + 1] = 0;
        reply[REPLY_FIELD_AT + 2] = 0;
        put_be64(reply + REPLY_ID_AT, (uint64_t)next_id());
        reply[REPLY_SIZE - 1] = 0;
        c->out_have += REPLY_SIZE;
        at += n;
    }
    if (at) {
        memmove(c->buf, c->buf + at, c->have - at);
        c->have -= at;
    }
    return flush_out(epoll, c) && ok;
}

static void on_readable(int epoll, struct conn *c) {
    if (!reserve(&c->buf, &c->cap, c->have + INITIAL_BUFFER)) {
        conn_close(c);
        return;
    }
    ssize_t got = recv(c->fd, c->buf + c->have, c->cap - c->have, 0);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (got <= 0) {
        conn_close(c);
        return;
    }
    c->have += (size_t)got;
    if (!serve(epoll, c))
        conn_close(c);
}

static void on_accept(void) {
    static unsigned next_thread;
    for (;;) {
        int fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return; /* EAGAIN, or out of files: try again on the next event */
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        c->fd = fd;
        /* epoll_ctl on another thread's epoll is safe, and publishes c to it. */
        int target = workers[next_thread++ % (unsigned)nthreads].epoll;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(target, EPOLL_CTL_ADD, fd, &ev) < 0)
            conn_close(c);
    }
}

static void *run(void *arg) {
    struct worker *self = arg;
    struct epoll_event events[EVENTS];
    for (;;) {
        int n = epoll_wait(self->epoll, events, EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            struct conn *c = events[i].data.ptr;
            if (c == NULL) {
                on_accept();
            } else if (c->writing) {
                if (events[i].events & (EPOLLERR | EPOLLHUP) || !flush_out(self->epoll, c) ||
                    (!c->writing && !serve(self->epoll, c)))
                    conn_close(c);
            } else {
                on_readable(self->epoll, c);
            }
        }
    }
    return NULL;
}

static long number(const char *flag, const char *text, long low, long high) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || *end || end == text || v < low || v > high) {
        fprintf(stderr, "floor: %s: %s is not a whole number in %ld..%ld\n", flag, text, low,
                high);
        exit(2);
    }
    return v;
}

static void usage(FILE *to) {
    fputs("usage: floor [--host 127.0.0.1] [--port 0] [--threads N] [--worker-id 0..31]\n"
          "             [--datacenter-id 0..31] [--max-frame-size BYTES]\n",
          to);
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1";
    long port = 0, worker_id = 0, datacenter_id = 0;
    cpu_set_t cpus;
    nthreads = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    static const struct option longs[] = {
        {"host", required_argument, NULL, 'H'},
        {"port", required_argument, NULL, 'p'},
        {"threads", required_argument, NULL, 't'},
        {"worker-id", required_argument, NULL, 'w'},
        {"datacenter-id", required_argument, NULL, 'd'},
        {"max-frame-size", required_argument, NULL, 'm'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    int flag;
    while ((flag = getopt_long(argc, argv, "", longs, NULL)) != -1) {
        switch (flag) {
        case 'H': host = optarg; break;
        case 'p': port = number("--port", optarg, 0, 65535); break;
        case 't': nthreads = (int)number("--threads", optarg, 1, MAX_THREADS); break;
        case 'w': worker_id = number("--worker-id", optarg, 0, 31); break;
        case 'd': datacenter_id = number("--datacenter-id", optarg, 0, 31); break;
        case 'm': max_frame = (uint32_t)number("--max-frame-size", optarg, 64, 1L << 30); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        usage(stderr);
        return 2;
    }
    if (nthreads > MAX_THREADS)
        nthreads = MAX_THREADS;
    gen.node = (int64_t)(datacenter_id << (SEQUENCE_BITS + WORKER_BITS) |
                         worker_id << SEQUENCE_BITS);

    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) {
        fprintf(stderr, "floor: --host: %s is not an IPv4 address\n", host);
        return 2;
    }
    listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listener < 0)
        die("socket");
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) < 0)
        die("bind");
    if (listen(listener, 4096) < 0)
        die("listen");
    socklen_t len = sizeof addr;
    if (getsockname(listener, (struct sockaddr *)&addr, &len) < 0)
        die("getsockname");

    for (int i = 0; i < nthreads; i++) {
        workers[i].epoll = epoll_create1(EPOLL_CLOEXEC);
        if (workers[i].epoll < 0)
            die("epoll_create1");
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL}; /* NULL: the listener */
    if (epoll_ctl(workers[0].epoll, EPOLL_CTL_ADD, listener, &ev) < 0)
        die("epoll_ctl");
    for (int i = 1; i < nthreads; i++) {
        if (pthread_create(&workers[i].thread, NULL, run, &workers[i]) != 0)
            die("pthread_create");
    }
    char shown[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &addr.sin_addr, shown, sizeof shown);
    printf("%s thrift=%s:%u threads=%d\n", READY_PREFIX, shown, ntohs(addr.sin_port), nthreads);
    fflush(stdout);
    run(&workers[0]);
    return 0;
}
