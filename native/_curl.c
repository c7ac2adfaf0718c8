/*
 * fastload._curl: first-block HTTP GETs on libcurl's multi interface, off the GIL.
 *
 * Why: a cold object's ranged GET through fsspec's aiohttp session costs
 * 0.17 ms of Python (unshaped) to 0.33 ms (a paced 1 Gbit link) on fsspec's
 * event loop thread, which then trades the GIL with the read threads
 * (benchmarks/peers/results/profile.md). pycurl moved the parsing to C but called
 * Python for every header line and every received piece, and the GIL handoffs
 * ate the gain. Here no Python runs per transfer on the transfer thread at all:
 * requests are handed over in batches (Engine.submit), libcurl's headers and body
 * land in C buffers, and Python collects finished answers when it asks for them
 * (Engine.wait, Transfer.result), releasing the GIL while it waits. The thread waits in
 * epoll on the sockets libcurl names (curl_multi_socket_action), so a wake-up costs
 * the sockets that are ready, not every transfer in flight.
 *
 * Requests in flight per host are bounded by permits that Python leases from its
 * HostLimit (fastload/transport/hostlimit.py, the one home of that number) and hands over
 * with Engine.set_permits: the transfer thread starts a queued request only
 * while its host has fewer active requests than permits, and a finished request's
 * permit passes to the next queued one without Python. Each finished request
 * leaves an outcome (latency, bytes, error) that Python feeds to the host's
 * controller (Engine.outcomes).
 *
 * Each request carries its route's TLS settings (CA bundle, verification) and HTTP version
 * (Engine.submit), set on its easy handle when it starts; its path is sent as given. A batch's
 * requests may each carry their own header lines (Range, If-Match, an S3 Authorization) and byte
 * count; with exact, each body is written straight into the bytes object Transfer.result returns
 * (an object's later blocks, fastload/source/ranged.py: no copy of 8 MiB under the GIL per block).
 *
 * libcurl is not linked: it is opened at run time (dlopen "libcurl.so.4"), so
 * the build needs no curl headers and a machine without libcurl runs aiohttp
 * (fastload/transport/curl.py). The option numbers below are libcurl's ABI (curl.h, multi.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "lines.h"

/* ---- libcurl's ABI ---------------------------------------------------------- */

typedef void CURL;
typedef void CURLM;
struct curl_slist {
    char *data;
    struct curl_slist *next;
};
typedef struct {
    int msg;
    CURL *easy_handle;
    union {
        void *whatever;
        int result;
    } data;
} CURLMsg;

#define OPT_PTR 10000
#define OPT_FUNC 20000
#define OPT_OFF_T 30000
#define O_URL (OPT_PTR + 2)
#define O_PROXY (OPT_PTR + 4)
#define O_USERPWD (OPT_PTR + 5)
#define O_WRITEDATA (OPT_PTR + 1)
#define O_WRITEFUNCTION (OPT_FUNC + 11)
#define O_HTTPHEADER (OPT_PTR + 23)
#define O_HEADERDATA (OPT_PTR + 29)
#define O_HEADERFUNCTION (OPT_FUNC + 79)
#define O_FOLLOWLOCATION 52
#define O_SSL_VERIFYPEER 64
#define O_SSL_VERIFYHOST 81
#define O_HTTP_VERSION 84
#define O_PATH_AS_IS 234
#define O_MAXREDIRS 68
#define O_CAINFO (OPT_PTR + 65)
#define O_CAPATH (OPT_PTR + 97)
#define O_BUFFERSIZE 98
#define O_NOSIGNAL 99
#define O_PRIVATE (OPT_PTR + 103)
#define O_TIMEOUT_MS 155
#define O_CONNECTTIMEOUT_MS 156
#define I_EFFECTIVE_URL (0x100000 + 1)
#define I_RESPONSE_CODE (0x200000 + 2)
#define I_PRIVATE (0x100000 + 21)
#define I_NUM_CONNECTS (0x200000 + 26)
#define I_HTTP_VERSION (0x200000 + 46)
#define I_CONNECT_TIME_T (0x600000 + 52)
#define M_MAXCONNECTS 6
#define M_SOCKETFUNCTION (OPT_FUNC + 1)
#define M_SOCKETDATA (OPT_PTR + 2)
#define M_TIMERFUNCTION (OPT_FUNC + 4)
#define M_TIMERDATA (OPT_PTR + 5)
#define POLL_IN 1
#define POLL_OUT 2
#define POLL_REMOVE 4
#define CSELECT_IN 1
#define CSELECT_OUT 2
#define CSELECT_ERR 4
#define SOCKET_TIMEOUT (-1)
#define MSG_DONE 1
#define GLOBAL_DEFAULT 3
#define HTTP_VERSION_1_0 1
#define HTTP_VERSION_1_1 2
#define HTTP_VERSION_2TLS 4 /* HTTP/2 over TLS (ALPN), HTTP/1.1 in clear */
#define E_WRITE_ERROR 23

static struct {
    int (*global_init)(long);
    CURL *(*easy_init)(void);
    int (*easy_setopt)(CURL *, int, ...);
    int (*easy_getinfo)(CURL *, int, ...);
    void (*easy_reset)(CURL *);
    const char *(*easy_strerror)(int);
    CURLM *(*multi_init)(void);
    int (*multi_setopt)(CURLM *, int, ...);
    int (*multi_add_handle)(CURLM *, CURL *);
    int (*multi_remove_handle)(CURLM *, CURL *);
    int (*multi_socket_action)(CURLM *, int, int, int *);
    CURLMsg *(*multi_info_read)(CURLM *, int *);
    struct curl_slist *(*slist_append)(struct curl_slist *, const char *);
    void (*slist_free_all)(struct curl_slist *);
} lib;
static int lib_state; /* 0 not tried, 1 loaded, -1 unavailable */
static char lib_error[256];

static int load_libcurl(void) {
    if (lib_state)
        return lib_state;
    const char *names[] = {"libcurl.so.4", "libcurl.so", "libcurl-gnutls.so.4"};
    void *h = NULL;
    for (size_t i = 0; i < sizeof names / sizeof *names && !h; i++)
        h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(lib_error, sizeof lib_error, "libcurl not found (%s)", dlerror());
        return lib_state = -1;
    }
