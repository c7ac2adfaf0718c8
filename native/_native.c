/*
 * fastload._native: batch assembly of cache payloads in C.
 *
 * gather(jobs, out, threads) reads many cache payload files (fastload/codec.py
 * format), checks each against its index record and its own header, decodes
 * its LZ4 chunks, verifies the xxh3_64 checksum of the raw bytes, and copies
 * the requested byte ranges into one writable, C-contiguous output buffer
 * (a numpy array, a bytearray, or the numpy view of a pinned torch tensor).
 * The GIL is released for all I/O, decoding and hashing, and the jobs are
 * split across a small pool of threads created for the call.
 *
 * Nothing here trusts the payload: every size and offset read from a file is
 * checked against the file size, the LZ4 worst-case bound and the index record
 * before it is used, and every copy is checked against the raw size and the
 * output buffer when the arguments are parsed, before any I/O. A bad payload
 * is reported per job ("corrupt", message), never by crashing, so the caller
 * drops and refetches it exactly as the pure-Python path (fastload/cache/gather.py)
 * does. tests/unit/test_native.py checks both paths agree; native/fuzz.py
 * fuzzes them against each other.
 *
 * LZ4_decompress_safe and XXH3_64bits are not linked: fastload/cache/gather.py finds
 * them at run time in libraries that are already installed (the lz4 and xxhash
 * Python packages' extension modules, or system liblz4 / libxxhash) and passes
 * their addresses to bind(), after which a self-test compares the results with
 * the Python packages'. See native/README.md.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lines.h"

/* The payload format (fastload/codec.py). */
#define HEADER_BYTES 36
#define MAX_META_BYTES 65536
#define MAX_RATIO 255
#define CODEC_RAW 0
#define CODEC_LZ4 1
/* Scratch buffers kept between calls (avoids page-faulting fresh memory for
   every 8 MiB block); at most this many bytes are retained in total. */
#define SCRATCH_SLOTS 16
#define SCRATCH_KEEP_BYTES ((size_t)128 << 20)
#define MAX_THREADS 32


typedef int (*lz4_safe_fn)(const char *src, char *dst, int src_size, int dst_capacity);
typedef int (*lz4_partial_fn)(const char *src, char *dst, int src_size, int target_size, int dst_capacity);
typedef uint64_t (*xxh3_fn)(const void *data, size_t len);

static lz4_safe_fn lz4_decompress_safe = NULL;
static lz4_partial_fn lz4_decompress_safe_partial = NULL; /* optional */
static xxh3_fn xxh3_64 = NULL;
/* Optional, xxh3's streaming form: a large raw payload is then read straight into the
   output and hashed piece by piece while each piece is still in the CPU's cache (direct_raw). */
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_free_fn)(void *state);
typedef int (*xxh3_reset_fn)(void *state);
typedef int (*xxh3_update_fn)(void *state, const void *data, size_t len);
typedef uint64_t (*xxh3_digest_fn)(const void *state);
static struct {
    xxh3_create_fn create;
    xxh3_free_fn free;
    xxh3_reset_fn reset;
    xxh3_update_fn update;
    xxh3_digest_fn digest;
} xxh3_stream;

enum { ST_OK = 0, ST_MISSING, ST_CORRUPT, ST_OSERROR, ST_NOMEM, ST_META };

typedef struct {
    uint64_t src, len, dst;
} Copy;

typedef struct {
    /* inputs */
    const char *path;     /* payload file, or NULL when mem is the payload */
    const uint8_t *mem;
    uint64_t mem_len;
    uint64_t stored, raw, checksum;
    uint64_t offset;         /* where the payload starts in its file */
    int packed;              /* one of many payloads in a pack file: read exactly `stored` at `offset` */
    uint64_t stored_checksum;
    int has_stored_checksum; /* the index records an xxh3_64 of the whole payload */
    int codec;               /* the index's codec; the header must agree */
    Copy *copies;
    Py_ssize_t ncopies;
    /* outputs */
    int status;
    int err;              /* errno for ST_OSERROR */
    uint8_t *meta;        /* ST_META: metadata bytes for Python to validate */
    uint32_t meta_len;
    char msg[256];
} Job;

typedef struct {
    int codec;
    uint64_t raw_size;
    uint32_t chunk_bytes, n_chunks;
    uint64_t checksum;
    uint32_t meta_len;
    uint64_t meta_off, table_off, body_off;
} Info;

static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }

static int fail(Job *job, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(job->msg, sizeof job->msg, fmt, ap);
    va_end(ap);
    job->status = status;
    return -1;
}

/* Python's repr() of a 4-byte bytes object, close enough for a message. */
static void bytes_repr(const uint8_t *p, size_t n, char *out, size_t cap) {
    size_t k = 0;
    k += (size_t)snprintf(out + k, cap - k, "b'");
    for (size_t i = 0; i < n && k + 5 < cap; i++) {
        uint8_t c = p[i];
        if (c == '\\' || c == '\'')
            k += (size_t)snprintf(out + k, cap - k, "\\%c", c);
        else if (c >= 0x20 && c < 0x7f)
            out[k++] = (char)c;
        else
            k += (size_t)snprintf(out + k, cap - k, "\\x%02x", c);
    }
    snprintf(out + k, cap - k, "'");
}

/* Parse and bounds-check the header of the `total`-byte payload `buf`, as
 * codec.parse_header does (the JSON check of the metadata excepted: see ST_META).
 * Returns 0 when valid, -1 (job marked corrupt) if not. */
