/* Fuzz target for the native listener's frame parser (snowflake_server/_native/_listener.h).
 *
 * LLVMFuzzerTestOneInput walks one input as a leased connection would: bytes arrive in
 * chunks (sizes chosen by the input's first bytes, as is the frame limit), each chunk is
 * appended to an `in` buffer of exactly the listener's size, and whole frames are served
 * with sf_scan_prefix until one is not native (handed over: the walk ends) or only part
 * of one is left. Every buffer the parser sees is a malloc of exactly its length, so
 * AddressSanitizer reports any read past it. Checked on every step:
 *   - results are only NEED_MORE, MATCH or HANDOVER;
 *   - a MATCH lies inside the bytes given, is sf_match_get_id's frame (seqid and agent),
 *     is at most SF_NATIVE_MAX_FRAME long, and its reply is the 34 bytes with its seqid;
 *   - every prefix of a matched frame said NEED_MORE, and after a HANDOVER every longer
 *     prefix says HANDOVER;
 *   - a prefix that is exactly one frame sf_match_get_id matches is scan_prefix's MATCH if
 *     it is at most SF_NATIVE_MAX_FRAME long, else its HANDOVER;
 *   - what a leased connection keeps between reads is less than SF_NATIVE_MAX_FRAME;
 *   - a matched agent's registry lookup finds exactly the registered agents.
 * Then the same bytes walk the connection machine itself (_conn.h's sf_serve_frames on a
 * leased connection with no socket, a fake generator whose every Nth call is SLOW or
 * CONTENDED): every reply echoes its frame's seqid in order, what a leased connection keeps
 * is exactly the unanswered bytes (less than one native frame), and once the lease is given
 * back the EV_DATA events hold exactly every byte not answered, in order.
 *
 * Debian 12's gcc has no libFuzzer, so without -DSF_LIBFUZZER this file has its own
 * main(): it mutates generated seeds (valid get_id frames with random agents and seqids,
 * pipelined; another method; files from a corpus folder if given) by bit flips, byte
 * sets, length-field edits, truncations, insertions, deletions and splices, for
 * FUZZ_SECONDS (default 30) or FUZZ_COUNT inputs, whichever comes first. A failed check
 * abort()s after writing the input to fuzz-crash.bin. `make fuzz-native` builds and runs
 * it under -fsanitize=address,undefined; with clang, the libFuzzer variant instead.
 */
#define _GNU_SOURCE /* _conn.h's pthread_timedjoin_np */
#include "../../snowflake_server/_native/_listener.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function" /* the machine's parts the walk skips */
#include "../../snowflake_server/_native/_conn.h"
#pragma GCC diagnostic pop

#include <dirent.h>
#include <stdio.h>
#include <time.h>

#define NATIVE_READ 4096

static const uint8_t *current_input;
static size_t current_size;

static void
fail(const char *what)
{
    fprintf(stderr, "fuzz_frame: check failed: %s\n", what);
    FILE *f = fopen("fuzz-crash.bin", "wb");
    if (f != NULL) {
        fwrite(current_input, 1, current_size, f);
        fclose(f);
        fprintf(stderr, "fuzz_frame: input (%zu bytes) written to fuzz-crash.bin\n",
                current_size);
    }
    abort();
}

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fail(#cond);                                                                     \
        }                                                                                    \
    } while (0)

static sf_registry registry;
static const char *const REGISTERED[] = {"alpha", "beta-2", "a", ""};

/* sf_scan_prefix on an exact copy of buf[0..len). */
static sf_scan_result
scan_exact(const uint8_t *buf, size_t len, int64_t limit, sf_frame *m)
{
    uint8_t *copy = malloc(len ? len : 1);
    CHECK(copy != NULL);
    memcpy(copy, buf, len);
    sf_scan_result r = sf_scan_prefix(copy, len, limit, m);
    free(copy);
    CHECK(r == SF_NEED_MORE || r == SF_MATCH || r == SF_HANDOVER);
    return r;
}