#define SYM(field, name)                                                                    \
    do {                                                                                    \
        *(void **)(&lib.field) = dlsym(h, name);                                            \
        if (!lib.field) {                                                                   \
            snprintf(lib_error, sizeof lib_error, "libcurl lacks %s", name);                \
            return lib_state = -1;                                                          \
        }                                                                                   \
    } while (0)
    SYM(global_init, "curl_global_init");
    SYM(easy_init, "curl_easy_init");
    SYM(easy_setopt, "curl_easy_setopt");
    SYM(easy_getinfo, "curl_easy_getinfo");
    SYM(easy_reset, "curl_easy_reset");
    SYM(easy_strerror, "curl_easy_strerror");
    SYM(multi_init, "curl_multi_init");
    SYM(multi_setopt, "curl_multi_setopt");
    SYM(multi_add_handle, "curl_multi_add_handle");
    SYM(multi_remove_handle, "curl_multi_remove_handle");
    SYM(multi_socket_action, "curl_multi_socket_action");
    SYM(multi_info_read, "curl_multi_info_read");
    SYM(slist_append, "curl_slist_append");
    SYM(slist_free_all, "curl_slist_free_all");
#undef SYM
    if (lib.global_init(GLOBAL_DEFAULT) != 0) {
        snprintf(lib_error, sizeof lib_error, "curl_global_init failed");
        return lib_state = -1;
    }
    return lib_state = 1;
}

/* ---- requests --------------------------------------------------------------- */

enum { INCOMING, QUEUED, ACTIVE, DONE };
/* x-goog-generation: a GCS object's version, as its listing gives it (fastload.source.gcs) */
enum { H_RANGE, H_LENGTH, H_ETAG, H_MODIFIED, H_MD5, H_DIGEST, H_TYPE, H_GENERATION, N_HEADERS };
static const char *const header_names[N_HEADERS] = {"content-range", "content-length", "etag", "last-modified", "content-md5", "digest", "content-type", "x-goog-generation"};
#define CANCELLED (-1) /* Req.code of a request cancelled before it finished */
#define RECV_BUFFER (256 * 1024) /* libcurl's receive buffer: fewer recv() calls per answer */

typedef struct Engine Engine;

/* A thread in Engine.wait: woken once all the requests it registered on are done. */
typedef struct {
    pthread_cond_t cv;
    int remaining;
} Waiter;

typedef struct Req {
    struct Req *next; /* the incoming list or its host's queue */
    Engine *eng;
    CURL *easy;
    int host, state, abandoned, cancel, closes, full;
    int lent; /* buf is a bytes object's own storage (Transfer.body: submit's exact), never freed here */
    int page; /* a listing page: the body is kept only if the answer is HTML (page_wanted) */
    int follow; /* follow redirects (as aiohttp); 0: a 3xx is the answer (an S3 route learns its region) */
    char *url, *userpwd, *final; /* final: the URL answered, after redirects */
    int trust_env;
    char *cainfo, *capath; /* its route's CA bundle (file, folder); both NULL: the engine's */
    int verify, http2; /* check the server's certificate and name; ask for HTTP/2 over TLS */
    struct curl_slist *headers;
    long timeout_ms;
    size_t max_bytes, got, cap;
    char *buf;
    int code;
    long status, http_version, connects;
    int64_t connect_us;
    double t_start;
    Waiter *waiter; /* the thread waiting for it, if one registered (Engine.wait) */
    char *h[N_HEADERS];
} Req;

typedef struct {
    int permits, active, queued;
    Req *head, *tail;
} Host;

typedef struct {
    int host, code, closes;
    long status, connects;
    double latency, connect_s;
    size_t nbytes;
} Outcome;

struct Engine {
    PyObject_HEAD
    pthread_mutex_t mu;
    CURLM *multi;
    pid_t pid;
    int started;
    Host *hosts;
    int nhosts;
    Req *in_head, *in_tail;
    Req **cancels;
    int ncancels, cancels_cap;
    Outcome *outs;
    int nouts, outs_cap;
    CURL **spare;
    int nspare, spare_cap;
    char *cainfo, *capath;
    int sweep; /* a queued request was cancelled */
    int epfd, wakefd; /* epoll over libcurl's sockets, and an eventfd that wakes the thread */
    double deadline; /* when libcurl wants socket_action(TIMEOUT) next; < 0: no timer */
    double last_drain; /* when Python last took the outcomes (Engine.outcomes) */
};

typedef struct {
    PyObject_HEAD
    Engine *eng; /* borrowed: engines live for the process (fastload/transport/curl.py keeps them) */
    Req *req;
    PyObject *answer;
    PyObject *body; /* exact: the bytes object the answer's body is written into, in place (no copy after) */
} Transfer;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void req_free(Req *r) {
    free(r->url);
    free(r->final);
    free(r->userpwd);
    free(r->cainfo);
    free(r->capath);
    if (!r->lent)
        free(r->buf);
    for (int i = 0; i < N_HEADERS; i++)
        free(r->h[i]);
    if (r->headers)
        lib.slist_free_all(r->headers);
    free(r);
}

static void clear_headers(Req *r) {
    for (int i = 0; i < N_HEADERS; i++) {
        free(r->h[i]);
        r->h[i] = NULL;
    }
    r->closes = 0;
}

static size_t on_header(char *line, size_t size, size_t n, void *ud) {
    Req *r = ud;
    size_t len = size * n, end = len;
    if (len >= 5 && memcmp(line, "HTTP/", 5) == 0) { /* a new answer (after a redirect): start over */
        clear_headers(r);
        return len;
    }
    char *colon = memchr(line, ':', len);
    if (!colon)
        return len;
    size_t name_len = (size_t)(colon - line);
    size_t v = name_len + 1;
    while (v < end && (line[v] == ' ' || line[v] == '\t'))
        v++;
    while (end > v && (line[end - 1] == '\r' || line[end - 1] == '\n' || line[end - 1] == ' '))
        end--;
    if (name_len == 10 && strncasecmp(line, "connection", 10) == 0) {
        if (end - v == 5 && strncasecmp(line + v, "close", 5) == 0)
            r->closes = 1;
        return len;
    }
    for (int i = 0; i < N_HEADERS; i++) {
        if (i == H_TYPE && !r->page)
            continue; /* only a listing page's type is read (page_wanted, fastload.transport.curl._page_answer) */
        if (strlen(header_names[i]) == name_len && strncasecmp(line, header_names[i], name_len) == 0) {
            free(r->h[i]);
            r->h[i] = strndup(line + v, end - v);
            break;
        }
    }
    return len;
}