static int parse_header(const uint8_t *buf, uint64_t total, Info *info, Job *job) {
    if (total < HEADER_BYTES)
        return fail(job, ST_CORRUPT, "payload is %llu B, shorter than the %d B header",
                    (unsigned long long)total, HEADER_BYTES);
    if (memcmp(buf, "FLP1", 4) != 0) {
        char r[32];
        bytes_repr(buf, 4, r, sizeof r);
        return fail(job, ST_CORRUPT, "payload magic is %s, expected b'FLP1': not a fastload payload", r);
    }
    int version = buf[4], codec = buf[5];
    if (version != 1)
        return fail(job, ST_CORRUPT, "payload version %d is not supported (expected 1)", version);
    if (codec != CODEC_RAW && codec != CODEC_LZ4)
        return fail(job, ST_CORRUPT, "payload codec id %d is unknown", codec);
    info->codec = codec;
    info->raw_size = rd64(buf + 8);
    info->chunk_bytes = rd32(buf + 16);
    info->n_chunks = rd32(buf + 20);
    info->checksum = rd64(buf + 24);
    info->meta_len = rd32(buf + 32);
    if (info->meta_len > MAX_META_BYTES || HEADER_BYTES + (uint64_t)info->meta_len > total)
        return fail(job, ST_CORRUPT, "payload metadata length %u B exceeds the payload or the limit",
                    info->meta_len);
    if (info->chunk_bytes == 0) return fail(job, ST_CORRUPT, "payload chunk size is 0");
    uint64_t pos = HEADER_BYTES + (uint64_t)info->meta_len;
    info->meta_off = HEADER_BYTES;
    info->table_off = pos;
    if (codec == CODEC_RAW) {
        if (info->n_chunks != 0 || total - pos != info->raw_size)
            return fail(job, ST_CORRUPT, "raw payload body is %llu B but the header says %llu B",
                        (unsigned long long)(total - pos), (unsigned long long)info->raw_size);
        info->body_off = pos;
        return 0;
    }
    uint64_t cb = info->chunk_bytes, raw = info->raw_size;
    uint64_t expected = raw / cb + (raw % cb != 0);
    if ((uint64_t)info->n_chunks != expected)
        return fail(job, ST_CORRUPT, "payload has %u chunks; %llu B in %llu B chunks needs %llu",
                    info->n_chunks, (unsigned long long)raw, (unsigned long long)cb,
                    (unsigned long long)expected);
    uint64_t table = 4 * (uint64_t)info->n_chunks;
    if (pos + table > total)
        return fail(job, ST_CORRUPT, "payload chunk table runs past the end of the payload");
    const uint8_t *t = buf + pos;
    pos += table;
    uint64_t body = total - pos, sum = 0;
    for (uint32_t i = 0; i < info->n_chunks; i++) sum += rd32(t + 4 * (uint64_t)i); /* < 2^64: n < 2^32 */
    if (sum != body)
        return fail(job, ST_CORRUPT, "payload chunks total %llu B but the body is %llu B",
                    (unsigned long long)sum, (unsigned long long)body);
    /* sum == body <= total, so 255 * sum cannot overflow for any real file size. */
    if (raw > MAX_RATIO * (sum ? sum : 1))
        return fail(job, ST_CORRUPT, "payload claims %llu B from a %llu B body; impossible for LZ4",
                    (unsigned long long)raw, (unsigned long long)sum);
    for (uint32_t i = 0; i < info->n_chunks; i++) {
        uint64_t size = rd32(t + 4 * (uint64_t)i);
        uint64_t rc = (i + 1 < info->n_chunks || raw % cb == 0) ? cb : raw % cb;
        if (size == 0 || size > rc + rc / 255 + 16)
            return fail(job, ST_CORRUPT, "payload chunk of %llu B cannot hold %llu B of LZ4 data",
                        (unsigned long long)size, (unsigned long long)rc);
    }
    info->body_off = pos;
    return 0;
}

/* -- scratch buffers, kept between calls --------------------------------------- */

typedef struct {
    uint8_t *comp, *raw;
    size_t comp_cap, raw_cap;
    int in_use, heap;
} Scratch;

static Scratch slots[SCRATCH_SLOTS];
static pthread_mutex_t slots_lock = PTHREAD_MUTEX_INITIALIZER;

