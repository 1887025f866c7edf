/* One read of a tensor's values for every statistic a trace keeps of it.
 *
 * hookscope measures every activation of a model inside its forward hooks. Done with torch
 * reductions that is five or six passes over each tensor (aminmax, sum, dot, |x|, its sum, zero
 * counts), each a parallel region of torch's thread pool; on a shared machine every region pays
 * a barrier. This file reads each value once, in the calling thread or, for long tensors where it
 * reads faster, with torch's OpenMP team (see "segments" below), and returns
 *
 *     out[0] min    out[1] max    out[2] sum(x - shift)    out[3] sum((x - shift)^2)
 *     out[4] sum|x| out[5] number of zeros   out[6] the shift used
 *
 * (hookscope_finite_* read only whether any value is NaN or infinite, into out[7]: what
 * hs.detect_nonfinite asks of every output, at a fraction of the work.)
 *
 * A NaN ``shift`` asks for the first value as the shift: any value of the tensor keeps the sums of
 * squares small next to the spread when the mean dwarfs it (values around 300 in float16), and the
 * caller need not read one out first.
 *
 * Sums are kept in float32 lanes (float64 for double input) over blocks of SUB values (exported as
 * hookscope_block_values) and added to float64 totals after each block, so a long tensor loses no
 * digits to one long float32 sum. NaN and Inf are not counted here: they make a sum or an extreme non-finite, and the caller
 * then counts them exactly the slow way (they are rare, and a trace stops at the first one).
 *
 * The blocks are read last first: the end of a tensor its producer just wrote is the part still
 * in the cache. Plain C with GCC/Clang vector extensions, built as a plain shared library (no
 * Python or torch headers, no Python C API: one build serves every Python) and loaded with
 * ctypes; it builds in a second wherever a C compiler is, and the package works without it.
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <time.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h> /* _mm_getcsr, _mm_setcsr */
#endif

/* The interface's version: bumped whenever an entry point, the ``out`` layout or a constant below
 * changes meaning. hookscope/_shared/fused.py refuses a library whose version is not its own. */
#define ABI_VERSION 3
#define LANES 16 /* one AVX-512 register of float32, two AVX2 ones, four SSE ones */
#define SUB 512  /* values per float32 partial sum: a multiple of LANES */
#define SEGMENT 262144 /* values read forward at a time (1 MiB of float32), segments last first */
#define OUT_FIELDS 8   /* doubles each entry point writes to ``out`` */
#define TEAM_MIN_VALUES (2 * SEGMENT) /* shorter tensors are read by the caller alone; longer, the faster way */
#define EXPLORE_EVERY 16 /* about one long tensor in this many is read the other way, to keep both timed */

/* The same numbers for the Python side, tests and docs to read (ctypes ``in_dll``), so that none
 * of them keeps a copy that can drift. */
const int32_t hookscope_abi_version = ABI_VERSION;
const int64_t hookscope_block_values = SUB;
const int64_t hookscope_segment_values = SEGMENT;
const int64_t hookscope_out_fields = OUT_FIELDS;
const int64_t hookscope_team_min_values = TEAM_MIN_VALUES;

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef double vd __attribute__((vector_size(4 * sizeof(double))));
typedef int64_t vl __attribute__((vector_size(4 * sizeof(int64_t))));

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define BLEND(mask, a, b) (((mask) & (a)) | (~(mask) & (b)))

#define INLINE static inline __attribute__((always_inline))

INLINE vf splat(float value) {
    vf v;
    for (int j = 0; j < LANES; j++) v[j] = value;
    return v;
}

typedef struct {
    double low, high, sum, squares, magnitude, zeros;
    double nonfinite; /* the finiteness check's only result: 1 when a NaN or Inf was seen */
} totals;

static void start(totals *t) {
    t->low = __builtin_inf();
    t->high = -__builtin_inf();
    t->sum = t->squares = t->magnitude = t->zeros = t->nonfinite = 0.0;
}