/* A listing page's body is read only when it is HTML, as fastload.source.aio.http_page does on
 * aiohttp: a Content-Type of text/html, or none and a final URL ending in "/"; or an object
 * store's listing (application/xml: S3's ListObjectsV2, fastload.source.s3; application/json: GCS's
 * objects.list, fastload.source.gcs). */
static int page_wanted(Req *r) {
    const char *type = r->h[H_TYPE];
    if (type) {
        while (*type == ' ' || *type == '\t')
            type++;
        size_t n = strcspn(type, "; \t");
        if (n)
            return (n == 9 && strncasecmp(type, "text/html", 9) == 0) ||
                   (n == 15 && strncasecmp(type, "application/xml", 15) == 0) ||
                   (n == 16 && strncasecmp(type, "application/json", 16) == 0);
    }
    char *eff = NULL;
    lib.easy_getinfo(r->easy, I_EFFECTIVE_URL, &eff);
    size_t n = eff ? strlen(eff) : 0;
    return n && eff[n - 1] == '/';
}

static size_t on_write(char *data, size_t size, size_t n, void *ud) {
    Req *r = ud;
    if (r->page && r->got == 0 && !r->full && !page_wanted(r)) {
        r->full = 1; /* a data file, not a folder page: its body is not the listing's business */
        return 0;
    }
    size_t len = size * n, room = r->max_bytes - r->got, take = len < room ? len : room;
    size_t need = r->got + take;
    if (need > r->cap) {
        size_t cap = 2 * r->cap;
        if (!r->cap && r->h[H_LENGTH]) { /* the answer's own length: one allocation of the right size */
            long long declared = atoll(r->h[H_LENGTH]);
            if (declared > 0)
                cap = (size_t)declared;
        }
        if (cap < need)
            cap = need;
        if (cap > r->max_bytes)
            cap = r->max_bytes; /* >= need: take never passes max_bytes */
        char *buf = realloc(r->buf, cap ? cap : 1);
        if (!buf)
            return 0; /* out of memory: the transfer fails (CURLE_WRITE_ERROR, full=0) */
        r->buf = buf;
        r->cap = cap;
    }
    copy_out(r->buf + r->got, data, take); /* lines.h: half a body's pieces land where memcpy is slow */
    r->got += take;
    if (take < len) { /* more than was asked for (a server that ignored Range): stop here */
        r->full = 1;
        return 0;
    }
    return len;
}

/* ---- the transfer thread ---------------------------------------------------- */

static int grow(void **arr, int *cap, int need, size_t item) {
    if (need <= *cap)
        return 0;
    int c = *cap ? *cap * 2 : 16;
    while (c < need)
        c *= 2;
    void *p = realloc(*arr, (size_t)c * item);
    if (!p)
        return -1;
    *arr = p;
    *cap = c;
    return 0;
}

/* Under mu: r is done; its waiter wakes once all it waits for are (one wake-up per wait, not per request). */
static void notify(Req *r) {
    Waiter *w = r->waiter;
    r->waiter = NULL;
    if (w && --w->remaining == 0)
        pthread_cond_signal(&w->cv);
}

/* Under mu. The request is finished: its host's permit is free, its waiter told. */
static void finish(Engine *e, Req *r, int code) {
    if (r->cancel) { /* it may be freed below: the pending cancel must not outlive it */
        for (int i = 0; i < e->ncancels; i++) {
            if (e->cancels[i] == r) {
                e->cancels[i] = e->cancels[--e->ncancels];
                break;
            }
        }
    }
    if (r->state == ACTIVE) {
        e->hosts[r->host].active--;
        if (code != CANCELLED && grow((void **)&e->outs, &e->outs_cap, e->nouts + 1, sizeof(Outcome)) == 0) {
            Outcome *o = &e->outs[e->nouts++];
            o->host = r->host;
            o->code = code;
            o->closes = r->closes || r->http_version == HTTP_VERSION_1_0;
            o->status = r->status;
            o->connects = r->connects;
            o->latency = now_s() - r->t_start;
            o->connect_s = r->connect_us / 1e6;
            o->nbytes = r->got;
        }
    } else if (r->state == QUEUED) {
        e->hosts[r->host].queued--;
    }
    r->state = DONE;
    r->code = code;
    notify(r);
    if (r->abandoned)
        req_free(r);
}

static CURL *take_easy(Engine *e) {
    if (e->nspare)
        return e->spare[--e->nspare];
    return lib.easy_init();
}

static void give_easy(Engine *e, CURL *c) {
    lib.easy_reset(c);
    if (grow((void **)&e->spare, &e->spare_cap, e->nspare + 1, sizeof(CURL *)) == 0)
        e->spare[e->nspare++] = c;
}