static Scratch *scratch_get(void) {
    Scratch *s = NULL;
    pthread_mutex_lock(&slots_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (!slots[i].in_use) {
            s = &slots[i];
            s->in_use = 1;
            break;
        }
    pthread_mutex_unlock(&slots_lock);
    if (s == NULL) {
        s = calloc(1, sizeof *s);
        if (s != NULL) s->heap = 1;
    }
    return s;
}

static void scratch_free(Scratch *s) {
    free(s->comp);
    free(s->raw);
    s->comp = s->raw = NULL;
    s->comp_cap = s->raw_cap = 0;
}

static void scratch_put(Scratch *s) {
    if (s == NULL) return;
    if (s->heap) {
        scratch_free(s);
        free(s);
        return;
    }
    pthread_mutex_lock(&slots_lock);
    size_t kept = 0;
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (&slots[i] != s) kept += slots[i].comp_cap + slots[i].raw_cap;
    if (kept + s->comp_cap + s->raw_cap > SCRATCH_KEEP_BYTES) scratch_free(s);
    s->in_use = 0;
    pthread_mutex_unlock(&slots_lock);
}

static int ensure(uint8_t **buf, size_t *cap, uint64_t need) {
    if (need > (uint64_t)PTRDIFF_MAX - 65536) return -1;
#ifdef FASTLOAD_EXACT_ALLOC /* native/fuzz.py --asan: redzones right after the data */
    size_t n = (size_t)need;
    if (*buf != NULL && need == *cap) return 0;
#else
    if (need <= *cap && *buf != NULL) return 0;
    size_t n = ((size_t)need + 65535) & ~(size_t)65535;
#endif
    free(*buf);
    void *fresh = NULL; /* on a line: a read into scratch is never a slow_copy */
    *buf = posix_memalign(&fresh, LINE, n ? n : 1) == 0 ? fresh : NULL;
    *cap = *buf ? n : 0;
    return *buf ? 0 : -1;
}

/* -- one job --------------------------------------------------------------------- */

static int read_full(int fd, uint8_t *dst, uint64_t n, uint64_t off, uint64_t *got) {
    uint64_t done = 0;
    while (done < n) {
        size_t want = (size_t)((n - done) > (1u << 30) ? (1u << 30) : (n - done));
        ssize_t r = pread(fd, dst + done, want, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        done += (uint64_t)r;
    }
    *got = done;
    return 0;
}

/* How much of raw chunk [lo, lo + n) the copies need: the end of the last wanted
   byte, relative to lo (0: none of it). */
static uint64_t wanted(const Job *job, uint64_t lo, uint64_t n) {
    uint64_t end = 0;
    for (Py_ssize_t i = 0; i < job->ncopies; i++) {
        const Copy *c = &job->copies[i];
        if (c->len && c->src < lo + n && lo < c->src + c->len) {
            uint64_t e = c->src + c->len - lo;
            if (e > end) end = e > n ? n : e;
        }
    }
    return end;
}

/* Decode (LZ4) or locate (raw) the body, verify it, copy the ranges out.
 *
 * An intact payload (its stored checksum matched) is byte-for-byte what the
 * encoder wrote, so it decodes to what was encoded: as in Cache.get, the raw
 * checksum is then not recomputed, and only the chunks that hold a requested
 * range are decoded (an 8 KB token window needs one 1 MiB chunk of an 8 MiB
 * block, not all eight), and each only up to the last wanted byte (an LZ4 block
 * decodes front to back; LZ4_decompress_safe_partial stops there, half a chunk
 * on average). Without a stored checksum every chunk is decoded in full and the
 * raw checksum verified. */
static void finish(Job *job, const uint8_t *payload, const Info *info, uint8_t *out, Scratch *s, int intact) {
    int whole = job->ncopies == 1 && job->copies[0].src == 0 && job->copies[0].len == job->raw;
    const uint8_t *raw;
    if (info->codec == CODEC_RAW) {
        raw = payload + info->body_off;
    } else {
        uint8_t *dst;
        if (whole) {
            dst = out + job->copies[0].dst;
        } else {
            if (ensure(&s->raw, &s->raw_cap, info->raw_size) < 0) {
                fail(job, ST_NOMEM, "cannot allocate %llu B to decode a payload", (unsigned long long)info->raw_size);
                return;
            }
            dst = s->raw;
        }
        const uint8_t *t = payload + info->table_off;
        uint64_t off = info->body_off, cb = info->chunk_bytes;
        for (uint32_t i = 0; i < info->n_chunks; i++) {
            uint64_t size = rd32(t + 4 * (uint64_t)i);
            uint64_t rc = (i + 1 < info->n_chunks || info->raw_size % cb == 0) ? cb : info->raw_size % cb;
            uint64_t at = (uint64_t)i * cb;
            uint64_t need = intact && !whole ? wanted(job, at, rc) : rc;
            if (need == 0) {
                off += size;
                continue;
            }
            if (size > INT_MAX || rc > INT_MAX) {
                fail(job, ST_CORRUPT, "LZ4 chunk at offset %llu is corrupt: a chunk of %llu B is too large",
                     (unsigned long long)off, (unsigned long long)rc);
                return;
            }
            int n;
            if (need < rc && lz4_decompress_safe_partial != NULL) {
                n = lz4_decompress_safe_partial((const char *)payload + off, (char *)dst + at, (int)size, (int)need, (int)rc);
                if (n >= (int)need) n = (int)rc; /* the wanted prefix is there: the rest is not looked at */
            } else {
                n = lz4_decompress_safe((const char *)payload + off, (char *)dst + at, (int)size, (int)rc);
            }
            if (n < 0) {
                fail(job, ST_CORRUPT,
                     "LZ4 chunk at offset %llu is corrupt: Decompression failed: corrupt input or "
                     "insufficient space in destination buffer. Error code: %d",
                     (unsigned long long)off, -n);
                return;
            }
            if ((uint64_t)n != rc) {
                fail(job, ST_CORRUPT, "LZ4 chunk at offset %llu decoded to %d B, expected %llu B",
                     (unsigned long long)off, n, (unsigned long long)rc);
                return;
            }
            off += size;
        }
        raw = dst;
    }
    if (!intact && xxh3_64(raw, (size_t)info->raw_size) != info->checksum) {
        fail(job, ST_CORRUPT, "payload checksum mismatch: the raw bytes differ from what was written");
        return;
    }
    for (Py_ssize_t i = 0; i < job->ncopies; i++) {
        const Copy *c = &job->copies[i];
        uint8_t *to = out + c->dst;
        if (c->len && to != raw + c->src) copy_out(to, raw + c->src, (size_t)c->len);
    }
}

/* Everything Cache.get checks before decoding, in its order: size, stored checksum,
 * header, header against the index; then the metadata (JSON-checked by Python
 * unless it is "{}"). Returns 0 and sets *intact, or -1 with the job marked. */
static int check_header(Job *job, const uint8_t *payload, uint64_t size, Info *info);

static int check(Job *job, const uint8_t *payload, uint64_t size, Info *info, int *intact) {
    if (size != job->stored)
        return fail(job, ST_CORRUPT, "payload is %llu B, index says %llu B", (unsigned long long)size,
                    (unsigned long long)job->stored);
    *intact = job->has_stored_checksum;
    if (*intact && xxh3_64(payload, (size_t)size) != job->stored_checksum)
        return fail(job, ST_CORRUPT, "stored checksum mismatch: the payload file changed on disk");
    return check_header(job, payload, size, info);
}

/* check()'s part after the stored checksum: the header, against the index, then the metadata
 * (``payload`` needs to hold only the header and the metadata). */
static int check_header(Job *job, const uint8_t *payload, uint64_t size, Info *info) {
    if (parse_header(payload, size, info, job) != 0) return -1;
    if (info->checksum != job->checksum || info->raw_size != job->raw || info->codec != job->codec)
        return fail(job, ST_CORRUPT, "payload header disagrees with the index");
    uint32_t m = info->meta_len, blank = m;
    while (blank > 0 && payload[info->meta_off + blank - 1] == ' ') blank--; /* spaces place the body (codec.line_pad) */
    if (m == 0 || (blank == 2 && payload[info->meta_off] == '{' && payload[info->meta_off + 1] == '}')) return 0;
    job->meta = malloc(m);
    if (job->meta == NULL) return fail(job, ST_NOMEM, "cannot allocate %u B of metadata", m);
    memcpy(job->meta, payload + info->meta_off, m);
    job->meta_len = m;
    return 0;
}

/* Why: a whole raw block read the usual way went through the scratch buffer: the kernel
 * copied it there, xxh3 read it, and memcpy copied it again into the output. Reading
 * 8 MiB blocks back ran at 0.53 of open() (issue 35). Here the kernel copies each piece
 * straight into the output and the stored checksum is updated over it while the piece
 * is still in the CPU's cache; the checks and their order and messages are check()'s. */
#define DIRECT_MIN ((uint64_t)1 << 20) /* smaller payloads: one pread into scratch costs no more */
#define DIRECT_PIECE ((uint64_t)256 << 10) /* fits a core's L2 cache */

/* Defined with the pool (below): the body read with a pool helper, or -1 when none is free. */
static int shared_read(int fd, uint8_t *body, uint64_t start, uint64_t len, void *state, int *err, uint64_t *got);

/* direct_raw's reads through a piece of scratch, and those shared with a helper (atomic): large_reads() */
static unsigned long long reads_lined = 0, reads_shared = 0;

static int direct_fits(const Job *job) {
    return xxh3_stream.digest != NULL && job->path != NULL && job->codec == CODEC_RAW && job->has_stored_checksum &&
           job->raw >= DIRECT_MIN && job->ncopies == 1 && job->copies[0].src == 0 && job->copies[0].len == job->raw &&
           job->stored > job->raw && job->stored - job->raw >= HEADER_BYTES &&
           job->stored - job->raw <= HEADER_BYTES + MAX_META_BYTES;
}

/* Read the payload of ``fd`` (a direct_fits job) into scratch (its header and metadata)
 * and the output (its body), then check it. Returns 0 when it was read (job->status says
 * how the checks went), -1 when memory for the hash state ran out (the usual road then). */
static int direct_raw(Job *job, int fd, uint8_t *out, Scratch *s) {
    uint64_t head = job->stored - job->raw;
    if (ensure(&s->comp, &s->comp_cap, head) < 0) return -1;
    void *state = xxh3_stream.create();
    if (state == NULL) return -1;
    xxh3_stream.reset(state);
    uint64_t got = 0;
    int rc = read_full(fd, s->comp, head, job->offset, &got);
    if (rc == 0 && got == head) xxh3_stream.update(state, s->comp, (size_t)head);
    uint8_t *body = out + job->copies[0].dst;
    uint64_t start = job->offset + head;
    uint8_t *piece = NULL; /* a slow_copy read goes through a piece of scratch, on a line */
    if (slow_copy((uintptr_t)body, (uintptr_t)start)) {
        if (ensure(&s->raw, &s->raw_cap, DIRECT_PIECE) < 0) {
            xxh3_stream.free(state);
            return -1;
        }
        piece = s->raw;
        __atomic_add_fetch(&reads_lined, 1, __ATOMIC_RELAXED);
    }
    int err = 0; /* a shared read's errno */
    int shared = piece == NULL && rc == 0 && got == head &&
                 shared_read(fd, body, start, job->raw, state, &err, &got) == 0;
    if (shared && err) rc = -1;
    for (uint64_t done = 0; !shared && rc == 0 && got == head + done && done < job->raw;) {
        uint64_t want = job->raw - done < DIRECT_PIECE ? job->raw - done : DIRECT_PIECE, more = 0;
        uint8_t *to = piece != NULL ? piece : body + done;
        rc = read_full(fd, to, want, start + done, &more);
        if (rc == 0 && more) xxh3_stream.update(state, to, (size_t)more);
        if (rc == 0 && more && piece != NULL) line_copy(body + done, piece, (size_t)more);
        got += more;
        done += more;
        if (more < want) break; /* end of file: a short payload */
    }
    int saved = err ? err : errno;
    uint64_t digest = xxh3_stream.digest(state);
    xxh3_stream.free(state);
    if (rc < 0) {
        job->err = saved;
        job->status = ST_OSERROR;
    } else if (got != job->stored) {
        fail(job, ST_CORRUPT, "payload is %llu B, index says %llu B", (unsigned long long)got,
             (unsigned long long)job->stored);
    } else if (digest != job->stored_checksum) {
        fail(job, ST_CORRUPT, "stored checksum mismatch: the payload file changed on disk");
    } else {
        Info info = {0};
        check_header(job, s->comp, job->stored, &info);
    }
    return 0;
}

/* Pack files held open for one thread's share of a batch (work_on): a batch of small samples reads
 * each of a few packs many times, and an open and a close per job cost more than reading a 4 KiB
 * sample (benchmarks/scale). Within a batch, a pack replaced or punched since its open reads as
 * the entry that named it was written, or fails the checks as any stale entry does. */
#define OPEN_PACKS 16

typedef struct {
    const char *path[OPEN_PACKS]; /* a job's path: the batch's own bytes objects, alive while it runs */
    int fd[OPEN_PACKS];
    int n, next; /* slots held; the one reused next once all are */
} Packs;

static unsigned long long files_opened = 0; /* payload files opened since import (atomic): opened() */

static int open_payload(const Job *job, Packs *packs) {
    if (job->packed)
        for (int i = 0; i < packs->n; i++)
            if (strcmp(packs->path[i], job->path) == 0) return packs->fd[i];
    __atomic_add_fetch(&files_opened, 1, __ATOMIC_RELAXED);
    int fd = open(job->path, O_RDONLY | O_CLOEXEC);
    if (!job->packed) return fd;
    if (fd < 0) return fd;
    int slot = packs->n;
    if (packs->n < OPEN_PACKS) {
        packs->n++;
    } else {
        slot = packs->next;
        packs->next = (packs->next + 1) % OPEN_PACKS;
        close(packs->fd[slot]);
    }
    packs->path[slot] = job->path;
    packs->fd[slot] = fd;
    return fd;
}

static void close_payload(const Job *job, int fd) {
    if (!job->packed) close(fd); /* a pack's stays open until packs_close */
}

static void packs_close(Packs *packs) {
    for (int i = 0; i < packs->n; i++) close(packs->fd[i]);
    packs->n = packs->next = 0;
}

static void run_job(Job *job, uint8_t *out, Scratch *s, Packs *packs) {
    Info info = {0};
    int intact = 0;
    const uint8_t *payload;
    uint64_t size;
    if (s == NULL) {
        fail(job, ST_NOMEM, "cannot allocate scratch space");
        return;
    }
    if (job->path == NULL) { /* an in-memory payload */
        payload = job->mem;
        size = job->mem_len;
    } else {
        int fd = open_payload(job, packs);
        if (fd < 0) {
            job->err = errno;
            job->status = errno == ENOENT ? ST_MISSING : ST_OSERROR;
            return;
        }
        /* Read one byte more than the index promises: a longer file shows as a size
           mismatch without an fstat per job. Above 1 MiB an fstat costs nothing in
           comparison, and a wrong size in the index then never sizes an allocation. */
        uint64_t got = 0, want = job->stored + (job->packed ? 0 : 1);
        if (!job->packed && job->stored > ((uint64_t)1 << 20)) {
            struct stat st;
            if (fstat(fd, &st) != 0) {
                job->err = errno;
                job->status = ST_OSERROR;
                close_payload(job, fd);
                return;
            }
            if ((uint64_t)st.st_size != job->stored) {
                close_payload(job, fd);
                fail(job, ST_CORRUPT, "payload is %llu B, index says %llu B", (unsigned long long)st.st_size,
                     (unsigned long long)job->stored);
                return;
            }
        }
        if (direct_fits(job) && direct_raw(job, fd, out, s) == 0) {
            close_payload(job, fd);
            goto checked;
        }
        if (job->stored > (uint64_t)PTRDIFF_MAX - 65536 || ensure(&s->comp, &s->comp_cap, want) < 0) {
            close_payload(job, fd);
            fail(job, ST_NOMEM, "cannot allocate %llu B to read a payload", (unsigned long long)want);
            return;
        }
        /* One pread in the common case: it returns `stored` bytes (end of file) or
           stored + 1 (the file is longer). Only a shorter read is continued. */
        int rc = 0;
        ssize_t r;
        do {
            r = pread(fd, s->comp, (size_t)want, (off_t)job->offset);
        } while (r < 0 && errno == EINTR);
        if (r < 0) {
            rc = -1;
        } else {
            got = (uint64_t)r;
            if (got < job->stored && got > 0) {
                uint64_t more = 0;
                rc = read_full(fd, s->comp + got, want - got, job->offset + got, &more);
                got += more;
            }
        }
        int saved = errno;
        if (rc == 0 && !job->packed && got > job->stored) {
            struct stat st;
            if (fstat(fd, &st) == 0) got = (uint64_t)st.st_size;
        }
        close_payload(job, fd);
        if (rc < 0) {
            job->err = saved;
            job->status = ST_OSERROR;
            return;
        }
        payload = s->comp;
        size = got; /* != stored: reported by check() as a size mismatch */
    }
    if (check(job, payload, size, &info, &intact) == 0) finish(job, payload, &info, out, s, intact);
checked:
    if (job->meta != NULL) {
        if (job->status != ST_OK) {
            free(job->meta);
            job->meta = NULL;
        } else {
            job->status = ST_META;
        }
    }
}

/* -- the pool --------------------------------------------------------------------
 *
 * Worker threads are started on first need and then kept, waiting on a condition
 * variable: starting threads for every call cost 40-190 us on the benchmark
 * machine, as much as reading a few dozen small payloads. The calling thread
 * always works on its own batch too, so a batch completes even if no helper is
 * free (or none could be started). After fork() the child has no workers; the
 * atfork handler forgets them and the next call starts new ones. */

typedef struct Batch {
    Job *jobs;
    Py_ssize_t njobs;
    uint8_t *out;
    Py_ssize_t next;      /* next job to take (atomic) */
    int helpers_wanted;   /* helpers that may still join (pool_lock) */
    int active;           /* threads working on it (pool_lock) */
    struct Batch *link;   /* queue of batches that want helpers (pool_lock) */
    struct Shared *shared; /* not jobs but a large read to share (shared_read) */
} Batch;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;
static Batch *pool_queue = NULL;
static int pool_threads = 0, pool_idle = 0;
static int cpus = 1;  /* CPUs this process may run on (sched_getaffinity), at import */
static int busy = 0;  /* threads inside work_on, callers and helpers (atomic) */

static void work_on(Batch *b) {
    __atomic_add_fetch(&busy, 1, __ATOMIC_RELAXED);
    Scratch *s = scratch_get();
    Packs packs = {.n = 0};
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->njobs) break;
        run_job(&b->jobs[i], b->out, s, &packs);
    }
    packs_close(&packs);
    scratch_put(s);
    __atomic_sub_fetch(&busy, 1, __ATOMIC_RELAXED);
}

