/* Native hot paths of the pmem tier: fill a record inside PMDK's allocation constructor, and
 * copy a payload out while verifying it; both hash (xxh3-64) and copy in one pass, hold no GIL.
 *
 * Built by setup.py, loaded with ctypes by tierkv/tiers/pmem/_native.py; PMDK's functions are
 * passed in as pointers (struct tkv_pmem_api), so the library links against nothing but libc and
 * needs only xxhash.h (inline). copy_queue.c runs these on worker threads.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "copy_queue.h"

/* put: hash-then-stream granule; the chunk just hashed is still in L1 when it is streamed out.
 * get: copy-then-hash granule, with the next chunk prefetched while this one is hashed. Both were
 * tuned on the test VM (docs/benchmarks-pmem.md): 16 KiB and 8 KiB beat 4-128 KiB. */
#define TKV_PUT_CHUNK ((size_t)16 << 10)
#define TKV_GET_CHUNK ((size_t)8 << 10)
#define TKV_STREAM_MIN ((size_t)2 << 20)
/* libpmem's PMEM_F_MEM_NODRAIN | PMEM_F_MEM_NONTEMPORAL */
#define TKV_STREAM_FLAGS 3u
/* The object header's prefix (tierkv/formats/header.py): the lead (magic, version u16, reserved
 * u16; copied as is), body length u32, body xxh3 u64; and msgpack's widest unsigned integer.
 * Mirrors of formats/header.py: the loader compares them with it (tkv_layout) and refuses a
 * library that disagrees. Overridable only so that a test can build one that does. */
#ifndef TKV_HEADER_PREFIX
#define TKV_HEADER_PREFIX 20
#endif
#ifndef TKV_HEADER_LEAD
#define TKV_HEADER_LEAD 8
#endif
#ifndef TKV_BODY_LENGTH_AT
#define TKV_BODY_LENGTH_AT 8
#endif
#ifndef TKV_BODY_CHECKSUM_AT
#define TKV_BODY_CHECKSUM_AT 12
#endif
#ifndef TKV_WIDEST_UINT
#define TKV_WIDEST_UINT 9
#endif

/* msgpack's shortest encoding of an unsigned integer, as msgpack-python writes it */
static size_t pack_uint(uint8_t *out, uint64_t v)
{
    size_t n, i;
    if (v < 128) { out[0] = (uint8_t)v; return 1; }
    if (v < 0x100) { out[0] = 0xcc; n = 1; }
    else if (v < 0x10000) { out[0] = 0xcd; n = 2; }
    else if (v < 0x100000000ULL) { out[0] = 0xce; n = 4; }
    else { out[0] = 0xcf; n = 8; }
    for (i = 0; i < n; i++)
        out[1 + i] = (uint8_t)(v >> (8 * (n - 1 - i)));
    return n + 1;
}

static void put_le(uint8_t *out, uint64_t v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (uint8_t)(v >> (8 * i));
}

/* The record's prefix and header in front of a payload placed at the widest header's offset
 * (moved up when the checksum encodes shorter, 1 in 2**32); the payload's offset. Exported so that
 * tests can drive the rare branch with a chosen checksum. */
size_t tkv_write_header(const struct tkv_put *p, uint8_t *base, uint64_t payload_sum)
{
    size_t header_start = p->prefix_len;
    size_t body_start = header_start + TKV_HEADER_PREFIX;
    size_t widest = body_start + p->body_head_len + TKV_WIDEST_UINT + p->body_tail_len;
    uint8_t sum_bytes[TKV_WIDEST_UINT];
    size_t sum_len = pack_uint(sum_bytes, payload_sum);
    size_t body_len = p->body_head_len + sum_len + p->body_tail_len;
    size_t offset = body_start + body_len;

    if (offset != widest)
        memmove(base + offset, base + widest, p->payload_len);
    memcpy(base, p->prefix, p->prefix_len);
    memcpy(base + body_start, p->body_head, p->body_head_len);
    memcpy(base + body_start + p->body_head_len, sum_bytes, sum_len);
    memcpy(base + body_start + p->body_head_len + sum_len, p->body_tail, p->body_tail_len);
    memcpy(base + header_start, p->magic, TKV_HEADER_LEAD);
    put_le(base + header_start + TKV_BODY_LENGTH_AT, body_len, 4);
    put_le(base + header_start + TKV_BODY_CHECKSUM_AT, XXH3_64bits(base + body_start, body_len), 8);
    return offset;
}

/* PMDK's constructor: the payload (hashed, streamed), then the header that holds its checksum,
 * then one persist of the whole record, all before PMDK publishes the allocation. */