/* Under mu: start r (its host has a free permit). */
static void start(Engine *e, Req *r) {
    CURL *c = take_easy(e);
    if (!c) {
        r->state = ACTIVE;
        e->hosts[r->host].active++;
        finish(e, r, 27); /* CURLE_OUT_OF_MEMORY */
        return;
    }
    r->easy = c;
    lib.easy_setopt(c, O_URL, r->url);
    lib.easy_setopt(c, O_HTTPHEADER, r->headers);
    lib.easy_setopt(c, O_NOSIGNAL, 1L);
    lib.easy_setopt(c, O_FOLLOWLOCATION, r->follow ? 1L : 0L); /* as aiohttp: up to 10 redirects */
    lib.easy_setopt(c, O_MAXREDIRS, 10L);
    lib.easy_setopt(c, O_TIMEOUT_MS, r->timeout_ms);
    lib.easy_setopt(c, O_CONNECTTIMEOUT_MS, r->timeout_ms);
    lib.easy_setopt(c, O_BUFFERSIZE, (long)RECV_BUFFER);
    lib.easy_setopt(c, O_WRITEFUNCTION, on_write);
    lib.easy_setopt(c, O_WRITEDATA, r);
    lib.easy_setopt(c, O_HEADERFUNCTION, on_header);
    lib.easy_setopt(c, O_HEADERDATA, r);
    lib.easy_setopt(c, O_PRIVATE, r);
    if (!r->trust_env)
        lib.easy_setopt(c, O_PROXY, ""); /* as aiohttp without trust_env: no http_proxy from the environment */
    if (r->userpwd)
        lib.easy_setopt(c, O_USERPWD, r->userpwd);
    /* TLS comes from this request alone, never from a handle's past: a spare handle was reset
     * (give_easy: libcurl's built-in CA paths, full verification), and verification is set on each
     * request. libcurl reuses a connection only for a request of the same TLS settings (CA files,
     * verification), so one route's CA or verify=False never carries over to another route's
     * request (tests/integration/test_tls_ca.py). A route's own CA replaces the engine's: only it is
     * trusted, as requests trusts REQUESTS_CA_BUNDLE and curl --cacert (a NULL path: none). */
    if (r->cainfo || r->capath) {
        lib.easy_setopt(c, O_CAINFO, r->cainfo);
        lib.easy_setopt(c, O_CAPATH, r->capath);
    } else {
        if (e->cainfo)
            lib.easy_setopt(c, O_CAINFO, e->cainfo);
        if (e->capath)
            lib.easy_setopt(c, O_CAPATH, e->capath);
    }
    lib.easy_setopt(c, O_SSL_VERIFYPEER, r->verify ? 1L : 0L);
    lib.easy_setopt(c, O_SSL_VERIFYHOST, r->verify ? 2L : 0L);
    /* libcurl 7.62+ asks for HTTP/2 over TLS by default; HTTP/1.1 unless the route asks (CurlRoute.http2). */
    lib.easy_setopt(c, O_HTTP_VERSION, r->http2 ? (long)HTTP_VERSION_2TLS : (long)HTTP_VERSION_1_1);
    /* The path as given: "./", "../" and "//" in a key are part of its name, and an S3 GET was signed
     * over them; libcurl would squash them and fetch (or sign) another key (tests/integration/test_s3_keys.py). */
    lib.easy_setopt(c, O_PATH_AS_IS, 1L);
    r->state = ACTIVE;
    r->t_start = now_s();
    e->hosts[r->host].active++;
    if (lib.multi_add_handle(e->multi, c) != 0) {
        r->easy = NULL;
        give_easy(e, c);
        finish(e, r, 2); /* CURLE_FAILED_INIT */
    }
}

/* Under mu: a cancelled request that never started is done. */
static void drop(Engine *e, Req *r) {
    r->next = NULL;
    r->state = DONE;
    r->code = CANCELLED;
    notify(r);
    if (r->abandoned)
        req_free(r);
}

/* Under mu: new requests to their hosts' queues, cancels done, permits used. */
static void admit(Engine *e) {
    while (e->in_head) {
        Req *r = e->in_head;
        e->in_head = r->next;
        r->next = NULL;
        if (r->cancel) {
            drop(e, r);
            continue;
        }
        Host *h = &e->hosts[r->host];
        h->queued++;
        r->state = QUEUED;
        if (h->tail)
            h->tail->next = r;
        else
            h->head = r;
        h->tail = r;
    }
    e->in_tail = NULL;
    /* Every request in cancels is alive and active: finish() takes a request out of it. */
    while (e->ncancels) {
        Req *r = e->cancels[e->ncancels - 1];
        lib.multi_remove_handle(e->multi, r->easy);
        give_easy(e, r->easy);
        r->easy = NULL;
        finish(e, r, CANCELLED); /* removes r from cancels */
    }
    for (int k = 0; k < e->nhosts; k++) {
        Host *h = &e->hosts[k];
        if (e->sweep) { /* queued requests cancelled: out of the queue now, not when a permit frees */
            Req **link = &h->head, *prev = NULL;
            while (*link) {
                Req *r = *link;
                if (r->cancel) {
                    *link = r->next;
                    h->queued--;
                    drop(e, r);
                } else {
                    prev = r;
                    link = &r->next;
                }
            }
            h->tail = prev;
        }
        while (h->head && h->active < h->permits) {
            Req *r = h->head;
            h->head = r->next;
            if (!h->head)
                h->tail = NULL;
            r->next = NULL;
            h->queued--;
            if (r->cancel)
                drop(e, r);
            else
                start(e, r);
        }
    }
    e->sweep = 0;
}

/* libcurl's socket callback: watch what it asks for on the epoll set (the transfer thread). */
static int on_socket(CURL *easy, int fd, int what, void *userp, void *socketp) {
    Engine *e = userp;
    if (what == POLL_REMOVE) {
        epoll_ctl(e->epfd, EPOLL_CTL_DEL, fd, NULL);
        return 0;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = (what & POLL_IN ? EPOLLIN : 0) | (what & POLL_OUT ? EPOLLOUT : 0);
    ev.data.fd = fd;
    if (epoll_ctl(e->epfd, EPOLL_CTL_MOD, fd, &ev) != 0 && errno == ENOENT)
        epoll_ctl(e->epfd, EPOLL_CTL_ADD, fd, &ev);
    return 0;
}

/* libcurl's timer callback: when to call socket_action(TIMEOUT) (-1: never). */
static int on_timer(CURLM *multi, long timeout_ms, void *userp) {
    Engine *e = userp;
    e->deadline = timeout_ms < 0 ? -1.0 : now_s() + timeout_ms / 1000.0;
    return 0;
}

/* Finished transfers to their requests; whether there were any. */
static int reap(Engine *e) {
    int left = 0, finished = 0;
    CURLMsg *m;
    while ((m = lib.multi_info_read(e->multi, &left))) {
        if (m->msg != MSG_DONE)
            continue;
        CURL *c = m->easy_handle;
        int code = m->data.result;
        Req *r = NULL;
        lib.easy_getinfo(c, I_PRIVATE, (char **)&r);
        long status = 0, version = 0, connects = 0;
        int64_t connect_us = 0;
        lib.easy_getinfo(c, I_RESPONSE_CODE, &status);
        lib.easy_getinfo(c, I_HTTP_VERSION, &version);
        lib.easy_getinfo(c, I_NUM_CONNECTS, &connects);
        lib.easy_getinfo(c, I_CONNECT_TIME_T, &connect_us);
        char *eff = NULL, *final = NULL;
        if (r && r->page) { /* a listing page's final URL (after redirects); set before submit returned */
            lib.easy_getinfo(c, I_EFFECTIVE_URL, &eff);
            final = eff ? strdup(eff) : NULL; /* owned by c, which is reset below */
        }
        lib.multi_remove_handle(e->multi, c);
        pthread_mutex_lock(&e->mu);
        give_easy(e, c);
        if (r && r->state == ACTIVE) {
            r->easy = NULL;
            r->status = status;
            r->http_version = version;
            r->connects = connects;
            r->connect_us = connect_us;
            free(r->final);
            r->final = final;
            final = NULL;
            if (code == E_WRITE_ERROR && r->full)
                code = 0; /* ended on purpose by on_write: it had what was asked */
            finish(e, r, code);
        }
        pthread_mutex_unlock(&e->mu);
        free(final); /* not taken: the request was cancelled meanwhile */
        finished = 1;
    }
    return finished;
}

/* The transfer thread: epoll on the sockets libcurl names (socket_action serves only the
 * ready ones; curl_multi_poll and curl_multi_perform looked at every transfer on each
 * wake-up), the eventfd for new work and cancels, and libcurl's timer. */
static void *serve(void *arg) {
    Engine *e = arg;
    struct epoll_event evs[64];
    int running = 0;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        admit(e);
        pthread_mutex_unlock(&e->mu);
        if (e->deadline >= 0 && now_s() >= e->deadline) {
            e->deadline = -1;
            lib.multi_socket_action(e->multi, SOCKET_TIMEOUT, 0, &running);
        }
        if (reap(e))
            continue; /* their permits may start queued requests before the next wait */
        int wait_ms = 1000;
        if (e->deadline >= 0) {
            double left = (e->deadline - now_s()) * 1000.0;
            wait_ms = left <= 0 ? 0 : (left >= 1000 ? 1000 : (int)left + 1);
        }
        int n = epoll_wait(e->epfd, evs, 64, wait_ms);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == e->wakefd) {
                uint64_t count;
                if (read(e->wakefd, &count, sizeof count) < 0) { /* EAGAIN: woken already */
                }
                continue;
            }
            uint32_t got = evs[i].events;
            int mask = (got & EPOLLIN ? CSELECT_IN : 0) | (got & EPOLLOUT ? CSELECT_OUT : 0) |
                       (got & (EPOLLERR | EPOLLHUP) ? CSELECT_ERR : 0);
            lib.multi_socket_action(e->multi, fd, mask, &running);
        }
    }
    return NULL;
}