static void unqueue(Batch *b) {
    for (Batch **p = &pool_queue; *p != NULL; p = &(*p)->link)
        if (*p == b) {
            *p = b->link;
            return;
        }
}

static void shared_work(struct Shared *f);

static void *pool_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&pool_lock);
    for (;;) {
        while (pool_queue == NULL) {
            pool_idle++;
            pthread_cond_wait(&pool_work, &pool_lock);
            pool_idle--;
        }
        Batch *b = pool_queue;
        if (--b->helpers_wanted <= 0) unqueue(b);
        b->active++;
        pthread_mutex_unlock(&pool_lock);
        if (b->shared != NULL)
            shared_work(b->shared);
        else
            work_on(b);
        pthread_mutex_lock(&pool_lock);
        if (--b->active == 0) pthread_cond_broadcast(&pool_done);
    }
    return NULL;
}

/* Queue b for up to `helpers` pool threads, starting threads so that enough are idle. */
static void pool_lend(Batch *b, int helpers) {
    pthread_mutex_lock(&pool_lock);
    int want = helpers - pool_idle;
    if (want > 0) {
        pthread_attr_t attr;
        int have_attr = pthread_attr_init(&attr) == 0;
        if (have_attr) {
            pthread_attr_setstacksize(&attr, 256 * 1024);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        }
        for (int i = 0; i < want && pool_threads < MAX_THREADS; i++) {
            pthread_t tid;
            if (!have_attr || pthread_create(&tid, &attr, pool_main, NULL) != 0) break;
            pool_threads++;
        }
        if (have_attr) pthread_attr_destroy(&attr);
    }
    b->helpers_wanted = helpers;
    b->active = 1;
    b->link = pool_queue;
    pool_queue = b;
    pthread_cond_broadcast(&pool_work);
    pthread_mutex_unlock(&pool_lock);
}