/* Every prefix of buf[0..len) against the whole: the consistency the lease relies on. */
static void
check_prefixes(const uint8_t *buf, size_t len, int64_t limit)
{
    size_t upto = len < SF_NATIVE_MAX_FRAME + 8 ? len : SF_NATIVE_MAX_FRAME + 8;
    sf_scan_result before = SF_NEED_MORE;
    for (size_t k = 0; k <= upto; k++) {
        sf_frame m, whole;
        sf_scan_result r = scan_exact(buf, k, limit, &m);
        /* Where buf[0..k) is exactly one frame the fast path matches, scan_prefix matches
         * it if native serves frames that long, and hands it over if not. */
        uint8_t *copy = malloc(k ? k : 1);
        CHECK(copy != NULL);
        memcpy(copy, buf, k);
        if (sf_match_get_id(copy, k, limit, &whole)) {
            CHECK(r == (k <= SF_NATIVE_MAX_FRAME ? SF_MATCH : SF_HANDOVER));
            CHECK(r == SF_HANDOVER || memcmp(whole.seqid, m.seqid, 4) == 0);
        }
        free(copy);
        if (before == SF_HANDOVER) {
            CHECK(r == SF_HANDOVER);
        }
        if (r == SF_MATCH) {
            CHECK(before == SF_NEED_MORE);
            CHECK(m.frame_len <= k);
            break; /* longer prefixes hold the same first frame */
        }
        if (r == SF_HANDOVER) {
            CHECK(m.why == SF_WHY_LENGTH || m.why == SF_WHY_REQUEST);
        }
        before = r;
    }
}

static void
check_match(const uint8_t *frame, size_t avail, int64_t limit, const sf_frame *m)
{
    CHECK(m->frame_len >= SF_OVERHEAD && m->frame_len <= SF_NATIVE_MAX_FRAME);
    CHECK(m->frame_len <= avail);
    CHECK(m->agent_at == SF_AGENT_AT && m->agent_at + m->agent_len == m->frame_len - 1);
    uint8_t *copy = malloc(m->frame_len);
    CHECK(copy != NULL);
    memcpy(copy, frame, m->frame_len);
    sf_frame again;
    CHECK(sf_match_get_id(copy, m->frame_len, limit, &again));
    CHECK(memcmp(again.seqid, m->seqid, 4) == 0 && again.agent_len == m->agent_len);
    CHECK(memcmp(m->seqid, frame + SF_HEAD_END, 4) == 0);
    uint8_t reply[SF_REPLY_LEN + 1];
    reply[SF_REPLY_LEN] = 0xa5;
    sf_get_id_reply(reply, m->seqid, (int64_t)m->frame_len);
    CHECK(reply[SF_REPLY_LEN] == 0xa5);
    CHECK(sf_be32(reply) == SF_REPLY_LEN - 4 && memcmp(reply + 18, m->seqid, 4) == 0);
    CHECK(reply[33] == 0 && reply[32] == (uint8_t)m->frame_len);
    const sf_agent *e = sf_registry_lookup(&registry, copy + m->agent_at, m->agent_len);
    int known = 0;
    for (size_t i = 0; i < sizeof REGISTERED / sizeof *REGISTERED; i++) {
        known |= strlen(REGISTERED[i]) == m->agent_len &&
                 memcmp(REGISTERED[i], copy + m->agent_at, m->agent_len) == 0;
    }
    CHECK((e != NULL) == known);
    free(copy);
}

/* The fake generator of the machine walk: ids counting up; every fake_every-th call (0:
 * none) is SLOW (gate or not) or CONTENDED. */
static int64_t fake_next_id = 1;
static unsigned fake_every, fake_calls;

static int64_t
fake_fast(void *state, int64_t spin_ns, int *gate, int64_t *time_ms)
{
    (void)state;
    (void)spin_ns;
    fake_calls++;
    if (fake_every && fake_calls % fake_every == 0) {
        *gate = (int)(fake_calls & 1);
        return fake_calls & 2 ? SF_FAST_CONTENDED : SF_FAST_SLOW;
    }
    *time_ms = fake_next_id;
    return fake_next_id++;
}

static sf_listener *machine;

/* The bytes through sf_serve_frames, chunk by chunk as reads would bring them, on a leased
 * connection with no socket (nothing of it needs one). */