/* ---- Python: Transfer ------------------------------------------------------- */

static PyTypeObject TransferType;

static int stale(Engine *e) {
    if (e->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "a curl engine of the parent process (fork): start a new one");
        return 1;
    }
    return 0;
}

static PyObject *header_or_none(const char *s) {
    if (!s)
        Py_RETURN_NONE;
    return PyUnicode_DecodeLatin1(s, (Py_ssize_t)strlen(s), "replace");
}

static void wake(Engine *e) {
    uint64_t one = 1;
    if (write(e->wakefd, &one, sizeof one) < 0) { /* EAGAIN: a wake-up is pending already */
    }
}

static PyObject *Transfer_result(Transfer *self, PyObject *unused) {
    if (self->answer) {
        Py_INCREF(self->answer);
        return self->answer;
    }
    Engine *e = self->eng;
    if (stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    Req *r = self->req;
    if (r->state != DONE) {
        pthread_mutex_unlock(&e->mu);
        Py_RETURN_NONE;
    }
    pthread_mutex_unlock(&e->mu);
    /* DONE: the transfer thread no longer touches r. A lent body that came whole is the answer's as it is. */
    PyObject *body;
    if (r->lent && self->body && (Py_ssize_t)r->got == PyBytes_GET_SIZE(self->body)) {
        body = self->body;
        self->body = NULL;
    } else {
        body = PyBytes_FromStringAndSize(r->buf ? r->buf : "", (Py_ssize_t)r->got);
    }
    if (!body)
        return NULL;
    const char *message = r->code > 0 ? lib.easy_strerror(r->code) : (r->code == CANCELLED ? "cancelled" : "");
    self->answer = Py_BuildValue("(iiNNNNNNNNsNNN)", r->code, (int)r->status, body, header_or_none(r->h[H_RANGE]),
                                 header_or_none(r->h[H_LENGTH]), header_or_none(r->h[H_ETAG]),
                                 header_or_none(r->h[H_MODIFIED]), header_or_none(r->h[H_MD5]),
                                 header_or_none(r->h[H_DIGEST]), PyBool_FromLong(r->closes || r->http_version == HTTP_VERSION_1_0),
                                 message, header_or_none(r->h[H_TYPE]), header_or_none(r->final), header_or_none(r->h[H_GENERATION]));
    if (!self->answer)
        return NULL;
    if (!r->lent)
        free(r->buf); /* the bytes now live in the answer */
    Py_CLEAR(self->body); /* a short answer's copy was made above */
    r->buf = NULL;
    r->lent = 0;
    r->got = r->cap = 0;
    Py_INCREF(self->answer);
    return self->answer;
}

/* Whether the request has reached `state` (states only move forward); None on error. */
static PyObject *reached(Transfer *self, int state) {
    if (self->answer)
        Py_RETURN_TRUE;
    Engine *e = self->eng;
    if (stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    int yes = self->req->state >= state;
    pthread_mutex_unlock(&e->mu);
    return PyBool_FromLong(yes);
}

static PyObject *Transfer_started(Transfer *self, PyObject *unused) { return reached(self, ACTIVE); }

static PyObject *Transfer_done(Transfer *self, PyObject *unused) { return reached(self, DONE); }

/* Under mu: ask the transfer thread to end r (queued or active). */
static void cancel_locked(Engine *e, Req *r) {
    if (r->state == DONE || r->cancel)
        return;
    r->cancel = 1;
    if (r->state != ACTIVE)
        e->sweep = 1;
    else if (grow((void **)&e->cancels, &e->cancels_cap, e->ncancels + 1, sizeof(Req *)) == 0)
        e->cancels[e->ncancels++] = r;
}

static PyObject *Transfer_cancel(Transfer *self, PyObject *unused) {
    Engine *e = self->eng;
    if (stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    int was_done = self->req->state == DONE;
    cancel_locked(e, self->req);
    pthread_mutex_unlock(&e->mu);
    wake(e);
    return PyBool_FromLong(!was_done);
}

static void Transfer_dealloc(Transfer *self) {
    Engine *e = self->eng;
    Req *r = self->req;
    Py_CLEAR(self->answer);
    if (e && r && e->pid == getpid()) { /* after a fork the parent's engine is left alone */
        pthread_mutex_lock(&e->mu);
        if (r->state != DONE && r->lent) {
            /* The transfer thread writes into self->body until r is done: cancel it and wait for that
             * (a cancel is taken at the thread's next turn), so the bytes are not freed under it. */
            cancel_locked(e, r);
            pthread_mutex_unlock(&e->mu);
            wake(e);
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&e->mu);
            while (r->state != DONE) {
                pthread_mutex_unlock(&e->mu);
                struct timespec nap = {0, 200000};
                nanosleep(&nap, NULL);
                pthread_mutex_lock(&e->mu);
            }
            pthread_mutex_unlock(&e->mu);
            Py_END_ALLOW_THREADS
            pthread_mutex_lock(&e->mu);
        }
        if (r->state == DONE) {
            req_free(r);
        } else {
            r->abandoned = 1; /* freed by the transfer thread when it finishes */
            cancel_locked(e, r);
        }
        pthread_mutex_unlock(&e->mu);
        wake(e);
    }
    Py_CLEAR(self->body);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Transfer_methods[] = {
    {"result", (PyCFunction)Transfer_result, METH_NOARGS,
     "None while it runs; then (code, status, body, content_range, content_length, etag, last_modified, "
     "content_md5, digest, closes, message, content_type, final_url, x_goog_generation); content_type and final_url "
     "for a page only, else None. "
     "code: libcurl's (0 ok, -1 cancelled)."},
    {"done", (PyCFunction)Transfer_done, METH_NOARGS, "Whether it finished (or was cancelled)."},
    {"started", (PyCFunction)Transfer_started, METH_NOARGS, "Whether it left its host's queue (running or done)."},
    {"cancel", (PyCFunction)Transfer_cancel, METH_NOARGS, "End it; True if it had not finished."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TransferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastload._curl.Transfer",
    .tp_basicsize = sizeof(Transfer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One GET handed to an Engine.",
    .tp_dealloc = (destructor)Transfer_dealloc,
    .tp_methods = Transfer_methods,
};

/* ---- Python: Engine --------------------------------------------------------- */

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"cainfo", "capath", NULL};
    const char *cainfo = NULL, *capath = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|zz", kwlist, &cainfo, &capath))
        return NULL;
    if (load_libcurl() < 0) {
        PyErr_SetString(PyExc_OSError, lib_error);
        return NULL;
    }
    Engine *e = (Engine *)type->tp_alloc(type, 0);
    if (!e)
        return NULL;
    pthread_mutex_init(&e->mu, NULL);
    e->pid = getpid();
    e->cainfo = cainfo ? strdup(cainfo) : NULL;
    e->capath = capath ? strdup(capath) : NULL;
    e->multi = lib.multi_init();
    if (!e->multi) {
        PyErr_SetString(PyExc_OSError, "curl_multi_init failed");
        Py_DECREF(e);
        return NULL;
    }
    lib.multi_setopt(e->multi, M_MAXCONNECTS, 256L); /* idle connections kept for reuse */
    e->deadline = -1;
    e->epfd = epoll_create1(EPOLL_CLOEXEC);
    e->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event wev;
    memset(&wev, 0, sizeof wev);
    wev.events = EPOLLIN;
    wev.data.fd = e->wakefd;
    if (e->epfd < 0 || e->wakefd < 0 || epoll_ctl(e->epfd, EPOLL_CTL_ADD, e->wakefd, &wev) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL; /* e is leaked, as any engine: never freed */
    }
    lib.multi_setopt(e->multi, M_SOCKETFUNCTION, on_socket);
    lib.multi_setopt(e->multi, M_SOCKETDATA, e);
    lib.multi_setopt(e->multi, M_TIMERFUNCTION, on_timer);
    lib.multi_setopt(e->multi, M_TIMERDATA, e);
    pthread_t th;
    pthread_attr_t ta;
    pthread_attr_init(&ta);
    pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
    int err = pthread_create(&th, &ta, serve, e);
    pthread_attr_destroy(&ta);
    if (err) {
        PyErr_SetString(PyExc_OSError, "cannot start the curl thread");
        e->multi = NULL; /* leaked with e: never freed (an engine lives for the process) */
        return NULL;
    }
    e->started = 1;
    return (PyObject *)e;
}

static void Engine_dealloc(Engine *e) {
    /* A started engine is kept for the life of the process (its thread holds it). */
    if (!e->started)
        Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *Engine_host(Engine *e, PyObject *unused) {
    if (stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    Host *hosts = realloc(e->hosts, (size_t)(e->nhosts + 1) * sizeof(Host));
    if (!hosts) {
        pthread_mutex_unlock(&e->mu);
        return PyErr_NoMemory();
    }
    memset(&hosts[e->nhosts], 0, sizeof(Host));
    e->hosts = hosts;
    int id = e->nhosts++;
    pthread_mutex_unlock(&e->mu);
    return PyLong_FromLong(id);
}

static int check_host(Engine *e, int host) {
    if (host < 0 || host >= e->nhosts) {
        PyErr_Format(PyExc_ValueError, "no host %d", host);
        return -1;
    }
    return 0;
}

static char *dup_utf8(PyObject *s) {
    const char *u = PyUnicode_AsUTF8(s);
    return u ? strdup(u) : NULL;
}

static PyObject *Engine_submit(Engine *e, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"host", "urls", "max_bytes", "headers", "timeout_s", "userpwd", "trust_env", "page", "lines",
                             "cainfo", "capath", "verify", "http2", "sizes", "exact", "follow", NULL};
    int host, trust_env = 0, page = 0, verify = 1, http2 = 0, exact = 0, follow = 1;
    PyObject *urls, *headers, *lines = NULL, *sizes = NULL;
    Py_ssize_t max_bytes;
    double timeout_s;
    const char *userpwd = NULL, *cainfo = NULL, *capath = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO!nO!d|zppOzzppOpp", kwlist, &host, &PyList_Type, &urls, &max_bytes,
                                     &PyList_Type, &headers, &timeout_s, &userpwd, &trust_env, &page, &lines, &cainfo,
                                     &capath, &verify, &http2, &sizes, &exact, &follow))
        return NULL;
    if (sizes == Py_None)
        sizes = NULL;
    if (sizes && !PyList_Check(sizes))
        return PyErr_Format(PyExc_TypeError, "sizes must be a list or None");
    if (lines == Py_None)
        lines = NULL;
    if (lines && !PyList_Check(lines))
        return PyErr_Format(PyExc_TypeError, "lines must be a list or None");
    if (stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    int bad = check_host(e, host);
    pthread_mutex_unlock(&e->mu);
    if (bad)
        return NULL;
    if (max_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "max_bytes < 0");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(urls), nh = PyList_GET_SIZE(headers);
    if (lines && PyList_GET_SIZE(lines) != n)
        return PyErr_Format(PyExc_ValueError, "lines has %zd items for %zd urls", PyList_GET_SIZE(lines), n);
    if (sizes && PyList_GET_SIZE(sizes) != n)
        return PyErr_Format(PyExc_ValueError, "sizes has %zd items for %zd urls", PyList_GET_SIZE(sizes), n);
    for (Py_ssize_t i = 0; sizes && i < n; i++) {
        Py_ssize_t size = PyLong_Check(PyList_GET_ITEM(sizes, i)) ? PyLong_AsSsize_t(PyList_GET_ITEM(sizes, i)) : -1;
        if (size < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "sizes[%zd] is not an int >= 0", i);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; lines && i < n; i++)
        if (!PyUnicode_Check(PyList_GET_ITEM(lines, i)))
            return PyErr_Format(PyExc_TypeError, "lines[%zd] is not a str", i);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_Check(PyList_GET_ITEM(urls, i)))
            return PyErr_Format(PyExc_TypeError, "urls[%zd] is not a str", i);
    for (Py_ssize_t i = 0; i < nh; i++)
        if (!PyUnicode_Check(PyList_GET_ITEM(headers, i)))
            return PyErr_Format(PyExc_TypeError, "headers[%zd] is not a str", i);
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    Req *first = NULL, *last = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Req *r = calloc(1, sizeof(Req));
        Transfer *t = r ? PyObject_New(Transfer, &TransferType) : NULL;
        if (!t) {
            free(r);
            goto fail;
        }
        t->eng = e;
        t->req = r;
        t->answer = NULL;
        t->body = NULL;
        PyList_SET_ITEM(out, i, (PyObject *)t);
        r->eng = e;
        r->host = host;
        r->state = INCOMING;
        r->max_bytes = sizes ? (size_t)PyLong_AsSsize_t(PyList_GET_ITEM(sizes, i)) : (size_t)max_bytes;
        if (exact) { /* the body lands in the bytes object result() returns: no copy once it is here */
            t->body = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)r->max_bytes);
            if (!t->body)
                goto fail;
            r->buf = PyBytes_AS_STRING(t->body);
            r->cap = r->max_bytes;
            r->lent = 1;
        }
        r->timeout_ms = (long)(timeout_s * 1000);
        r->trust_env = trust_env;
        r->page = page;
        r->follow = follow;
        r->url = dup_utf8(PyList_GET_ITEM(urls, i));
        r->userpwd = userpwd ? strdup(userpwd) : NULL;
        r->cainfo = cainfo ? strdup(cainfo) : NULL;
        r->capath = capath ? strdup(capath) : NULL;
        r->verify = verify;
        r->http2 = http2;
        if (!r->url || (userpwd && !r->userpwd) || (cainfo && !r->cainfo) || (capath && !r->capath))
            goto fail;
        for (Py_ssize_t k = 0; k < nh; k++) {
            const char *line = PyUnicode_AsUTF8(PyList_GET_ITEM(headers, k));
            struct curl_slist *sl = line ? lib.slist_append(r->headers, line) : NULL;
            if (!sl)
                goto fail;
            r->headers = sl;
        }
        /* This URL's own header lines, "\r\n" between them: an S3 GET's Authorization (fastload.source.s3),
         * a ranged GET's Range and If-Match (fastload.source.ranged). */
        const char *own = lines ? PyUnicode_AsUTF8(PyList_GET_ITEM(lines, i)) : NULL;
        if (lines && !own)
            goto fail;
        while (own && *own) {
            const char *cut = strstr(own, "\r\n");
            size_t len = cut ? (size_t)(cut - own) : strlen(own);
            char *line = len ? strndup(own, len) : NULL;
            struct curl_slist *sl = line ? lib.slist_append(r->headers, line) : r->headers;
            free(line);
            if (!sl)
                goto fail;
            r->headers = sl;
            own = cut ? cut + 2 : own + len;
        }
        if (last)
            last->next = r;
        else
            first = r;
        last = r;
    }
    if (first) {
        pthread_mutex_lock(&e->mu);
        if (e->in_tail)
            e->in_tail->next = first;
        else
            e->in_head = first;
        e->in_tail = last;
        pthread_mutex_unlock(&e->mu);
        wake(e);
    }
    return out;