static int construct(void *pop, void *ptr, void *arg)
{
    struct tkv_put *p = arg;
    const struct tkv_pmem_api *api = p->api;
    uint8_t *base = ptr;
    size_t widest = p->prefix_len + TKV_HEADER_PREFIX + p->body_head_len + TKV_WIDEST_UINT
                    + p->body_tail_len;
    XXH3_state_t state;
    size_t done, offset;

    XXH3_64bits_reset(&state);
    for (done = 0; done < p->payload_len; done += TKV_PUT_CHUNK) {
        size_t n = p->payload_len - done < TKV_PUT_CHUNK ? p->payload_len - done
                                                         : TKV_PUT_CHUNK;
        XXH3_64bits_update(&state, p->payload + done, n);
        api->pmem_memcpy(base + widest + done, p->payload + done, n, TKV_STREAM_FLAGS);
    }
    p->payload_sum = XXH3_64bits_digest(&state);
    api->pmem_drain();

    offset = tkv_write_header(p, base, p->payload_sum);
    api->persist(pop, base, offset + p->payload_len);
    p->payload_offset = offset;
    p->address = (uint64_t)(uintptr_t)ptr;
    return 0;
}

/* Allocate and fill one record (pmemobj_xalloc with the constructor above); PMDK's status. */
int tkv_pmem_put(struct tkv_put *p, tkv_oid *oid)
{
    size_t size = p->prefix_len + TKV_HEADER_PREFIX + p->body_head_len + TKV_WIDEST_UINT
                  + p->body_tail_len + p->payload_len;
    return p->api->xalloc(p->pop, oid, size, p->type_num, p->flags, construct, p);
}

/* Copy with streaming (non-temporal) stores: the destination's lines are not read first and do
 * not evict the cache. The caller fences (sfence) before anyone else may read `dest`. */
static void stream_copy(uint8_t *dest, const uint8_t *src, size_t len)
{
#ifdef __SSE2__
    size_t head = (16 - ((uintptr_t)dest & 15)) & 15;
    if (head > len)
        head = len;
    memcpy(dest, src, head);
    dest += head;
    src += head;
    len -= head;
    for (; len >= 64; len -= 64, dest += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dest, a);
        _mm_stream_si128((__m128i *)(dest + 16), b);
        _mm_stream_si128((__m128i *)(dest + 32), c);
        _mm_stream_si128((__m128i *)(dest + 48), d);
    }
#endif
    memcpy(dest, src, len);
}

/* Copy `len` bytes from `src` to `dest`, hashing them on the way; 1 if they match `expected`.
 * Chunk by chunk, the next chunk is prefetched while this one is hashed from the cache the copy
 * just filled. Results of `TKV_STREAM_MIN` bytes or more are written with streaming stores (and
 * the source chunk is hashed instead): a result that large does not stay in cache anyway, and
 * regular stores would first read every destination line from memory. Measured at 8 requests in
 * flight (docs/benchmarks-pmem.md): streaming won at 4 MiB (median 0.72 vs 0.55 of memcpy) and
 * lost at 1 MiB (0.62 vs 0.80), where recycled result buffers are still in cache. */
int tkv_copy_verified(uint8_t *dest, const uint8_t *src, size_t len, uint64_t expected)
{
    XXH3_state_t state;
    size_t done, ahead;
    int streaming = len >= TKV_STREAM_MIN;
    XXH3_64bits_reset(&state);
    for (done = 0; done < len; done += TKV_GET_CHUNK) {
        size_t n = len - done < TKV_GET_CHUNK ? len - done : TKV_GET_CHUNK;
        if (streaming)
            stream_copy(dest + done, src + done, n);
        else
            memcpy(dest + done, src + done, n);
        for (ahead = done + n; ahead < done + n + TKV_GET_CHUNK && ahead < len; ahead += 64)
            __builtin_prefetch(src + ahead, 0, 3);
        XXH3_64bits_update(&state, streaming ? src + done : dest + done, n);
    }
#ifdef __SSE2__
    if (streaming)
        _mm_sfence();
#endif
    return XXH3_64bits_digest(&state) == expected;
}

/* xxh3-64 of `len` bytes: lets tests check that this library and Python's xxhash agree */
uint64_t tkv_xxh3_64(const uint8_t *data, size_t len)
{
    return XXH3_64bits(data, len);
}

int tkv_abi_version(void)
{
    return TKV_ABI_VERSION;
}

uint64_t tkv_layout(int which)
{
    switch (which) {
    case 0:
        return TKV_HEADER_PREFIX;
    case 1:
        return TKV_HEADER_LEAD;
    case 2:
        return TKV_BODY_LENGTH_AT;
    case 3:
        return TKV_BODY_CHECKSUM_AT;
    case 4:
        return TKV_WIDEST_UINT;
    default:
        return UINT64_MAX;
    }
}

size_t tkv_sizeof(int which)
{
    switch (which) {
    case 0:
        return sizeof(struct tkv_pmem_api);
    case 1:
        return sizeof(struct tkv_put);
    case 2:
        return sizeof(struct tkv_job);
    default:
        return 0;
    }
}