static void finish(const totals *t, double shift, double *out) {
    out[0] = t->low;
    out[1] = t->high;
    out[2] = t->sum;
    out[3] = t->squares;
    out[4] = t->magnitude;
    out[5] = t->zeros;
    out[6] = shift;
    out[7] = t->nonfinite;
}

/* One value, the scalar way: the tail of a block that is not a multiple of LANES. */
static void one(totals *t, double x, double shift) {
    double d = x - shift;
    t->low = x < t->low ? x : t->low;
    t->high = x > t->high ? x : t->high;
    t->sum += d;
    t->squares += d * d;
    t->magnitude += x < 0 ? -x : x;
    t->zeros += x == 0;
}

/* float32 lanes over float32 values (or bfloat16 ones, widened on load). Each lane adds SUB / LANES
 * values in float32, then its sums are widened into float64 lanes: a float32 sum of a million 0.1s
 * stays within 3e-7 of the float64 one, at the cost of a few conversions per SUB values. */
#define FLOAT_BLOCK(LOAD)                                                                     \
    vf low = splat(__builtin_inff()), high = splat(-__builtin_inff());                        \
    vd wide_sum[LANES / 4] = {{0}}, wide_squares[LANES / 4] = {{0}}, wide_magnitude[LANES / 4] = {{0}};\
    vi zeros = {0};                                                                           \
    const vf centre = splat(shift);                                                           \
    const vi no_sign = (vi)splat(0.0f) | 0x7fffffff;                                          \
    size_t whole = count - count % SUB;                                                       \
    for (size_t start = 0; start < whole; start += SUB) {                                     \
        vf sum = splat(0.0f), squares = splat(0.0f), magnitude = splat(0.0f);                \
        for (size_t i = start; i < start + SUB; i += LANES) {                                 \
            vf v = LOAD(i);                                                                   \
            vf d = v - centre;                                                                \
            low = (vf)BLEND(v < low, (vi)v, (vi)low);                                         \
            high = (vf)BLEND(v > high, (vi)v, (vi)high);                                      \
            sum += d;                                                                         \
            squares += d * d;                                                                 \
            magnitude += (vf)((vi)v & no_sign);                                               \
            zeros -= (v == 0.0f);                                                             \
        }                                                                                     \
        widen(wide_sum, sum);                                                                 \
        widen(wide_squares, squares);                                                         \
        widen(wide_magnitude, magnitude);                                                     \
    }                                                                                         \
    for (int j = 0; j < LANES; j++) {                                                         \
        t->low = low[j] < t->low ? low[j] : t->low;                                           \
        t->high = high[j] > t->high ? high[j] : t->high;                                      \
        t->zeros += zeros[j];                                                                 \
        t->sum += wide_sum[j / 4][j % 4];                                                     \
        t->squares += wide_squares[j / 4][j % 4];                                             \
        t->magnitude += wide_magnitude[j / 4][j % 4];                                         \
    }

/* Add the float32 lanes into LANES / 4 vectors of four float64 ones (element by element: GCC before
 * 12 has no __builtin_shufflevector; this runs once per SUB values). */
INLINE void widen(vd *into, vf lanes) {
    for (int k = 0; k < LANES / 4; k++) {
        vd part = {lanes[4 * k], lanes[4 * k + 1], lanes[4 * k + 2], lanes[4 * k + 3]};
        into[k] += part;
    }
}

/* LANES values' bits, as they are (float32) or widened into the top half (bfloat16 bits). */
INLINE vu load_u32(const uint32_t *x) {
    vu v;
    memcpy(&v, x, sizeof v);
    return v;
}

INLINE vu load_bf16_bits(const uint16_t *x) {
    vh h;
    memcpy(&h, x, sizeof h);
    return __builtin_convertvector(h, vu);
}

INLINE vf load_f32(const float *x) { return (vf)load_u32((const uint32_t *)x); }

