/* Worker threads that run copies without the GIL: the pmem tier's puts and gets (pmem_copy.c),
 * and the plain copies of the gpu tier's host slots on the CPU.
 *
 * The event loop submits jobs (`tkv_queue_submit`, nanoseconds: a linked-list append under a
 * mutex), then wakes the workers they need once per loop turn (`tkv_queue_kick`): waking a sleeping
 * worker is a futex call that cost the loop ~10 us on the bench VM (an IPI to an idle vCPU), and a
 * turn often submits several jobs. It watches an eventfd; a worker runs each job wholly in C and appends it to the done
 * list, writing the eventfd only when that list was empty, so one wake-up of the loop reaps every
 * job that finished meanwhile (`tkv_queue_reap`). Python never runs on a worker, so a worker never
 * waits for the GIL held by a busy loop, and the loop never waits for a worker to hand it back.
 *
 * Jobs are owned by the caller (ctypes structures it keeps alive from submit until reap).
 * `tkv_queue_destroy` must be called with no job in flight; it stops and joins the workers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "copy_queue.h"

#define TKV_MAX_WORKERS 16

struct tkv_queue {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    struct tkv_job *head, *tail;           /* submitted, not yet taken */
    struct tkv_job *done_head, *done_tail; /* finished, not yet reaped */
    int stopping;
    int sleepers; /* workers waiting on `wake` */
    int waking;   /* of those, signalled and not yet awake: a kick does not signal them again */
    int queued;   /* jobs submitted and not yet taken */
    int eventfd;
    int workers;
    pthread_t threads[TKV_MAX_WORKERS];
};

static void run_job(struct tkv_job *job)
{
    const char *message;
    errno = 0;
    if (job->op == TKV_OP_PUT) {
        job->status = tkv_pmem_put(job->put, &job->oid);
        if (job->status != 0) {
            job->error = errno;
            message = job->put->api->errormsg();
            strncpy(job->message, message ? message : "", sizeof(job->message) - 1);
            job->message[sizeof(job->message) - 1] = '\0';
        }
    } else if (job->op == TKV_OP_GET) {
        job->status = tkv_copy_verified(job->dest, job->src, job->len, job->expected);
    } else if (job->op == TKV_OP_COPY) {
        memcpy(job->dest, job->src, job->len);
        job->status = 1;
    } else {
        job->status = -1;
        job->error = EINVAL;
    }
}

static void *serve(void *arg)
{
    struct tkv_queue *q = arg;
    struct tkv_job *job;
    int was_empty;
    uint64_t one = 1;

    for (;;) {
        pthread_mutex_lock(&q->lock);
        while (!q->head && !q->stopping) {
            q->sleepers++;
            pthread_cond_wait(&q->wake, &q->lock);
            q->sleepers--;
            if (q->waking > 0) /* a spurious wake-up may take another's count: a kick then */
                q->waking--;   /* signals one worker more than it needs, never one fewer */
        }
        job = q->head;
        if (!job) {
            pthread_mutex_unlock(&q->lock);
            return NULL;
        }
        q->queued--;
        q->head = job->next;
        if (!q->head)
            q->tail = NULL;
        pthread_mutex_unlock(&q->lock);

        run_job(job);

        job->next = NULL;
        pthread_mutex_lock(&q->lock);
        was_empty = q->done_head == NULL;
        if (was_empty)
            q->done_head = job;
        else
            q->done_tail->next = job;
        q->done_tail = job;
        pthread_mutex_unlock(&q->lock);
        /* the loop reaps the whole list per wake-up: only the first finisher has to wake it */
        if (was_empty && write(q->eventfd, &one, sizeof(one)) != sizeof(one))
            abort(); /* an eventfd write fails only on a counter overflow: impossible here */
    }
}

struct tkv_queue *tkv_queue_create(int workers)
{
    struct tkv_queue *q;
    int i;
    if (workers < 1 || workers > TKV_MAX_WORKERS) {
        errno = EINVAL;
        return NULL;
    }
    q = calloc(1, sizeof(*q));
    if (!q)
        return NULL;
    q->eventfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (q->eventfd < 0) {
        free(q);
        return NULL;
    }
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->wake, NULL);
    for (i = 0; i < workers; i++) {
        int rc = pthread_create(&q->threads[i], NULL, serve, q);
        if (rc != 0) {
            q->workers = i;
            tkv_queue_destroy(q);
            errno = rc;
            return NULL;
        }
    }
    q->workers = workers;
    return q;
}

int tkv_queue_eventfd(struct tkv_queue *q)
{
    return q->eventfd;
}

/* Append `job`; it runs once a worker is awake to take it: call `tkv_queue_kick` after. */
void tkv_queue_submit(struct tkv_queue *q, struct tkv_job *job)
{
    job->next = NULL;
    pthread_mutex_lock(&q->lock);
    if (q->tail)
        q->tail->next = job;
    else
        q->head = job;
    q->tail = job;
    q->queued++;
    pthread_mutex_unlock(&q->lock);
}

/* Wake as many sleeping workers as there are jobs no worker is yet woken for (a busy worker
 * takes the next job when it is done with its own, and one already signalled needs no second
 * signal): one futex call for all the jobs submitted since the last kick. */
void tkv_queue_kick(struct tkv_queue *q)
{
    int idle, want;
    pthread_mutex_lock(&q->lock);
    idle = q->sleepers - q->waking;
    want = q->queued - q->waking;
    if (want > idle)
        want = idle;
    if (want > 0) {
        q->waking += want;
        if (want == idle)
            pthread_cond_broadcast(&q->wake);
        else
            while (want-- > 0)
                pthread_cond_signal(&q->wake);
    }
    pthread_mutex_unlock(&q->lock);
}

/* Finished jobs, oldest first, up to `max` of them; the number written to `ids`. */
int tkv_queue_reap(struct tkv_queue *q, uint64_t *ids, int max)
{
    int n = 0;
    pthread_mutex_lock(&q->lock);
    while (q->done_head && n < max) {
        ids[n++] = q->done_head->id;
        q->done_head = q->done_head->next;
    }
    if (!q->done_head)
        q->done_tail = NULL;
    pthread_mutex_unlock(&q->lock);
    return n;
}

void tkv_queue_destroy(struct tkv_queue *q)
{
    int i;
    pthread_mutex_lock(&q->lock);
    q->stopping = 1;
    pthread_cond_broadcast(&q->wake);
    pthread_mutex_unlock(&q->lock);
    for (i = 0; i < q->workers; i++)
        pthread_join(q->threads[i], NULL);
    close(q->eventfd);
    pthread_cond_destroy(&q->wake);
    pthread_mutex_destroy(&q->lock);
    free(q);
}
