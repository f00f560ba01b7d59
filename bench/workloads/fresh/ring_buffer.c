/* A fixed-size ring buffer of sensor readings, shared by the sampler and the logger. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define RING_CAPACITY 64

struct reading {
    uint32_t sensor_id;
    int32_t millidegrees;
    uint64_t taken_at_ms;
};

struct ring {
    struct reading items[RING_CAPACITY];
    size_t head;
    size_t count;
    uint64_t overwritten;
};

void ring_init(struct ring *r) {
    memset(r, 0, sizeof *r);
}

bool ring_empty(const struct ring *r) {
    return r->count == 0;
}

bool ring_full(const struct ring *r) {
    return r->count == RING_CAPACITY;
}

/* Adds a reading; when the ring is full the oldest one is dropped and counted. */
void ring_push(struct ring *r, struct reading value) {
    size_t tail = (r->head + r->count) % RING_CAPACITY;
    r->items[tail] = value;
    if (ring_full(r)) {
        r->head = (r->head + 1) % RING_CAPACITY;
        r->overwritten++;
    } else {
        r->count++;
    }
}

/* Takes the oldest reading into *out; returns false when there is none. */
bool ring_pop(struct ring *r, struct reading *out) {
    if (ring_empty(r)) {
        return false;
    }
    *out = r->items[r->head];
    r->head = (r->head + 1) % RING_CAPACITY;
    r->count--;
    return true;
}

/* The mean of the readings held, in millidegrees; 0 for an empty ring. */
int32_t ring_mean(const struct ring *r) {
    if (ring_empty(r)) {
        return 0;
    }
    int64_t sum = 0;
    for (size_t i = 0; i < r->count; i++) {
        sum += r->items[(r->head + i) % RING_CAPACITY].millidegrees;
    }
    return (int32_t)(sum / (int64_t)r->count);
}