INLINE vf load_bf16(const uint16_t *x) { return (vf)(load_bf16_bits(x) << 16); }

CLONES static void block_f32(totals *t, const float *x, size_t count, float shift) {
#define LOAD_F32(i) load_f32(x + (i))
    FLOAT_BLOCK(LOAD_F32)
    for (size_t i = whole; i < count; i++) one(t, x[i], shift);
}

CLONES static void block_bf16(totals *t, const uint16_t *x, size_t count, float shift) {
#define LOAD_BF16(i) load_bf16(x + (i))
    FLOAT_BLOCK(LOAD_BF16)
    for (size_t i = whole; i < count; i++) {
        uint32_t bits = (uint32_t)x[i] << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        one(t, value, shift);
    }
}

/* float64 values: the lanes are float64 already, so a block is only a unit of work. */
CLONES static void block_f64(totals *t, const double *x, size_t count, double shift) {
    vd low, high, sum = {0}, squares = {0}, magnitude = {0}, centre;
    vl zeros = {0};
    const vl no_sign = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
    for (int j = 0; j < 4; j++) {
        low[j] = __builtin_inf();
        high[j] = -__builtin_inf();
        centre[j] = shift;
    }
    size_t whole = count - count % 4;
    for (size_t i = 0; i < whole; i += 4) {
        vd v;
        memcpy(&v, x + i, sizeof v);
        vd d = v - centre;
        low = (vd)BLEND(v < low, (vl)v, (vl)low);
        high = (vd)BLEND(v > high, (vl)v, (vl)high);
        sum += d;
        squares += d * d;
        magnitude += (vd)((vl)v & no_sign);
        zeros -= (v == 0.0);
    }
    for (int j = 0; j < 4; j++) {
        t->low = low[j] < t->low ? low[j] : t->low;
        t->high = high[j] > t->high ? high[j] : t->high;
        t->sum += sum[j];
        t->squares += squares[j];
        t->magnitude += magnitude[j];
        t->zeros += (double)zeros[j];
    }
    for (size_t i = whole; i < count; i++) one(t, x[i], shift);
}

/* -- finiteness alone ----------------------------------------------------------------------------
 * A value is NaN or infinite exactly when its exponent bits are all ones: an AND, a compare and an
 * OR per lane, with no float arithmetic (so no sum to overflow, and no FP exceptions). */
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef uint64_t vu64 __attribute__((vector_size(64)));

/* ``seen`` lanes (of type VEC, WIDTH of them) OR the values whose EXPONENT bits are all ones; LOAD(i)
 * gives the lanes at value i, SCALAR(i) one value's bits for the tail. */
#define FINITE_CHECK(VEC, WIDTH, EXPONENT, LOAD, SCALAR)                                      \
    VEC seen = {0};                                                                           \
    const VEC exponent = (VEC){0} | (EXPONENT);                                               \
    size_t whole = count - count % (WIDTH);                                                   \
    for (size_t i = 0; i < whole; i += (WIDTH)) {                                            \
        VEC v = LOAD(i);                                                                      \
        seen |= (VEC)((v & exponent) == exponent);                                            \
    }                                                                                         \
    int found = 0;                                                                            \
    for (int j = 0; j < (WIDTH); j++) found |= seen[j] != 0;                                  \
    for (size_t i = whole; i < count; i++) found |= (SCALAR(i) & (EXPONENT)) == (EXPONENT);   \
    t->nonfinite = found;

INLINE vu64 load_u64(const uint64_t *x) {
    vu64 v;
    memcpy(&v, x, sizeof v);
    return v;
}

CLONES static void finite_f32(totals *t, const void *p, size_t count, double unused) {
    (void)unused;
    const uint32_t *x = (const uint32_t *)p;
#define LOAD_U32(i) (vu32)load_u32(x + (i))
#define BITS(i) x[i]
    FINITE_CHECK(vu32, 16, 0x7f800000u, LOAD_U32, BITS)
}