fail:
    /* Nothing was handed over: each Transfer made so far is marked done so its dealloc frees it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        Transfer *t = (Transfer *)PyList_GET_ITEM(out, i);
        if (t)
            t->req->state = DONE;
    }
    Py_DECREF(out);
    if (!PyErr_Occurred())
        PyErr_NoMemory();
    return NULL;
}

static PyObject *Engine_wait(Engine *e, PyObject *args) {
    PyObject *transfers;
    double timeout_s, pump_s = -1;
    if (!PyArg_ParseTuple(args, "O!d|d", &PyList_Type, &transfers, &timeout_s, &pump_s))
        return NULL;
    if (stale(e))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(transfers);
    Req **reqs = malloc((size_t)(n ? n : 1) * sizeof(Req *));
    if (!reqs)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(transfers, i);
        if (!PyObject_TypeCheck(t, &TransferType) || ((Transfer *)t)->eng != e) {
            free(reqs);
            return PyErr_Format(PyExc_TypeError, "transfers[%zd] is not a Transfer of this engine", i);
        }
        reqs[i] = ((Transfer *)t)->req; /* alive: the list holds their Transfers */
    }
    int all = 0;
    Py_BEGIN_ALLOW_THREADS
    Waiter w;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&w.cv, &attr);
    pthread_condattr_destroy(&attr);
    w.remaining = 0;
    double deadline = now_s() + (timeout_s > 0 ? timeout_s : 0);
    pthread_mutex_lock(&e->mu);
    int foreign = 0; /* requests another thread waits for: looked at on each wake-up */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (reqs[i]->state == DONE)
            continue;
        if (reqs[i]->waiter == NULL) {
            reqs[i]->waiter = &w;
            w.remaining++;
        } else {
            foreign = 1;
        }
    }
    for (;;) {
        all = w.remaining == 0;
        for (Py_ssize_t i = 0; all && foreign && i < n; i++)
            all = reqs[i]->state == DONE;
        double t = now_s();
        if (all || t >= deadline || (pump_s >= 0 && e->nouts > 0 && t - e->last_drain >= pump_s))
            break;
        /* Woken when all are done; else every pump_s, to hand finished GETs to Python's controller. */
        double until = deadline;
        if ((pump_s >= 0 || foreign) && t + (pump_s > 0 ? pump_s : 0.001) < until)
            until = t + (pump_s > 0 ? pump_s : 0.001);
        struct timespec ts;
        ts.tv_sec = (time_t)until;
        ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&w.cv, &e->mu, &ts);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (reqs[i]->waiter == &w)
            reqs[i]->waiter = NULL;
    pthread_mutex_unlock(&e->mu);
    pthread_cond_destroy(&w.cv);
    Py_END_ALLOW_THREADS
    free(reqs);
    return PyBool_FromLong(all);
}

