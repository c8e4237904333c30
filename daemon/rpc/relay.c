/* The TCP ports' relay: bytes both ways between a TCP client and a socket pair whose
 * other end gRPC serves, with the frame headers read on the way (see relay.h). */
#include "daemon/rpc/relay.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"

/* What the relay reads at once, and the socket pair's buffers: small, so that gRPC holds
 * little of a connection the relay has not judged yet. Probes send names. */
#define RELAY_CHUNK 16384
#define RELAY_SOCKET_BUFFER 16384

#define H2_PREFACE_BYTES 24
#define H2_FRAME_HEADER_BYTES 9
#define H2_DATA 0x0
#define H2_HEADERS 0x1
#define H2_RST_STREAM 0x3
#define H2_END_STREAM 0x1

/* One direction: what was read from `from` and not yet written to `to`, and where the
 * frame parser is. */
typedef struct relay_dir {
  int from, to;
  uint8_t buf[RELAY_CHUNK];
  size_t len, off;
  size_t preface_left; /* the client's connection preface is not framed */
  uint8_t header[H2_FRAME_HEADER_BYTES];
  size_t header_len;
  size_t payload_left;
} relay_dir_t;

struct fsdp_relay {
  uv_loop_t *loop;
  int client_fd, grpc_fd;
  int served_fd; /* the pair's other end, which gRPC serves and closes */
  fsdp_rpc_endpoint_t *endpoint;
  uv_poll_t client_poll, grpc_poll;
  int open_handles;
  bool closing;
  relay_dir_t up, down; /* client to gRPC, gRPC to client */
  char name[80];        /* the client's address, as gRPC writes it */
  const fsdp_relay_limits_t *limits;

  uint32_t last_stream; /* highest stream id the client opened */
  uint32_t *open;       /* ids of the streams open now */
  unsigned n_open;
  unsigned resets;
  uint64_t resets_since_ms;

  fsdp_relay_closed_fn closed;
  void *data;
};

static void update_polls(fsdp_relay_t *relay);

static void on_handle_closed(uv_handle_t *handle) {
  fsdp_relay_t *relay = handle->data;
  if (--relay->open_handles > 0)
    return;
  close(relay->client_fd);
  close(relay->grpc_fd);
  if (relay->closed)
    relay->closed(relay, relay->data);
  free(relay->open);
  free(relay);
}

void fsdp_relay_close(fsdp_relay_t *relay) {
  if (relay->closing)
    return;
  relay->closing = true;
  /* The client learns at once; gRPC sees the end of the pair and ends the calls. */
  shutdown(relay->client_fd, SHUT_RDWR);
  shutdown(relay->grpc_fd, SHUT_RDWR);
  uv_close((uv_handle_t *)&relay->client_poll, on_handle_closed);
  uv_close((uv_handle_t *)&relay->grpc_poll, on_handle_closed);
}

void fsdp_relay_forget(fsdp_relay_t *relay) {
  relay->closed = NULL;
}

int fsdp_relay_served_fd(const fsdp_relay_t *relay) {
  return relay->served_fd;
}

const char *fsdp_relay_client_name(const fsdp_relay_t *relay) {
  return relay->name;
}

static void stream_ended(fsdp_relay_t *relay, uint32_t id) {
  for (unsigned i = 0; i < relay->n_open; i++)
    if (relay->open[i] == id) {
      relay->open[i] = relay->open[--relay->n_open];
      return;
    }
}

static void cut(fsdp_relay_t *relay, const char *why, unsigned count, unsigned limit) {
  log_warning("%s: closed the connection from %s: %s (%u, at most %u)", relay->limits->port,
              relay->name, why, count, limit);
  fsdp_relay_close(relay);
}