CLONES static void finite_bf16(totals *t, const void *p, size_t count, double unused) {
    (void)unused;
    const uint16_t *x = (const uint16_t *)p;
#define LOAD_BF16_BITS(i) (vu32)load_bf16_bits(x + (i))
    FINITE_CHECK(vu32, 16, 0x7f80u, LOAD_BF16_BITS, BITS)
}

CLONES static void finite_f64(totals *t, const void *p, size_t count, double unused) {
    (void)unused;
    const uint64_t *x = (const uint64_t *)p;
#define LOAD_U64(i) load_u64(x + (i))
    FINITE_CHECK(vu64, 8, 0x7ff0000000000000u, LOAD_U64, BITS)
}

/* -- segments and torch's OpenMP team ------------------------------------------------------------
 *
 * A tensor is cut into segments of SEGMENT values, each summed into its own totals and merged in a
 * fixed order, so the result is the same bits whichever thread read which segment. Tensors under
 * ``team_min`` values (TEAM_MIN_VALUES by default) are read by the calling thread alone. Longer
 * ones, where torch runs on GNU OpenMP, are read whichever way has been reading faster: alone, or
 * shared with torch's own team, claiming segments one at a time from a shared counter.
 *
 * Why measure rather than pick: a parallel region ends at a barrier that waits for every thread of
 * the team, also one that claimed nothing. When another process holds a core, the team's thread
 * there is descheduled and the caller waits a time slice (milliseconds) per region; on a quiet
 * machine the team reads twice as fast. A traced ResNet-50 reads ~170 tensors of 0.1-25 MB per
 * forward: always shared, they took 1.1-3.9 s per forward beside another process; always alone,
 * 0.2-0.9 s there and ~0.2 s against ~0.1 s on a quiet machine. So each way keeps a moving average
 * of its nanoseconds per KiB read over the long tensors it read (statistics and finiteness apart:
 * they do different work per value), the faster is used, and about one long read in EXPLORE_EVERY,
 * picked at random (a fixed stride would always pick the same layer of a forward), goes the other
 * way, so a machine that quietens or fills up is followed within a few dozen long reads. A timing
 * is a hint only: either way gives the same bits.
 */
typedef void (*segment_fn)(totals *, const void *, size_t, double);

static void segment_f32(totals *t, const void *p, size_t count, double shift) {
    block_f32(t, (const float *)p, count, (float)shift);
}
static void segment_bf16(totals *t, const void *p, size_t count, double shift) {
    block_bf16(t, (const uint16_t *)p, count, (float)shift);
}
static void segment_f64(totals *t, const void *p, size_t count, double shift) {
    block_f64(t, (const double *)p, count, shift);
}

typedef struct {
    segment_fn fn;
    const char *base;
    size_t item, count, segments;
    double shift;
    totals *parts;
    atomic_size_t next;     /* the next segment to claim */
    unsigned int csr;       /* the caller's floating-point control state (flush to zero), for every reader */
} job;

/* The calling thread's flush-to-zero and denormals-are-zero bits (torch.set_flush_denormal), so
 * that a team thread reads subnormal values as the caller would: same bits either way. */
#if defined(__x86_64__) || defined(__i386__)
static unsigned int control_state(void) { return _mm_getcsr(); }
static void set_control_state(unsigned int csr) { _mm_setcsr(csr); }
#else
static unsigned int control_state(void) { return 0; }
static void set_control_state(unsigned int csr) { (void)csr; }
#endif

/* Segment k (claimed k-th) is the k-th from the end: the end of a fresh tensor is still cached. */
static void run_segments(job *work) {
    unsigned int own = control_state();
    if (own != work->csr) set_control_state(work->csr);
    for (;;) {
        size_t k = atomic_fetch_add(&work->next, 1);
        if (k >= work->segments) break;
        size_t first = (work->segments - 1 - k) * SEGMENT;
        size_t count = work->count - first < SEGMENT ? work->count - first : SEGMENT;
        start(&work->parts[k]);
        work->fn(&work->parts[k], work->base + first * work->item, count, work->shift);
    }
    if (own != work->csr) set_control_state(own);
}

