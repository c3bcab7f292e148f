/* Shared declarations of the native library: pmem_copy.c (the pmem tier's copy-and-hash paths)
 * and copy_queue.c (the worker threads that run them, and the gpu tier's host copies on the CPU).
 * The Python mirrors of these structures are tierkv/tiers/_native.py (the job, the queue) and
 * tierkv/tiers/pmem/_native.py (the pmem put): change them together. */
#ifndef TIERKV_COPY_QUEUE_H
#define TIERKV_COPY_QUEUE_H

#include <stddef.h>
#include <stdint.h>

/* Bumped with any change of the structures or functions below; the loader refuses a library of
 * another version (a stale build), as it refuses one whose structure sizes differ. */
#ifndef TKV_ABI_VERSION /* a test builds a stale-looking library by defining it */
#define TKV_ABI_VERSION 4
#endif

typedef struct { uint64_t pool_uuid_lo; uint64_t off; } tkv_oid;
typedef int (*tkv_ctor)(void *pop, void *ptr, void *arg);

/* PMDK entry points, passed in from the ctypes binding that already loaded PMDK */
struct tkv_pmem_api {
    int (*xalloc)(void *pop, tkv_oid *oidp, size_t size, uint64_t type_num, uint64_t flags,
                  tkv_ctor constructor, void *arg);
    void (*persist)(void *pop, const void *addr, size_t len);
    void *(*pmem_memcpy)(void *dest, const void *src, size_t len, unsigned flags);
    void (*pmem_drain)(void);
    const char *(*errormsg)(void);
};

/* One put: inputs from Python, outputs written by the constructor. */
struct tkv_put {
    const struct tkv_pmem_api *api;
    void *pop;
    uint64_t type_num;
    uint64_t flags;
    const uint8_t *prefix;      /* the record prefix, written as is */
    size_t prefix_len;
    const uint8_t *magic;       /* the header prefix's lead: magic, version, reserved */
    const uint8_t *body_head;   /* msgpack body before the payload checksum field */
    size_t body_head_len;
    const uint8_t *body_tail;   /* msgpack body after it */
    size_t body_tail_len;
    const uint8_t *payload;
    size_t payload_len;
    /* out */
    uint64_t payload_sum;
    uint64_t payload_offset;
    uint64_t address;
};

enum { TKV_OP_PUT = 1, TKV_OP_GET = 2, TKV_OP_COPY = 3 };

/* One queued job: a put (`put`, out: `oid`, `status` = PMDK's, `error`, `message`), a get
 * (`dest`, `src`, `len`, `expected`; out: `status` = 1 when the checksum matched) or a plain
 * copy (`dest`, `src`, `len`; out: `status` = 1). */
struct tkv_job {
    uint64_t id;
    uint32_t op;
    int32_t status;
    int32_t error;
    int32_t reserved;
    struct tkv_put *put;
    tkv_oid oid;
    uint8_t *dest;
    const uint8_t *src;
    size_t len;
    uint64_t expected;
    struct tkv_job *next;
    char message[256];
};

struct tkv_queue;

int tkv_abi_version(void);
size_t tkv_sizeof(int which); /* 0: tkv_pmem_api, 1: tkv_put, 2: tkv_job */
/* the object-header facts the put mirrors: 0: prefix size, 1: lead size, 2: offset of the body
 * length, 3: offset of the body checksum, 4: widest msgpack uint; UINT64_MAX past the end */
uint64_t tkv_layout(int which);

int tkv_pmem_put(struct tkv_put *p, tkv_oid *oid);
size_t tkv_write_header(const struct tkv_put *p, uint8_t *base, uint64_t payload_sum);
int tkv_copy_verified(uint8_t *dest, const uint8_t *src, size_t len, uint64_t expected);

struct tkv_queue *tkv_queue_create(int workers);
int tkv_queue_eventfd(struct tkv_queue *q);
void tkv_queue_submit(struct tkv_queue *q, struct tkv_job *job);
void tkv_queue_kick(struct tkv_queue *q);
int tkv_queue_reap(struct tkv_queue *q, uint64_t *ids, int max);
void tkv_queue_destroy(struct tkv_queue *q);

#endif