/* One frame header, in either direction; false if the connection was cut for it. */
static bool on_frame(fsdp_relay_t *relay, bool from_client, uint8_t type, uint8_t flags,
                     uint32_t id) {
  if (!from_client) {
    bool ends = type == H2_RST_STREAM ||
                ((type == H2_HEADERS || type == H2_DATA) && (flags & H2_END_STREAM));
    if (ends)
      stream_ended(relay, id);
    return true;
  }
  if (type == H2_HEADERS && id > relay->last_stream && (id & 1)) {
    relay->last_stream = id;
    if (relay->n_open >= relay->limits->max_streams) {
      cut(relay, "more streams open at once than the port allows", relay->n_open + 1,
          relay->limits->max_streams);
      return false;
    }
    relay->open[relay->n_open++] = id;
  } else if (type == H2_RST_STREAM) {
    stream_ended(relay, id);
    uint64_t now = uv_now(relay->loop);
    if (now - relay->resets_since_ms >= FSDP_RELAY_RESET_WINDOW_MS) {
      relay->resets_since_ms = now;
      relay->resets = 0;
    }
    unsigned limit = fsdp_rpc_endpoint_connection_trusted(relay->endpoint, relay->served_fd)
                         ? relay->limits->max_resets
                         : relay->limits->max_resets_untrusted;
    if (++relay->resets > limit) {
      cut(relay, "more streams reset within 10 s than the port allows (HTTP/2 rapid reset)",
          relay->resets, limit);
      return false;
    }
  }
  return true;
}

/* Walks the bytes just read for frame headers; false if the connection was cut. */
static bool inspect(fsdp_relay_t *relay, relay_dir_t *d, const uint8_t *p, size_t n) {
  bool from_client = d == &relay->up;
  while (n > 0) {
    size_t k;
    if (d->preface_left > 0) {
      k = n < d->preface_left ? n : d->preface_left;
      d->preface_left -= k;
    } else if (d->payload_left > 0) {
      k = n < d->payload_left ? n : d->payload_left;
      d->payload_left -= k;
    } else {
      k = H2_FRAME_HEADER_BYTES - d->header_len;
      k = n < k ? n : k;
      memcpy(d->header + d->header_len, p, k);
      d->header_len += k;
      if (d->header_len == H2_FRAME_HEADER_BYTES) {
        const uint8_t *h = d->header;
        d->header_len = 0;
        d->payload_left = (size_t)h[0] << 16 | (size_t)h[1] << 8 | h[2];
        uint32_t id = ((uint32_t)h[5] << 24 | (uint32_t)h[6] << 16 | (uint32_t)h[7] << 8 | h[8]) &
                      0x7fffffffu;
        if (!on_frame(relay, from_client, h[3], h[4], id))
          return false;
      }
    }
    p += k;
    n -= k;
  }
  return true;
}

/* Writes what is pending in d; false if the connection ended. */
static bool flush(relay_dir_t *d) {
  while (d->off < d->len) {
    ssize_t w = send(d->to, d->buf + d->off, d->len - d->off, MSG_NOSIGNAL);
    if (w < 0)
      return errno == EAGAIN || errno == EINTR;
    d->off += (size_t)w;
  }
  d->len = d->off = 0;
  return true;
}

/* Reads once from d's source if nothing is pending; false if the connection ended. */
static bool pull(fsdp_relay_t *relay, relay_dir_t *d) {
  if (d->len > 0)
    return true;
  ssize_t n = recv(d->from, d->buf, sizeof d->buf, 0);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
    return false;
  if (n < 0)
    return true;
  if (!inspect(relay, d, d->buf, (size_t)n))
    return false;
  d->len = (size_t)n;
  d->off = 0;
  return flush(d);
}

static void on_event(uv_poll_t *poll, int status, int events) {
  fsdp_relay_t *relay = poll->data;
  if (relay->closing)
    return;
  bool client = poll == &relay->client_poll;
  relay_dir_t *in = client ? &relay->up : &relay->down;
  relay_dir_t *out = client ? &relay->down : &relay->up;
  bool ok = status == 0;
  if (ok && (events & UV_WRITABLE))
    ok = flush(out);
  if (ok && (events & (UV_READABLE | UV_DISCONNECT)))
    ok = pull(relay, in);
  if (!ok) {
    fsdp_relay_close(relay);
    return;
  }
  update_polls(relay);
}