static PyObject *Engine_outcomes(Engine *e, PyObject *unused) {
    if (stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    e->last_drain = now_s();
    int n = e->nouts;
    Outcome *outs = NULL;
    if (n) {
        outs = malloc((size_t)n * sizeof(Outcome));
        if (outs) {
            memcpy(outs, e->outs, (size_t)n * sizeof(Outcome));
            e->nouts = 0;
        }
    }
    pthread_mutex_unlock(&e->mu);
    if (n && !outs)
        return PyErr_NoMemory();
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        Outcome *o = &outs[i];
        PyObject *item = Py_BuildValue("(iiidnldO)", o->host, o->code, (int)o->status, o->latency, (Py_ssize_t)o->nbytes,
                                       o->connects, o->connect_s, o->closes ? Py_True : Py_False);
        if (!item) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, item);
    }
    free(outs);
    return list;
}

/* Under mu: whether Python has work here (outcomes to take, or permits no request needs). */
static int needs_python(Engine *e) {
    if (e->nouts)
        return 1;
    for (int k = 0; k < e->nhosts; k++)
        if (e->hosts[k].permits > e->hosts[k].active + e->hosts[k].queued)
            return 1;
    return 0;
}

static PyObject *Engine_watch(Engine *e, PyObject *args) {
    double timeout_s, quiet_s;
    if (!PyArg_ParseTuple(args, "dd", &timeout_s, &quiet_s) || stale(e))
        return NULL;
    int due = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Polled, not signalled: a wake-up per finished request would cost a thread switch each. */
    double deadline = now_s() + timeout_s;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        double t = now_s();
        due = needs_python(e) && t - e->last_drain >= quiet_s;
        pthread_mutex_unlock(&e->mu);
        if (due || t >= deadline)
            break;
        double nap = quiet_s < deadline - t ? quiet_s : deadline - t;
        struct timespec ts = {(time_t)nap, (long)((nap - (double)(time_t)nap) * 1e9)};
        nanosleep(&ts, NULL);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(due);
}