/* torch's own OpenMP team, where torch runs on GNU OpenMP (its libgomp is loaded globally, so
 * dlsym finds GOMP_parallel). */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static _Atomic(gomp_parallel_fn) gomp_parallel;
static _Atomic int team_threads;       /* 0: no team */
static _Atomic int64_t team_min = TEAM_MIN_VALUES;
static _Atomic pid_t team_pid;         /* a forked child has no team of its parent's: it reads alone */

static void team_body(void *work) { run_segments((job *)work); }

/* Nanoseconds per KiB read, moving averages over long tensors, for statistics [0] and
 * finiteness [1] apart (a finiteness read does less per value); 0: not timed yet. */
static _Atomic int64_t alone_cost[2], team_cost[2];
static _Atomic uint64_t explore_state = 0x9e3779b97f4a7c15u; /* xorshift64: which reads go the other way */
static _Atomic int64_t reads_made[2][2]; /* [kind][shared]: long reads made each way, for tests */
static _Atomic int team_choice; /* 0: the faster way; 1: always the team; 2: never (tests) */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void note_cost(_Atomic int64_t *cost, int64_t elapsed, size_t bytes) {
    int64_t per = elapsed * 1024 / (int64_t)bytes + 1; /* never 0, which means untimed */
    int64_t old = atomic_load(cost);
    atomic_store(cost, old == 0 ? per : (3 * old + per) / 4);
}

/* Whether this long tensor goes to the team: an untimed way first, then the faster one, and about
 * one in EXPLORE_EVERY, at random, the other. */
static int team_reads_next(int kind) {
    int choice = atomic_load(&team_choice);
    if (choice != 0) return choice == 1;
    int64_t alone = atomic_load(&alone_cost[kind]), team = atomic_load(&team_cost[kind]);
    if (team == 0) return 1;
    if (alone == 0) return 0;
    int faster = team < alone;
    uint64_t x = atomic_load(&explore_state); /* a lost update between threads only repeats a draw */
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    atomic_store(&explore_state, x);
    return x % EXPLORE_EVERY == 0 ? !faster : faster;
}

/* How many long reads of ``kind`` (0 statistics, 1 finiteness) went ``shared`` (1) or alone (0). */
int64_t hookscope_long_reads(int kind, int shared) {
    return atomic_load(&reads_made[kind != 0][shared != 0]);
}

/* How long tensors are read: 0 the faster way (the default), 1 always with the team, 2 always alone. */
int hookscope_team_choice(int choice) {
    atomic_store(&team_choice, choice == 1 || choice == 2 ? choice : 0);
    return atomic_load(&team_choice);
}

/* Read tensors of at least ``min_values`` values (<= 0: TEAM_MIN_VALUES) the faster of alone and with
 * torch's OpenMP team of ``threads`` (< 2: always alone); returns 1 when there is such a team. */
int hookscope_use_team(int threads, int64_t min_values) {
    gomp_parallel_fn found = (gomp_parallel_fn)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    atomic_store(&gomp_parallel, found);
    int team = found != NULL && threads > 1 ? threads : 0;
    atomic_store(&team_min, min_values > 0 ? min_values : TEAM_MIN_VALUES);
    atomic_store(&team_pid, getpid());
    atomic_store(&team_threads, team);
    return team > 0;
}