static void
walk_machine(const uint8_t *data, size_t size, int64_t limit, unsigned split)
{
    if (machine == NULL) {
        sf_thread_stats *stats = aligned_alloc(64, sizeof *stats);
        CHECK(stats != NULL);
        memset(stats, 0, sizeof *stats);
        machine = sf_listener_new(0, 1, stats);
        CHECK(machine != NULL);
        machine->fast = fake_fast;
        machine->registry = &registry;
        atomic_store(&machine->state, (void *)&registry); /* any non-NULL state */
    }
    machine->limit = limit;
    fake_every = split >> 5;
    fake_calls = 0;
    sf_conn c;
    memset(&c, 0, sizeof c);
    c.in = malloc(SF_IN_CAP);
    CHECK(c.in != NULL);
    c.fd = -1;
    c.gen = 1;
    c.in_use = c.leased = c.writable = 1;
    size_t offered = 0, answered = 0;
    while (offered < size && c.leased) {
        size_t chunk = split == 0 ? SF_NATIVE_READ : 1 + (split * (offered + 7)) % 61;
        if (chunk > size - offered) {
            chunk = size - offered;
        }
        memcpy(c.in + c.in_len, data + offered, chunk);
        c.in_len += chunk;
        offered += chunk;
        size_t before = c.out_len;
        sf_serve_frames(machine, &machine->threads[0], &c, 0);
        CHECK(c.out_len >= before && (c.out_len - before) % SF_REPLY_LEN == 0);
        for (size_t at = before; at < c.out_len; at += SF_REPLY_LEN) {
            const uint8_t *reply = c.out + c.out_off + at;
            CHECK(answered + 4 <= offered);
            size_t n = (size_t)sf_be32(data + answered) + 4;
            CHECK(n <= SF_NATIVE_MAX_FRAME && answered + n <= offered);
            CHECK(memcmp(reply, SF_REPLY_HEAD, sizeof SF_REPLY_HEAD) == 0);
            CHECK(memcmp(reply + 18, data + answered + SF_HEAD_END, 4) == 0);
            answered += n;
        }
        if (c.leased) {
            CHECK(c.in_len < SF_NATIVE_MAX_FRAME && c.in_len == offered - answered);
            CHECK(memcmp(c.in, data + answered, c.in_len) == 0);
        }
    }
    size_t given = 0;
    for (sf_event *e = sf_ev_take(machine); e != NULL;) {
        sf_event *next = e->next;
        CHECK(e->kind == SF_EV_DATA && !c.leased && e->handle == sf_handle(&c));
        CHECK(answered + given + e->len <= offered);
        CHECK(memcmp(e->data, data + answered + given, e->len) == 0);
        given += e->len;
        free(e);
        e = next;
    }
    if (!c.leased) {
        CHECK(answered + given == offered && c.forwarded == given && c.in_len == 0);
    }
    CHECK(c.served * SF_REPLY_LEN == c.out_len);
    free(c.in);
    free(c.out);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        CHECK(sf_registry_init(&registry) == 0);
        for (size_t i = 0; i < sizeof REGISTERED / sizeof *REGISTERED; i++) {
            CHECK(sf_registry_add(&registry, (const uint8_t *)REGISTERED[i],
                                  strlen(REGISTERED[i]), (int32_t)i) == (int)i);
        }
        ready = 1;
    }
    current_input = data;
    current_size = size;
    if (size < 2) {
        return 0;
    }
    /* The first byte picks the limit, the second the chunk sizes. */
    static const int64_t limits[] = {64 * 1024, 25, 26, 27, 100, 153, 154, 155, -1, INT64_MAX};
    int64_t limit = limits[data[0] % (sizeof limits / sizeof *limits)];
    unsigned split = data[1];
    data += 2;
    size -= 2;
    check_prefixes(data, size, limit);
    walk_machine(data, size, limit, split);

    uint8_t in[NATIVE_READ + SF_NATIVE_MAX_FRAME];
    size_t in_len = 0, offered = 0;
    while (offered < size) {
        size_t chunk = split == 0 ? NATIVE_READ : 1 + (split * (offered + 7)) % 61;
        if (chunk > size - offered) {
            chunk = size - offered;
        }
        if (chunk > sizeof in - in_len) {
            chunk = sizeof in - in_len;
        }
        memcpy(in + in_len, data + offered, chunk);
        in_len += chunk;
        offered += chunk;
        /* Serve whole frames, on an exact copy of what is buffered. */
        uint8_t *buf = malloc(in_len);
        CHECK(buf != NULL);
        memcpy(buf, in, in_len);
        size_t pos = 0;
        sf_scan_result r;
        for (;;) {
            sf_frame m;
            r = sf_scan_prefix(buf + pos, in_len - pos, limit, &m);
            CHECK(r == SF_NEED_MORE || r == SF_MATCH || r == SF_HANDOVER);
            if (r != SF_MATCH) {
                break;
            }
            check_match(buf + pos, in_len - pos, limit, &m);
            pos += m.frame_len;
        }
        free(buf);
        if (r == SF_HANDOVER) {
            return 0; /* everything from pos on goes to Python; native reads no further */
        }
        /* Kept for the next read: part of one frame, never a whole native one. */
        CHECK(in_len - pos < SF_NATIVE_MAX_FRAME);
        memmove(in, in + pos, in_len - pos);
        in_len -= pos;
    }
    return 0;
}