/* Once the caller has nothing left to take: no new helpers, and wait for those that joined. */
static void pool_wait(Batch *b) {
    pthread_mutex_lock(&pool_lock);
    if (b->helpers_wanted > 0) unqueue(b);
    b->helpers_wanted = 0;
    b->active--;
    while (b->active > 0) pthread_cond_wait(&pool_done, &pool_lock);
    pthread_mutex_unlock(&pool_lock);
}

/* CPUs not working on a gather now: the one bound on helpers, for batches and shared reads alike. */
static int idle_cpus(void) { return cpus - __atomic_load_n(&busy, __ATOMIC_RELAXED); }

static void run_batch(Batch *b, int threads) {
    if (threads > b->njobs) threads = (int)b->njobs;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* Helpers only for idle CPUs: when the loader already calls from several threads
       (read_threads=8), each call runs in its caller, and no more scratch buffers are
       in use than there are CPUs working (benchmarks/native/bench.py, loader case). */
    int room = idle_cpus();
    if (threads > room) threads = room;
    if (threads <= 1) {
        work_on(b);
        return;
    }
    pool_lend(b, threads - 1);
    work_on(b); /* all jobs are taken when this returns; helpers may still be finishing */
    pool_wait(b);
}

/* -- a large read shared with a pool helper ------------------------------------------
 *
 * Why: reading an 8 MiB raw block back, the kernel's copy into the output and the stored
 * checksum over it ran one after the other, at 0.68-0.72 of open() (issue 35). With a CPU
 * idle, a pool helper reads pieces too, and the caller reads those not yet taken and
 * hashes them all in order: the checksum overlaps the reads. */
#define SHARED_MIN ((uint64_t)2 << 20) /* below it a helper's wake-up costs what it saves */
#define UNREAD (-2)

typedef struct Shared {
    int fd;
    uint8_t *body;
    uint64_t start, len, pieces;
    uint64_t next; /* the next piece to take (atomic) */
    int64_t *got;  /* per piece: UNREAD, -1 (failed: errno in err) or the bytes read (atomic) */
    int err;       /* (atomic) */
} Shared;

static uint64_t shared_want(const Shared *f, uint64_t i) {
    uint64_t at = i * DIRECT_PIECE;
    return f->len - at < DIRECT_PIECE ? f->len - at : DIRECT_PIECE;
}

static void shared_take(Shared *f, uint64_t i) {
    uint64_t more = 0;
    int64_t r = read_full(f->fd, f->body + i * DIRECT_PIECE, shared_want(f, i), f->start + i * DIRECT_PIECE, &more)
                    == 0 ? (int64_t)more : -1;
    if (r < 0) __atomic_store_n(&f->err, errno, __ATOMIC_RELAXED);
    __atomic_store_n(&f->got[i], r, __ATOMIC_RELEASE);
}

static void shared_work(Shared *f) {
    __atomic_add_fetch(&busy, 1, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t i = __atomic_fetch_add(&f->next, 1, __ATOMIC_RELAXED);
        if (i >= f->pieces) break;
        shared_take(f, i);
    }
    __atomic_sub_fetch(&busy, 1, __ATOMIC_RELAXED);
}

/* Read the body [start, start + len) of fd into body and update the xxh3 state over it in
 * order, with a pool helper. Returns -1 (nothing read) when no CPU is idle or memory is
 * short; else 0, with *got grown by the bytes read up to the first short piece, and *err
 * the errno of a failed read (0: none). */
static int shared_read(int fd, uint8_t *body, uint64_t start, uint64_t len, void *state, int *err, uint64_t *got) {
    if (len < SHARED_MIN || idle_cpus() < 1) return -1;
    Shared f = {.fd = fd, .body = body, .start = start, .len = len, .pieces = (len + DIRECT_PIECE - 1) / DIRECT_PIECE};
    f.got = malloc(f.pieces * sizeof *f.got);
    if (f.got == NULL) return -1;
    for (uint64_t i = 0; i < f.pieces; i++) f.got[i] = UNREAD;
    Batch b = {.shared = &f};
    pool_lend(&b, 1);
    __atomic_add_fetch(&reads_shared, 1, __ATOMIC_RELAXED);
    uint64_t done = 0;
    for (uint64_t i = 0; i < f.pieces; i++) {
        int64_t r;
        while ((r = __atomic_load_n(&f.got[i], __ATOMIC_ACQUIRE)) == UNREAD) {
            uint64_t j = __atomic_fetch_add(&f.next, 1, __ATOMIC_RELAXED);
            if (j < f.pieces)
                shared_take(&f, j);
            else
                sched_yield(); /* the helper is reading piece i */
        }
        if (r < 0) break;
        xxh3_stream.update(state, body + done, (size_t)r);
        done += (uint64_t)r;
        if ((uint64_t)r < shared_want(&f, i)) break; /* end of file: a short payload */
    }
    __atomic_store_n(&f.next, f.pieces, __ATOMIC_RELAXED); /* after a failure: take no more */
    pool_wait(&b);
    *err = __atomic_load_n(&f.err, __ATOMIC_RELAXED);
    free(f.got);
    *got += done;
    return 0;
}

/* A fork while another thread holds a lock must not leave the child deadlocked.
   The child has only the forking thread: no gather runs, no worker exists. */