static PyObject *Engine_counts(Engine *e, PyObject *args) {
    int host;
    if (!PyArg_ParseTuple(args, "i", &host) || stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    if (check_host(e, host)) {
        pthread_mutex_unlock(&e->mu);
        return NULL;
    }
    Host h = e->hosts[host];
    int incoming = 0;
    for (Req *r = e->in_head; r; r = r->next)
        incoming += r->host == host;
    pthread_mutex_unlock(&e->mu);
    return Py_BuildValue("(iii)", h.permits, h.active, h.queued + incoming);
}

static PyObject *Engine_set_permits(Engine *e, PyObject *args) {
    int host, permits;
    if (!PyArg_ParseTuple(args, "ii", &host, &permits) || stale(e))
        return NULL;
    pthread_mutex_lock(&e->mu);
    if (check_host(e, host)) {
        pthread_mutex_unlock(&e->mu);
        return NULL;
    }
    Host *h = &e->hosts[host];
    int grew = permits > h->permits;
    h->permits = permits < 0 ? 0 : permits;
    int held = h->active > h->permits ? h->active : h->permits;
    pthread_mutex_unlock(&e->mu);
    if (grew)
        wake(e);
    return PyLong_FromLong(held);
}

static PyMethodDef Engine_methods[] = {
    {"host", (PyCFunction)Engine_host, METH_NOARGS, "A new host: its id (no permits yet)."},
    {"submit", (PyCFunction)(void (*)(void))Engine_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(host, urls, max_bytes, headers, timeout_s, userpwd=None, trust_env=False, page=False, lines=None, "
     "cainfo=None, capath=None, verify=True, http2=False, sizes=None, exact=False, follow=True) -> "
     "[Transfer]: queue one GET per URL; each body is cut at max_bytes; with page, kept only if it is HTML or XML (a "
     "folder page, an object store's listing); lines: each URL's own header lines, \"\\r\\n\" between them (its "
     "Authorization, Range, If-Match); sizes: each URL's own max_bytes; exact: each body is written into a bytes "
     "object of its max_bytes, which result() returns as it is when the body filled it; cainfo, "
     "capath: the CA bundle file and folder trusted instead of the engine's; verify=False: no certificate or name "
     "check; http2: ask for HTTP/2 over TLS (else HTTP/1.1); follow=False: a redirect is the answer (an HttpStatusError). "
     "Paths are sent as given (no dot-segment squashing)."},
    {"wait", (PyCFunction)Engine_wait, METH_VARARGS,
     "wait(transfers, timeout_s, pump_s=-1) -> bool: until all are done (True) or timeout_s passed; with "
     "pump_s >= 0 also once outcomes have waited pump_s untaken (Engine.outcomes). Releases the GIL."},
    {"outcomes", (PyCFunction)Engine_outcomes, METH_NOARGS,
     "Finished requests since the last call: [(host, code, status, latency_s, nbytes, connects, connect_s, closes)]."},
    {"watch", (PyCFunction)Engine_watch, METH_VARARGS,
     "watch(timeout_s, quiet_s) -> bool: True once outcomes wait or permits idle and no one took outcomes for "
     "quiet_s; False after timeout_s. Releases the GIL."},
    {"counts", (PyCFunction)Engine_counts, METH_VARARGS, "counts(host) -> (permits, active, queued)."},
    {"set_permits", (PyCFunction)Engine_set_permits, METH_VARARGS,
     "set_permits(host, n) -> the permits the engine holds now: max(n, its active requests)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastload._curl.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "libcurl's multi interface on a thread of its own, for the life of the process.",
    .tp_new = Engine_new,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._curl", "First-block HTTP GETs on libcurl, off the GIL (native/_curl.c).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__curl(void) {
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&TransferType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&EngineType);
    Py_INCREF(&TransferType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0 ||
        PyModule_AddObject(m, "Transfer", (PyObject *)&TransferType) < 0 ||
        PyModule_AddIntConstant(m, "CANCELLED", CANCELLED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