#ifndef SF_LIBFUZZER

static uint64_t rng;

static uint64_t
next_random(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static size_t
below(size_t n)
{
    return n ? (size_t)(next_random() % n) : 0;
}

/* A common get_id frame: random agent (usually registered-looking) and seqid. */
static size_t
make_frame(uint8_t *out, size_t room)
{
    /* Half the frames carry a registered agent exactly: runs of them are served natively. */
    const char *known = REGISTERED[below(sizeof REGISTERED / sizeof *REGISTERED)];
    int exact = below(2);
    size_t agent_len = exact ? strlen(known) : below(8) == 0 ? below(200) : below(12);
    size_t n = SF_OVERHEAD + agent_len;
    if (n > room) {
        return 0;
    }
    uint32_t body = (uint32_t)(n - 4), alen = (uint32_t)agent_len;
    for (int i = 0; i < 4; i++) {
        out[i] = (uint8_t)(body >> (24 - 8 * i));
        out[SF_AGENT_LEN_AT + i] = (uint8_t)(alen >> (24 - 8 * i));
    }
    memcpy(out + 4, SF_REQUEST_HEAD, sizeof SF_REQUEST_HEAD);
    for (int i = 0; i < 4; i++) {
        out[SF_HEAD_END + i] = (uint8_t)next_random();
    }
    memcpy(out + SF_FIELD_AT, SF_AGENT_FIELD, sizeof SF_AGENT_FIELD);
    for (size_t i = 0; i < agent_len; i++) {
        out[SF_AGENT_AT + i] = i < strlen(known) && below(2) ? (uint8_t)known[i]
                                                              : (uint8_t)('a' + below(26));
    }
    if ((exact || below(2)) && strlen(known) <= agent_len) {
        memcpy(out + SF_AGENT_AT, known, strlen(known));
    }
    out[n - 1] = 0;
    return n;
}

#define FUZZ_MAX_INPUT 8192
#define MAX_SEEDS 256

static uint8_t *seeds[MAX_SEEDS];
static size_t seed_len[MAX_SEEDS];
static size_t nseeds;

static void
add_seed(const uint8_t *p, size_t n)
{
    if (nseeds < MAX_SEEDS && n <= FUZZ_MAX_INPUT) {
        seeds[nseeds] = malloc(n ? n : 1);
        memcpy(seeds[nseeds], p, n);
        seed_len[nseeds++] = n;
    }
}

static void
load_corpus(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL) {
        return;
    }
    struct dirent *e;
    uint8_t buf[FUZZ_MAX_INPUT];
    char path[4096];
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') {
            continue;
        }
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (f != NULL) {
            add_seed(buf, fread(buf, 1, sizeof buf, f));
            fclose(f);
        }
    }
    closedir(d);
}