static void atfork_prepare(void) {
    pthread_mutex_lock(&pool_lock);
    pthread_mutex_lock(&slots_lock);
}
static void atfork_parent(void) {
    pthread_mutex_unlock(&slots_lock);
    pthread_mutex_unlock(&pool_lock);
}
static void atfork_child(void) {
    pthread_mutex_init(&slots_lock, NULL);
    for (int i = 0; i < SCRATCH_SLOTS; i++) slots[i].in_use = 0;
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_work, NULL);
    pthread_cond_init(&pool_done, NULL);
    pool_queue = NULL;
    pool_threads = pool_idle = busy = 0;
}

/* -- Python interface ------------------------------------------------------------ */

static int get_u64(PyObject *o, uint64_t *v, const char *what) {
    unsigned long long x = PyLong_AsUnsignedLongLong(o);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "%s must be a non-negative integer below 2**64", what);
        return -1;
    }
    *v = (uint64_t)x;
    return 0;
}

typedef struct {
    Job *jobs;
    Py_ssize_t njobs;
    PyObject **keep;   /* path bytes (FSConverter) per job */
    Py_buffer *bufs;   /* in-memory payloads per job */
    int *have_buf;
    Copy *copies;
} Parsed;

static void parsed_free(Parsed *p) {
    for (Py_ssize_t i = 0; i < p->njobs; i++) {
        if (p->keep) Py_XDECREF(p->keep[i]);
        if (p->have_buf && p->have_buf[i]) PyBuffer_Release(&p->bufs[i]);
        if (p->jobs) free(p->jobs[i].meta);
    }
    PyMem_Free(p->jobs);
    PyMem_Free(p->keep);
    PyMem_Free(p->bufs);
    PyMem_Free(p->have_buf);
    PyMem_Free(p->copies);
}

/* jobs: sequence of (source, stored, raw, codec, checksum, stored_checksum, copies[, offset]); copies: sequence
 * of (src, length, dst). Every copy is checked against raw and the output here. */
static int parse_jobs(PyObject *seq, int in_memory, uint64_t out_len, Parsed *p) {
    memset(p, 0, sizeof *p);
    PyObject *fast = PySequence_Fast(seq, "jobs must be a sequence");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), ncopies = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyTuple_Check(items[i]) || PyTuple_GET_SIZE(items[i]) < 7 || PyTuple_GET_SIZE(items[i]) > 8) {
            PyErr_SetString(PyExc_TypeError, "each job must be a 7- or 8-tuple (source, stored, raw, codec, checksum, "
                                             "stored_checksum, copies[, offset or None])");
            goto error;
        }
        Py_ssize_t k = PyObject_Length(PyTuple_GET_ITEM(items[i], 6));
        if (k < 0) goto error;
        ncopies += k;
    }
    p->njobs = n;
    p->jobs = PyMem_Calloc((size_t)n + 1, sizeof(Job));
    p->keep = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    p->bufs = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    p->have_buf = PyMem_Calloc((size_t)n + 1, sizeof(int));
    p->copies = PyMem_Calloc((size_t)ncopies + 1, sizeof(Copy));
    if (!p->jobs || !p->keep || !p->bufs || !p->have_buf || !p->copies) {
        PyErr_NoMemory();
        goto error;
    }
    Copy *next = p->copies;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = items[i];
        Job *job = &p->jobs[i];
        PyObject *src = PyTuple_GET_ITEM(t, 0);
        if (in_memory) {
            if (PyObject_GetBuffer(src, &p->bufs[i], PyBUF_SIMPLE) < 0) goto error;
            p->have_buf[i] = 1;
            job->mem = p->bufs[i].buf;
            job->mem_len = (uint64_t)p->bufs[i].len;
        } else {
            if (!PyUnicode_FSConverter(src, &p->keep[i])) goto error;
            job->path = PyBytes_AS_STRING(p->keep[i]);
        }
        uint64_t codec;
        if (get_u64(PyTuple_GET_ITEM(t, 1), &job->stored, "stored") < 0 ||
            get_u64(PyTuple_GET_ITEM(t, 2), &job->raw, "raw") < 0 ||
            get_u64(PyTuple_GET_ITEM(t, 3), &codec, "codec") < 0 ||
            get_u64(PyTuple_GET_ITEM(t, 4), &job->checksum, "checksum") < 0)
            goto error;
        job->codec = codec > 255 ? 256 : (int)codec; /* out of range never matches a header */
        if (PyTuple_GET_SIZE(t) == 8 && PyTuple_GET_ITEM(t, 7) != Py_None) {
            if (in_memory) {
                PyErr_SetString(PyExc_ValueError, "an in-memory payload has no offset");
                goto error;
            }
            if (get_u64(PyTuple_GET_ITEM(t, 7), &job->offset, "offset") < 0) goto error;
            job->packed = 1;
        }
        PyObject *sc = PyTuple_GET_ITEM(t, 5);
        if (sc != Py_None) {
            if (get_u64(sc, &job->stored_checksum, "stored_checksum") < 0) goto error;
            job->has_stored_checksum = 1;
        }
        PyObject *cf = PySequence_Fast(PyTuple_GET_ITEM(t, 6), "copies must be a sequence");
        if (cf == NULL) goto error;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(cf);
        if (next + k > p->copies + ncopies) { /* the sequence grew since it was measured */
            Py_DECREF(cf);
            PyErr_SetString(PyExc_ValueError, "copies changed size while being read");
            goto error;
        }
        job->copies = next;
        job->ncopies = k;
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *c = PySequence_Fast_GET_ITEM(cf, j);
            Copy *cp = &next[j];
            if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 3) {
                Py_DECREF(cf);
                PyErr_SetString(PyExc_TypeError, "each copy must be a 3-tuple (src, length, dst)");
                goto error;
            }
            if (get_u64(PyTuple_GET_ITEM(c, 0), &cp->src, "copy src") < 0 ||
                get_u64(PyTuple_GET_ITEM(c, 1), &cp->len, "copy length") < 0 ||
                get_u64(PyTuple_GET_ITEM(c, 2), &cp->dst, "copy dst") < 0) {
                Py_DECREF(cf);
                goto error;
            }
            if (cp->len > job->raw || cp->src > job->raw - cp->len) {
                Py_DECREF(cf);
                PyErr_Format(PyExc_ValueError, "copy of %llu B at %llu is outside the %llu B payload",
                             (unsigned long long)cp->len, (unsigned long long)cp->src, (unsigned long long)job->raw);
                goto error;
            }
            if (cp->len > out_len || cp->dst > out_len - cp->len) {
                Py_DECREF(cf);
                PyErr_Format(PyExc_ValueError, "copy of %llu B to %llu is outside the %llu B output buffer",
                             (unsigned long long)cp->len, (unsigned long long)cp->dst, (unsigned long long)out_len);
                goto error;
            }
        }
        Py_DECREF(cf);
        next += k;
    }
    Py_DECREF(fast);
    return 0;
error:
    Py_DECREF(fast);
    parsed_free(p);
    memset(p, 0, sizeof *p);
    return -1;
}