/* Each side is read only when what was read from it before has been written on, so a side
 * that does not take its bytes holds the other back (and the memory stays this struct). */
static void update_polls(fsdp_relay_t *relay) {
  if (relay->closing)
    return;
  int client_events = (relay->up.len == 0 ? UV_READABLE | UV_DISCONNECT : 0) |
                      (relay->down.len > 0 ? UV_WRITABLE : 0);
  int grpc_events = (relay->down.len == 0 ? UV_READABLE | UV_DISCONNECT : 0) |
                    (relay->up.len > 0 ? UV_WRITABLE : 0);
  uv_poll_start(&relay->client_poll, client_events, on_event);
  uv_poll_start(&relay->grpc_poll, grpc_events, on_event);
}

int fsdp_relay_start(uv_loop_t *loop, int client_fd, fsdp_rpc_endpoint_t *endpoint,
                     const fsdp_relay_limits_t *limits, fsdp_relay_closed_fn closed, void *data,
                     fsdp_relay_t **ret_relay) {
  fsdp_relay_t *relay = calloc(1, sizeof *relay);
  uint32_t *open = calloc(limits->max_streams ? limits->max_streams : 1, sizeof *open);
  int pair[2];
  if (!relay || !open) {
    free(relay);
    free(open);
    close(client_fd);
    return -ENOMEM;
  }
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, pair) < 0) {
    int err = errno;
    free(relay);
    free(open);
    close(client_fd);
    return -err;
  }
  int size = RELAY_SOCKET_BUFFER;
  for (int i = 0; i < 2; i++) {
    setsockopt(pair[i], SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    setsockopt(pair[i], SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
  }
  *relay = (fsdp_relay_t){.loop = loop, .client_fd = client_fd, .grpc_fd = pair[0],
                          .served_fd = pair[1], .endpoint = endpoint,
                          .open = open, .limits = limits, .closed = closed,
                          .data = data, .resets_since_ms = uv_now(loop)};
  relay->up = (relay_dir_t){.from = client_fd, .to = pair[0], .preface_left = H2_PREFACE_BYTES};
  relay->down = (relay_dir_t){.from = pair[0], .to = client_fd};
  struct sockaddr_storage addr;
  socklen_t len = sizeof addr;
  char host[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  bool six = false;
  if (getpeername(client_fd, (struct sockaddr *)&addr, &len) == 0) {
    const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)&addr;
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)&addr;
    six = addr.ss_family == AF_INET6;
    /* As gRPC names a client: an IPv4 one on an IPv6 socket is ipv4 too. */
    if (six && IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
      inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], host, sizeof host);
      six = false;
    } else {
      inet_ntop(addr.ss_family, six ? (const void *)&v6->sin6_addr : (const void *)&v4->sin_addr,
                host, sizeof host);
    }
    port = ntohs(addr.ss_family == AF_INET6 ? v6->sin6_port : v4->sin_port);
  }
  snprintf(relay->name, sizeof relay->name, "%s:%s%s%s:%u", six ? "ipv6" : "ipv4",
           six ? "[" : "", host, six ? "]" : "", port);
  /* epoll can refuse a descriptor (ENOMEM, or ENOSPC past fs.epoll.max_user_watches): the
   * connection is then refused, and the daemon serves on. */
  int r = uv_poll_init(loop, &relay->client_poll, client_fd);
  if (r < 0) {
    close(pair[0]);
    close(pair[1]);
    close(client_fd);
    free(open);
    free(relay);
    return r;
  }
  relay->client_poll.data = relay;
  relay->open_handles = 1;
  if ((r = uv_poll_init(loop, &relay->grpc_poll, pair[0])) < 0) {
    /* The client's handle is open: its close frees the relay and its two descriptors. */
    relay->closed = NULL;
    close(pair[1]);
    uv_close((uv_handle_t *)&relay->client_poll, on_handle_closed);
    return r;
  }
  relay->grpc_poll.data = relay;
  relay->open_handles = 2;
  fsdp_rpc_endpoint_adopt(endpoint, pair[1], relay->name);
  update_polls(relay);
  *ret_relay = relay;
  return 0;
}