static size_t
mutate(uint8_t *buf, size_t n)
{
    for (size_t rounds = 1 + below(4); rounds > 0; rounds--) {
        switch (below(9)) {
        case 0: /* flip a bit */
            if (n) {
                buf[below(n)] ^= (uint8_t)(1u << below(8));
            }
            break;
        case 1: /* set a byte */
            if (n) {
                buf[below(n)] = (uint8_t)next_random();
            }
            break;
        case 2: /* a frame's length field (at a frame boundary, or anywhere) */
        case 3: {
            size_t at = below(2) && n > 2 ? 2 : below(n);
            if (at + 4 <= n) {
                static const uint32_t edges[] = {0, 1, 25, 26, 27, 153, 154, 155, 0x7fffffff,
                                                 0xffffffff};
                uint32_t v = below(2) ? edges[below(10)] : (uint32_t)(sf_be32(buf + at) + below(5) - 2);
                for (int i = 0; i < 4; i++) {
                    buf[at + i] = (uint8_t)(v >> (24 - 8 * i));
                }
            }
            break;
        }
        case 4: /* truncate */
            n = below(n + 1);
            break;
        case 5: /* insert bytes */
        case 6: {
            size_t k = 1 + below(8), at = below(n + 1);
            if (n + k <= FUZZ_MAX_INPUT) {
                memmove(buf + at + k, buf + at, n - at);
                for (size_t i = 0; i < k; i++) {
                    buf[at + i] = (uint8_t)next_random();
                }
                n += k;
            }
            break;
        }
        case 7: { /* delete bytes */
            size_t at = below(n + 1), k = below(8);
            if (at + k > n) {
                k = n - at;
            }
            memmove(buf + at, buf + at + k, n - at - k);
            n -= k;
            break;
        }
        default: { /* splice in (part of) another seed, or a fresh frame */
            size_t at = below(n + 1);
            uint8_t extra[FUZZ_MAX_INPUT];
            size_t k;
            if (below(2)) {
                size_t s = below(nseeds);
                k = below(seed_len[s] + 1);
                memcpy(extra, seeds[s], k);
            } else {
                k = make_frame(extra, sizeof extra);
            }
            if (n + k <= FUZZ_MAX_INPUT) {
                memmove(buf + at + k, buf + at, n - at);
                memcpy(buf + at, extra, k);
                n += k;
            }
        }
        }
    }
    return n;
}

static double
now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int
main(int argc, char **argv)
{
    const char *env;
    double seconds = (env = getenv("FUZZ_SECONDS")) ? atof(env) : 30;
    unsigned long long count = (env = getenv("FUZZ_COUNT")) ? strtoull(env, NULL, 10) : 0;
    rng = (env = getenv("FUZZ_SEED")) ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
    if (rng == 0) {
        rng = 1;
    }
    uint64_t seed = rng;
    /* Seeds: single frames, pipelined runs, another method, an empty input. */
    uint8_t buf[FUZZ_MAX_INPUT];
    for (int i = 0; i < 64; i++) {
        size_t n = 0;
        buf[n++] = (uint8_t)below(256);
        buf[n++] = (uint8_t)below(256);
        for (size_t frames = 1 + below(6); frames > 0; frames--) {
            n += make_frame(buf + n, sizeof buf - n);
        }
        add_seed(buf, n);
    }
    static const uint8_t get_ids[] = {0,    0,    0,    42,   0x80, 1,    0,   1,    0,   0,
                                      0,    7,    'g',  'e',  't',  '_',  'i', 'd',  's', 0,
                                      0,    0,    1,    0x0b, 0,    1,    0,   0,    0,   1,
                                      'a',  0x08, 0,    2,    0,    0,    0,   2,    0,   0,
                                      0,    0,    0,    0};
    add_seed(get_ids, sizeof get_ids);
    add_seed(buf, 0);
    for (int i = 1; i < argc; i++) {
        load_corpus(argv[i]);
    }
    double start = now_s(), end = start + seconds;
    unsigned long long runs = 0;
    while ((count == 0 || runs < count) && (runs % 256 != 0 || now_s() < end)) {
        size_t s = below(nseeds);
        memcpy(buf, seeds[s], seed_len[s]);
        size_t n = mutate(buf, seed_len[s]);
        uint8_t *input = malloc(n ? n : 1); /* exact size: ASan sees any overread */
        memcpy(input, buf, n);
        LLVMFuzzerTestOneInput(input, n);
        free(input);
        if (below(64) == 0) {
            add_seed(buf, n); /* keep some mutants to mutate further */
        }
        runs++;
    }
    printf("fuzz_frame: %llu inputs in %.1f s (seed %llu, %zu seeds), no check failed\n", runs,
           now_s() - start, (unsigned long long)seed, nseeds);
    for (size_t i = 0; i < nseeds; i++) {
        free(seeds[i]);
    }
    sf_registry_free(&registry);
    return 0;
}

#endif