static PyObject *job_result(const Job *job) {
    switch (job->status) {
    case ST_OK:
        return Py_NewRef(Py_None);
    case ST_MISSING:
        return Py_BuildValue("(ss)", "missing", "payload file is missing");
    case ST_OSERROR:
        return Py_BuildValue("(si)", "oserror", job->err);
    case ST_META:
        return Py_BuildValue("(sy#)", "meta", (const char *)job->meta, (Py_ssize_t)job->meta_len);
    case ST_NOMEM:
        return Py_BuildValue("(ss)", "nomem", job->msg);
    default:
        return Py_BuildValue("(ss)", "corrupt", job->msg);
    }
}

static PyObject *results(Parsed *p) {
    PyObject *list = PyList_New(p->njobs);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < p->njobs; i++) {
        PyObject *r = job_result(&p->jobs[i]);
        if (r == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, r);
    }
    return list;
}

static PyObject *do_gather(PyObject *args, int in_memory) {
    PyObject *jobs, *out;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OO|i", &jobs, &out, &threads)) return NULL;
    if (lz4_decompress_safe == NULL || xxh3_64 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastload._native is not bound to LZ4/xxh3; call bind() first");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_CONTIG) < 0) return NULL;
    Parsed p;
    if (parse_jobs(jobs, in_memory, (uint64_t)view.len, &p) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Batch b = {.jobs = p.jobs, .njobs = p.njobs, .out = view.buf};
    if (p.njobs > 0) {
        Py_BEGIN_ALLOW_THREADS
        run_batch(&b, threads < 1 ? 1 : threads);
        Py_END_ALLOW_THREADS
    }
    PyObject *r = results(&p);
    parsed_free(&p);
    PyBuffer_Release(&view);
    return r;
}

static PyObject *gather(PyObject *self, PyObject *args) {
    (void)self;
    return do_gather(args, 0);
}

static PyObject *gather_buffers(PyObject *self, PyObject *args) {
    (void)self;
    return do_gather(args, 1);
}

/* A row of fastload.read.located: one sample's one payload, as numbers (uint64 each), so a warm
 * batch makes no Python object per sample to describe its jobs (issue 31: at a million samples each
 * such object is a cache miss, and the young GC's visits of them are more). */
enum { ROW_PATH, ROW_OFFSET, ROW_STORED, ROW_RAW, ROW_CODEC, ROW_CHECKSUM, ROW_STORED_CHECKSUM, ROW_HAS_STORED, ROW_WIDTH };
#define ROW_WHOLE_FILE UINT64_MAX /* ROW_OFFSET of a payload that is a whole file */

static PyObject *gather_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *paths, *rows_obj, *picks_obj, *dsts_obj, *out, *failed = NULL;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O!OOOO|i", &PyList_Type, &paths, &rows_obj, &picks_obj, &dsts_obj, &out, &threads))
        return NULL;
    if (lz4_decompress_safe == NULL || xxh3_64 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastload._native is not bound to LZ4/xxh3; call bind() first");
        return NULL;
    }
    Py_buffer rows = {0}, picks = {0}, dsts = {0}, view = {0};
    Job *jobs = NULL;
    Copy *copies = NULL;
    PyObject **keep = NULL;
    Py_ssize_t n = 0;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(picks_obj, &picks, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(dsts_obj, &dsts, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(out, &view, PyBUF_CONTIG) < 0)
        goto done;
    if (rows.len % (8 * ROW_WIDTH) != 0 || picks.len % 8 != 0 || dsts.len != picks.len) {
        PyErr_SetString(PyExc_ValueError, "rows must be uint64 rows of 8 columns; picks and dsts 8-byte integers, as many each");
        goto done;
    }
    Py_ssize_t nrows = rows.len / (8 * ROW_WIDTH), npaths = PyList_GET_SIZE(paths);
    n = picks.len / 8;
    const uint64_t *row = rows.buf, *dst = dsts.buf;
    const int64_t *pick = picks.buf;
    uint64_t out_len = (uint64_t)view.len;
    jobs = PyMem_Calloc((size_t)n + 1, sizeof(Job));
    copies = PyMem_Calloc((size_t)n + 1, sizeof(Copy));
    keep = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    if (!jobs || !copies || !keep) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pick[i] < 0 || pick[i] >= nrows) {
            PyErr_Format(PyExc_ValueError, "pick %lld is not a row (0 to %lld)", (long long)pick[i], (long long)nrows - 1);
            goto done;
        }
        const uint64_t *c = row + pick[i] * ROW_WIDTH;
        if (c[ROW_PATH] == 0 || c[ROW_PATH] > (uint64_t)npaths || !PyBytes_Check(PyList_GET_ITEM(paths, c[ROW_PATH] - 1))) {
            PyErr_Format(PyExc_ValueError, "row %lld names no path (a bytes object of paths)", (long long)pick[i]);
            goto done;
        }
        Job *job = &jobs[i];
        keep[i] = Py_NewRef(PyList_GET_ITEM(paths, c[ROW_PATH] - 1)); /* alive without the GIL, whatever the list does */
        job->path = PyBytes_AS_STRING(keep[i]);
        job->stored = c[ROW_STORED];
        job->raw = c[ROW_RAW];
        job->checksum = c[ROW_CHECKSUM];
        job->codec = c[ROW_CODEC] > 255 ? 256 : (int)c[ROW_CODEC];
        if (c[ROW_OFFSET] != ROW_WHOLE_FILE) {
            job->offset = c[ROW_OFFSET];
            job->packed = 1;
        }
        if (c[ROW_HAS_STORED]) {
            job->stored_checksum = c[ROW_STORED_CHECKSUM];
            job->has_stored_checksum = 1;
        }
        if (job->raw > out_len || dst[i] > out_len - job->raw) {
            PyErr_Format(PyExc_ValueError, "copy of %llu B to %llu is outside the %llu B output buffer",
                         (unsigned long long)job->raw, (unsigned long long)dst[i], (unsigned long long)out_len);
            goto done;
        }
        copies[i] = (Copy){.src = 0, .len = job->raw, .dst = dst[i]};
        job->copies = &copies[i];
        job->ncopies = 1;
    }
    Batch b = {.jobs = jobs, .njobs = n, .out = view.buf};
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        run_batch(&b, threads < 1 ? 1 : threads);
        Py_END_ALLOW_THREADS
    }
    failed = PyList_New(0);
    for (Py_ssize_t i = 0; failed != NULL && i < n; i++) {
        if (jobs[i].status == ST_OK) continue;
        PyObject *r = job_result(&jobs[i]);
        PyObject *pair = r == NULL ? NULL : Py_BuildValue("(nN)", i, r);
        if (pair == NULL || PyList_Append(failed, pair) < 0) Py_CLEAR(failed);
        Py_XDECREF(pair);
    }
done:
    for (Py_ssize_t i = 0; i < n && jobs != NULL; i++) {
        Py_XDECREF(keep ? keep[i] : NULL);
        free(jobs[i].meta);
    }
    PyMem_Free(jobs);
    PyMem_Free(copies);
    PyMem_Free(keep);
    if (rows.obj) PyBuffer_Release(&rows);
    if (picks.obj) PyBuffer_Release(&picks);
    if (dsts.obj) PyBuffer_Release(&dsts);
    if (view.obj) PyBuffer_Release(&view);
    return failed;
}