static void measure(segment_fn fn, int kind, const void *values, size_t item, size_t count, double shift, double *out) {
    size_t segments = (count + SEGMENT - 1) / SEGMENT;
    totals few[64];
    totals *parts = segments <= 64 ? few : malloc(segments * sizeof(totals));
    job work = {fn, (const char *)values, item, count, segments, shift, parts ? parts : few, 0, control_state()};
    int team = atomic_load(&team_threads);
    if (parts == NULL) { /* out of memory for the list: read it in one go, alone */
        work.segments = 1;
        start(&few[0]);
        fn(&few[0], values, count, shift);
    } else if (segments > 1 && team > 0 && (int64_t)count >= atomic_load(&team_min) && getpid() == team_pid) {
        int shared = team_reads_next(kind);
        int64_t began = now_ns();
        if (shared)
            atomic_load(&gomp_parallel)(team_body, &work, (unsigned)team, 0); /* the caller is one of the team */
        else
            run_segments(&work);
        note_cost(shared ? &team_cost[kind] : &alone_cost[kind], now_ns() - began, count * item);
        atomic_fetch_add(&reads_made[kind][shared], 1);
    } else {
        run_segments(&work);
    }
    /* Every segment is written now: the team's end is a barrier. */
    totals t;
    start(&t);
    for (size_t k = 0; k < work.segments; k++) {
        const totals *part = &work.parts[k];
        t.low = part->low < t.low ? part->low : t.low;
        t.high = part->high > t.high ? part->high : t.high;
        t.sum += part->sum;
        t.squares += part->squares;
        t.magnitude += part->magnitude;
        t.zeros += part->zeros;
        t.nonfinite = part->nonfinite > t.nonfinite ? part->nonfinite : t.nonfinite;
    }
    if (parts != few) free(parts);
    finish(&t, shift, out);
}

/* No values: what an empty tensor has (no extremes, zero sums), and -1 for the caller. */
static int nothing(double shift, double *out) {
    totals t;
    start(&t);
    finish(&t, shift, out);
    return -1;
}

static float bf16_value(const void *values) {
    uint32_t bits = (uint32_t)(*(const uint16_t *)values) << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The entry points: ``values`` holds ``count`` contiguous values; ``out`` OUT_FIELDS doubles. A NaN
 * ``wanted`` shift asks for the first value. Return 0, or -1 for ``count <= 0`` (nothing is read). */
int hookscope_stats_f32(const void *values, int64_t count, double wanted, double *out) {
    if (count <= 0) return nothing(wanted, out);
    float shift = wanted == wanted ? (float)wanted : *(const float *)values;
    measure(segment_f32, 0, values, sizeof(float), (size_t)count, shift, out);
    return 0;
}

int hookscope_stats_bf16(const void *values, int64_t count, double wanted, double *out) {
    if (count <= 0) return nothing(wanted, out);
    float shift = wanted == wanted ? (float)wanted : bf16_value(values);
    measure(segment_bf16, 0, values, sizeof(uint16_t), (size_t)count, shift, out);
    return 0;
}

int hookscope_stats_f64(const void *values, int64_t count, double wanted, double *out) {
    if (count <= 0) return nothing(wanted, out);
    double shift = wanted == wanted ? wanted : *(const double *)values;
    measure(segment_f64, 0, values, sizeof(double), (size_t)count, shift, out);
    return 0;
}

/* Whether any of ``count`` contiguous values is NaN or infinite: out[7] is 1 or 0. */
int hookscope_finite_f32(const void *values, int64_t count, double unused, double *out) {
    (void)unused;
    if (count <= 0) return nothing(0.0, out);
    measure(finite_f32, 1, values, sizeof(float), (size_t)count, 0.0, out);
    return 0;
}

int hookscope_finite_bf16(const void *values, int64_t count, double unused, double *out) {
    (void)unused;
    if (count <= 0) return nothing(0.0, out);
    measure(finite_bf16, 1, values, sizeof(uint16_t), (size_t)count, 0.0, out);
    return 0;
}

int hookscope_finite_f64(const void *values, int64_t count, double unused, double *out) {
    (void)unused;
    if (count <= 0) return nothing(0.0, out);
    measure(finite_f64, 1, values, sizeof(double), (size_t)count, 0.0, out);
    return 0;
}
