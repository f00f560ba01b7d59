/*
 * A link with a set one-way delay and a bandwidth cap between a namespaced worker and the
 * test bridge (bench/delayed_link.py builds and starts it): this kernel has no netem, and a
 * Python relay adds tens of microseconds a frame, as much as the delays it should set.
 *
 *     link_relay WORKER_IF BRIDGE_IF DELAY_NS BITS_PER_S LEADER_IPV4
 *
 * Frames move both ways between two AF_PACKET sockets (PACKET_VNET_HDR: segmentation
 * offload and checksum state pass through unchanged). Frames from the worker leave
 * DELAY_NS later; frames towards it from LEADER_IPV4 (rank 0, on the bridge itself) too;
 * frames from other workers pass at once (their own relay delayed them), so every pair of
 * ranks is one delay apart each way. BITS_PER_S (0: none) spaces each direction's frames
 * as a cable of that rate would. Waits are ppoll timeouts with a 1 ns timer slack, so the
 * relay sleeps between frames; its own added latency is measured by the caller and
 * reported beside the delay. A frame the socket cannot take yet (EAGAIN, ENOBUFS) waits
 * for POLLOUT, where it was lost unseen (each loss costs TCP a loss probe of 10 ms or
 * more); frames between workers queue as well instead of a send that could fail. Prints
 * "ready" once both sockets are bound; SIGTERM ends it, and it prints what it dropped.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FRAME_BYTES (65536 + 64) /* a GSO super-frame and its virtio header */
#define QUEUE 16384             /* frames held per direction */
#define VNET_HDR 10             /* struct virtio_net_hdr */
#define SOCKET_BYTES (8 << 20)  /* each socket's buffers: a burst of super-frames fits */

#ifndef PACKET_VNET_HDR
#define PACKET_VNET_HDR 15
#endif

struct frame {
    uint64_t due;
    size_t len;
    unsigned char *data;
};

struct queue {
    struct frame items[QUEUE];
    size_t head, count;
    uint64_t free_at; /* when the cap lets the next frame start */
    uint64_t dropped;
};

static volatile sig_atomic_t stopping;
static struct queue towards_bridge, towards_worker, passing; /* passing: other workers' */

static void on_term(int sig) {
    (void)sig;
    stopping = 1;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int packet_socket(const char *name) {
    int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(ETH_P_ALL));
    if (fd < 0) return -1;
    int on = 1, bytes = SOCKET_BYTES;
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &on, sizeof on) < 0) return -1;
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes) < 0)
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof bytes) < 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
    struct sockaddr_ll where = {0};
    where.sll_family = AF_PACKET;
    where.sll_protocol = htons(ETH_P_ALL);
    where.sll_ifindex = (int)if_nametoindex(name);
    if (!where.sll_ifindex || bind(fd, (struct sockaddr *)&where, sizeof where) < 0) return -1;
    return fd;
}

/* Queue a copy of the frame to leave at `due`, or later where the cap says. */
static void hold(struct queue *q, const unsigned char *data, size_t len, uint64_t due,
                 double ns_per_byte) {
    if (q->count == QUEUE) {
        q->dropped++; /* a full queue drops, as a full link would */
        return;
    }
    if (ns_per_byte > 0) {
        if (due < q->free_at) due = q->free_at;
        q->free_at = due + (uint64_t)(ns_per_byte * (double)(len - VNET_HDR));
    }
    struct frame *f = &q->items[(q->head + q->count) % QUEUE];
    f->data = malloc(len);
    if (!f->data) return;
    memcpy(f->data, data, len);
    f->len = len;
    f->due = due;
    q->count++;
}

/* Send the frames that are due; 1 where the socket is full (the rest wait for POLLOUT). */
static int release(struct queue *q, int fd, uint64_t now) {
    while (q->count && q->items[q->head].due <= now) {
        struct frame *f = &q->items[q->head];
        if (send(fd, f->data, f->len, 0) < 0) {
            if (errno == EAGAIN || errno == ENOBUFS) return 1;
            q->dropped++;
        }
        free(f->data);
        q->head = (q->head + 1) % QUEUE;
        q->count--;
    }
    return 0;
}

