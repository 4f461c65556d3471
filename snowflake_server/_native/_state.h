/* The generator state's struct and what the listener (_listener.c) calls of _core.c: the
 * native threads' fast call and the fork generation. _core.c owns the state (see there for
 * the mutex's rules); nothing here changes them.
 */
#ifndef SNOWFLAKE_NATIVE_STATE_H
#define SNOWFLAKE_NATIVE_STATE_H

#include <Python.h>

#include <pthread.h>
#include <stdint.h>

#define SF_SLOW ((int64_t)-1)
#define SF_CONTENDED ((int64_t)-2)
#define SF_SPIN_NS 20000

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mutex;
    /* The Python thread holding the mutex through acquire() (0: none): atomic, since a
     * thread that does not hold the mutex reads it to refuse a release or a second lock. */
    unsigned long py_owner;
    /* Set (atomic) by the holder while it waits out a clock step or writes a clock-sequence
     * switch under the mutex (IdGenerator._long_hold): a fast call then gives up at once. */
    int long_hold;
    /* Native fast calls trying the mutex right now (atomic; what tests wait on). */
    int spinning;
    /* fork_generation when the state was made: another one means a fork's inherited copy. */
    unsigned long generation;
    /* Constants of the layout. */
    int64_t epoch;
    int64_t ts_shift;
    int64_t max_sequence;
    int zero_start; /* sequences start at zero (not at a random offset) */
    /* IdGenerator's fields of the same names (without the leading underscore). */
    int64_t last_ts;
    int64_t sequence;
    int64_t base;
    int64_t first_sequence;
    int64_t ids_before_this_ms;
    int64_t ceiling;
    int64_t node;
    int sealed;
    /* The session gate: ids only while open and the boot clock is at or before gate_until. */
    int gate_open;
    double gate_until;
} GeneratorState;

/* The fast call of native threads (no GIL, never blocks: see _core.c's fast_try): an id,
 * SF_SLOW or SF_CONTENDED. On SF_SLOW, *gate (if given) says whether the gate was closed,
 * past its deadline or the state sealed (or the state is a fork's copy), as read under
 * the mutex; on an id, *time_ms (if given) is the id's own ms. */
int64_t sf_fast_try(GeneratorState *s, int64_t spin_ns, int *gate, int64_t *time_ms);
/* Whether o is a GeneratorState. */
int sf_is_generator_state(PyObject *o);
/* Bumped in each child of a fork: an object made under another value is a fork's copy. */
unsigned long sf_fork_generation(void);

#endif