static PyObject *bind(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long lz4, xxh, partial = 0, create = 0, release = 0, reset = 0, update = 0, digest = 0;
    if (!PyArg_ParseTuple(args, "KK|KKKKKK", &lz4, &xxh, &partial, &create, &release, &reset, &update, &digest))
        return NULL;
    if (lz4 == 0 || xxh == 0) {
        PyErr_SetString(PyExc_ValueError, "bind() needs two non-null function addresses");
        return NULL;
    }
    if (lz4_decompress_safe != NULL && (lz4_decompress_safe != (lz4_safe_fn)(uintptr_t)lz4 ||
                                        xxh3_64 != (xxh3_fn)(uintptr_t)xxh)) {
        PyErr_SetString(PyExc_RuntimeError, "fastload._native is already bound to other functions");
        return NULL;
    }
    lz4_decompress_safe = (lz4_safe_fn)(uintptr_t)lz4;
    xxh3_64 = (xxh3_fn)(uintptr_t)xxh;
    lz4_decompress_safe_partial = (lz4_partial_fn)(uintptr_t)partial;
    /* All five of the streaming form, or none (direct_fits looks at digest). */
    xxh3_stream.digest = NULL;
    if (create && release && reset && update && digest) {
        xxh3_stream.create = (xxh3_create_fn)(uintptr_t)create;
        xxh3_stream.free = (xxh3_free_fn)(uintptr_t)release;
        xxh3_stream.reset = (xxh3_reset_fn)(uintptr_t)reset;
        xxh3_stream.update = (xxh3_update_fn)(uintptr_t)update;
        xxh3_stream.digest = (xxh3_digest_fn)(uintptr_t)digest;
    }
    Py_RETURN_NONE;
}

static PyObject *opened(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&files_opened, __ATOMIC_RELAXED));
}

static PyObject *large_reads(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("{sKsK}", "lined", __atomic_load_n(&reads_lined, __ATOMIC_RELAXED), "shared",
                         __atomic_load_n(&reads_shared, __ATOMIC_RELAXED));
}

/* Copies out of a buffer release the GIL from this many bytes in all (below it, the release
 * and the retake cost more than the copy). */
#define SPLIT_RELEASE_MIN (64 * 1024)

static PyObject *split(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src, *spans;
    if (!PyArg_ParseTuple(args, "OO", &src, &spans)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(src, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *seq = PySequence_Fast(spans, "split(): spans must be a sequence of (start, size)");
    PyObject *out = NULL;
    Py_ssize_t *at = NULL;
    if (seq == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    out = PyList_New(n);
    at = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n > 0 ? n : 1));
    if (out == NULL || at == NULL) {
        if (at == NULL) PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t start, size;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nn", &start, &size)) {
            Py_CLEAR(out);
            goto done;
        }
        if (start < 0 || size < 0 || start > view.len || size > view.len - start) {
            PyErr_Format(PyExc_ValueError, "split(): span (%zd, %zd) lies outside the buffer of %zd bytes", start, size,
                         view.len);
            Py_CLEAR(out);
            goto done;
        }
        PyObject *b = PyBytes_FromStringAndSize(NULL, size);
        if (b == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, b);
        at[i] = start;
        total += (size_t)size;
    }
    /* The new bytes are referenced only by `out`, and `view` holds the source: no other
     * thread can see or free either while the copies run without the GIL. */
    if (total >= SPLIT_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *b = PyList_GET_ITEM(out, i);
            copy_out(PyBytes_AS_STRING(b), (const char *)view.buf + at[i], (size_t)PyBytes_GET_SIZE(b));
        }
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *b = PyList_GET_ITEM(out, i);
            copy_out(PyBytes_AS_STRING(b), (const char *)view.buf + at[i], (size_t)PyBytes_GET_SIZE(b));
        }
    }
done:
    PyMem_Free(at);
    Py_XDECREF(seq);
    PyBuffer_Release(&view);
    return out;
}

static PyObject *trim(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    pthread_mutex_lock(&slots_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (!slots[i].in_use) scratch_free(&slots[i]);
    pthread_mutex_unlock(&slots_lock);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(jobs, out, threads=1) -> list\n\n"
     "Read, check, decode and verify cache payload files and copy byte ranges of their raw\n"
     "bytes into the writable buffer `out`, with the GIL released, on up to `threads` threads.\n"
     "jobs: sequence of (path, stored, raw, codec, checksum, stored_checksum or None, copies[, offset]),\n"
     "offset: where the payload starts in a pack file (exactly `stored` bytes are read), or None for a whole file;\n"
     "copies: sequence of (src, length, dst). Returns one result per job: None when done, else a tuple\n"
     "('missing'|'corrupt'|'nomem', message), ('oserror', errno) or ('meta', bytes) when the\n"
     "job succeeded but its metadata is not '{}' and must be checked as JSON by the caller."},
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(paths, rows, picks, dsts, out, threads=1) -> list\n\n"
     "gather() of whole payloads described by rows of numbers: row picks[i] of `rows` (uint64, 8 columns:\n"
     "path id + 1 into `paths` (a list of bytes), offset in a pack or 2**64-1 for a whole file, stored, raw,\n"
     "codec, checksum, stored_checksum, has stored_checksum) is copied whole to byte dsts[i] of `out`.\n"
     "Returns (i, result) for each pick that did not succeed, results as gather()'s."},
    {"gather_buffers", gather_buffers, METH_VARARGS,
     "gather_buffers(jobs, out, threads=1) -> list\n\n"
     "gather() with in-memory payloads (any bytes-like object) in place of paths."},
    {"bind", bind, METH_VARARGS,
     "bind(lz4_decompress_safe_address, xxh3_64bits_address, lz4_decompress_safe_partial_address=0,\n"
     "     xxh3_create_state=0, xxh3_free_state=0, xxh3_reset=0, xxh3_update=0, xxh3_digest=0)\n\n"
     "Use these functions (resolved by fastload.cache.gather) for decoding and checksums; without\n"
     "the partial decoder, wanted chunks are decoded in full; without all five of xxh3's streaming\n"
     "form, a large raw payload is read into scratch and copied out, not read straight into the output."},
    {"split", split, METH_VARARGS,
     "split(buffer, spans) -> list\n\n"
     "bytes objects copied out of `buffer` at spans (start, size), as bytes(view[start:start + size])\n"
     "does, but not by `rep movsb` where that is slow (lines.h), and without the GIL from 64 KiB in all."},
    {"trim", trim, METH_NOARGS, "trim()\n\nFree the scratch buffers kept between calls."},
    {"opened", opened, METH_NOARGS, "opened() -> int\n\nPayload files opened by gather() since import (a pack "
     "once per thread's share of a batch)."},
    {"large_reads", large_reads, METH_NOARGS, "large_reads() -> dict\n\nLarge raw payloads read since import "
     "through a piece of scratch ('lined': their destination lay where the kernel's copy is slow, slow_copy) "
     "and with a pool helper ('shared')."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._native",
    "Batch assembly of cache payloads in C (private; use fastload.cache.gather).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    static int registered = 0;
    if (!registered) {
        if (pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0) {
            PyErr_SetString(PyExc_ImportError, "fastload._native: pthread_atfork failed");
            return NULL;
        }
        registered = 1;
    }
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
#else
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online > 0) cpus = (int)online;
#endif
    if (cpus < 1) cpus = 1;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "SCRATCH_KEEP_BYTES", (long)SCRATCH_KEEP_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