/* The IPv4 source of an Ethernet frame after its virtio header, or 0. */
static uint32_t source_ipv4(const unsigned char *data, size_t len) {
    const unsigned char *eth = data + VNET_HDR;
    if (len < VNET_HDR + 14 + 20) return 0;
    if (eth[12] != 0x08 || eth[13] != 0x00) return 0;
    uint32_t address;
    memcpy(&address, eth + 14 + 12, 4);
    return address;
}

static uint64_t head_due(const struct queue *q) {
    return q->count ? q->items[q->head].due : UINT64_MAX;
}

/* The wait until the next frame is due, of the queues whose socket takes frames (`full`
 * per side: a full socket's queue waits for POLLOUT instead). */
static int next_wait(struct timespec *out, uint64_t now, const int full[2]) {
    uint64_t due = full[1] ? UINT64_MAX : head_due(&towards_bridge);
    if (!full[0] && head_due(&towards_worker) < due) due = head_due(&towards_worker);
    if (!full[0] && head_due(&passing) < due) due = head_due(&passing);
    if (due == UINT64_MAX) return 0;
    uint64_t wait = due > now ? due - now : 0;
    out->tv_sec = (time_t)(wait / 1000000000ull);
    out->tv_nsec = (long)(wait % 1000000000ull);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s WORKER_IF BRIDGE_IF DELAY_NS BITS_PER_S LEADER_IPV4\n", argv[0]);
        return 2;
    }
    uint64_t delay = strtoull(argv[3], NULL, 10);
    double bits = strtod(argv[4], NULL);
    double ns_per_byte = bits > 0 ? 8e9 / bits : 0;
    struct in_addr leader;
    if (inet_pton(AF_INET, argv[5], &leader) != 1) {
        fprintf(stderr, "bad leader address %s\n", argv[5]);
        return 2;
    }
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    signal(SIGTERM, on_term);
    int worker = packet_socket(argv[1]), bridge = packet_socket(argv[2]);
    if (worker < 0 || bridge < 0) {
        perror("packet socket");
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    static unsigned char buffer[FRAME_BYTES];
    struct pollfd fds[2] = {{.fd = worker, .events = POLLIN}, {.fd = bridge, .events = POLLIN}};
    int full[2] = {0, 0}; /* a socket that refused a frame: wait until it takes more */
    while (!stopping) {
        struct timespec wait;
        int timed = next_wait(&wait, now_ns(), full);
        for (int i = 0; i < 2; i++) fds[i].events = POLLIN | (full[i] ? POLLOUT : 0);
        if (ppoll(fds, 2, timed ? &wait : NULL, NULL) < 0 && errno != EINTR) break;
        for (int i = 0; i < 2; i++) {
            if (!(fds[i].revents & POLLIN)) continue;
            for (;;) {
                struct sockaddr_ll from;
                socklen_t size = sizeof from;
                ssize_t len = recvfrom(fds[i].fd, buffer, sizeof buffer, 0,
                                       (struct sockaddr *)&from, &size);
                if (len <= 0) break;
                if (from.sll_pkttype == PACKET_OUTGOING) continue; /* our own sends */
                uint64_t now = now_ns();
                if (i == 0) {
                    hold(&towards_bridge, buffer, (size_t)len, now + delay, ns_per_byte);
                } else if (source_ipv4(buffer, (size_t)len) == leader.s_addr) {
                    hold(&towards_worker, buffer, (size_t)len, now + delay, ns_per_byte);
                } else {
                    hold(&passing, buffer, (size_t)len, now, 0);
                }
            }
        }
        uint64_t now = now_ns();
        full[1] = release(&towards_bridge, bridge, now);
        full[0] = release(&towards_worker, worker, now) || release(&passing, worker, now);
    }
    struct tpacket_stats seen[2];
    for (int i = 0; i < 2; i++) {
        socklen_t size = sizeof seen[i];
        if (getsockopt(fds[i].fd, SOL_PACKET, PACKET_STATISTICS, &seen[i], &size) < 0)
            seen[i].tp_drops = 0;
    }
    fprintf(stderr, "dropped %llu towards the bridge, %llu towards the worker, %u on receipt\n",
            (unsigned long long)towards_bridge.dropped,
            (unsigned long long)(towards_worker.dropped + passing.dropped),
            seen[0].tp_drops + seen[1].tp_drops);
    return 0;
}
